"""extract: run the target over the rendered samples and keep the aux + last hidden states.

Samples are sorted by length and batched by a token budget (little padding), the target's decoder
runs without its lm_head, and hooks keep only the chosen layers. The disk bill (tokens x bytes per
token) is printed and checked against free disk before anything runs. Shards are planned up front
from the sorted order, each written under a temporary name and renamed, its plan's hash in its
header; a rerun after an interruption keeps the shards whose header and size check out and redoes
the rest. On a GPU the states are copied to pinned memory asynchronously and shards are written by
a thread while the next shard computes.

`OnlineHidden` is the same forward pass run on demand, for training with no disk at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import ExtractConfig, Recipe
from ..data.render import load_tokens
from ..run import Run, atomic_path, write_json
from ..targets import Target, get_attr, resolve_device, resolve_dtype, tap_hidden_states
from .store import (HIDDEN_DIR, INDEX, STORE_DTYPES, _read_ahead, bytes_per_token, disk_bytes_per_token,
                    encode_states, shard_header, shard_name, token_batches)

# Format of index.json and the shards; bumped when the layout changes so old shards are redone.
FORMAT = 2
GB = 1e9


class DiskSpaceError(OSError):
    """Not enough free disk for the planned hidden states."""


def plan_shards(lengths: list[int], bytes_per_token: int, shard_bytes: int) -> list[list[int]]:
    """Sample indices grouped into shards of about `shard_bytes`, in ascending length order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    shards, current, size = [], [], 0
    for i in order:
        current.append(i)
        size += lengths[i] * bytes_per_token
        if size >= shard_bytes:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    return shards


def resolved(cfg: ExtractConfig) -> ExtractConfig:
    """`cfg` with dtype "auto" made the dtype of the machine the target runs on (a device_map spreads
    it over the GPUs where there are any)."""
    where = resolve_device("auto" if cfg.device_map else cfg.device)
    return dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, where))


def load_target_model(target: Target, cfg: ExtractConfig):
    """The target for extraction: on one device, or spread by `device_map` (e.g. "auto" over the node's
    GPUs, for targets that do not fit one)."""
    if cfg.device_map:
        return target.load_model(cfg.dtype, device_map=cfg.device_map)
    return target.load_model(cfg.dtype, cfg.device)


def input_device(model, target: Target):
    """Where the token ids go: the embedding's device (the first GPU of a device_map)."""
    return model.get_input_embeddings().weight.device


def padded_batch(rows: list[list[int]]):
    """Right-padded token ids and their attention mask, [B, longest row]."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        attn[r, : len(row)] = 1
    return ids, attn


def forward_states(model, target: Target, rows: list[list[int]]):
    """Run the decoder (no lm_head) on right-padded `rows`; return the aux states [N, n_aux*H] and the
    final-norm states [N, H] of the real tokens only, rows concatenated in order (N = total tokens),
    on the model's device."""
    import torch

    device = input_device(model, target)
    ids, attn = padded_batch(rows)
    width = ids.shape[1]
    # Flat positions of the real tokens, known on the host: selecting them needs no device sync.
    keep = torch.cat([torch.arange(r * width, r * width + len(row)) for r, row in enumerate(rows)])
    if device.type == "cuda":
        # From pinned memory the copies are queued behind the running forward instead of waiting for it.
        ids, attn, keep = ids.pin_memory(), attn.pin_memory(), keep.pin_memory()
    base = get_attr(model, target.family.decoder)
    with torch.inference_mode(), tap_hidden_states(model, target.family, target.aux_layer_ids) as cap:
        base(input_ids=ids.to(device, non_blocking=True), attention_mask=attn.to(device, non_blocking=True),
             use_cache=False)
        keep = keep.to(device, non_blocking=True)
        last = cap["last"]
        aux = torch.cat([cap[k].to(last.device) for k in target.aux_layer_ids], dim=-1)  # [B, W, n_aux*H]
        aux = aux.flatten(0, 1).index_select(0, keep)  # [N, n_aux*H]
        last = last.flatten(0, 1).index_select(0, keep.to(last.device))  # [N, H]
    return aux, last


class VllmStates:
    """The vllm backend: the same states as `forward_states`, computed by a vLLM server.

    vLLM's `extract_hidden_states` speculative method keeps the hidden states of the layers it is given
    in a cache-only KV layer, and a KV connector writes each finished request's states [T, n, H] to a
    safetensors file whose path the completion's `kv_transfer_params` names. Layer ids follow vLLM's
    convention (id k = the residual after k layers = transformers' output_hidden_states[k]); id L is the
    pre-norm residual, so the final norm is applied here to give the same `last` as the transformers
    backend. On the CPU build the connector is specdraft's host-side subclass (vllm_connector.py).
    """

    def __init__(self, target: Target, cfg: ExtractConfig, work_dir: Path, max_model_len: int):
        import torch

        from ..evaluate.server import VllmServer

        self.target = target
        self.dir = Path(work_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        layer_ids = [*target.aux_layer_ids, target.num_layers]
        on_gpu = torch.cuda.is_available()
        connector = {"kv_connector": "ExampleHiddenStatesConnector" if on_gpu else "HostHiddenStatesConnector",
                     "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(self.dir)}}
        if not on_gpu:
            connector["kv_connector_module_path"] = "specdraft.hidden.vllm_connector"
        speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                       "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
        repo_root = Path(__file__).resolve().parents[2]
        self.server = VllmServer(target.path, log_path=self.dir / "vllm.log", speculative=speculative,
                                 max_model_len=max_model_len + 1, dtype=cfg.dtype,
                                 extra=["--kv-transfer-config", json.dumps(connector), *cfg.vllm_args],
                                 env={"PYTHONPATH": str(repo_root)})
        self.norm_weight = target.read_tensor(f"{target.family.norm}.weight")
        self.norm_eps = target.text_config.rms_norm_eps
        self.dtype = getattr(torch, cfg.dtype)

    def __enter__(self) -> "VllmStates":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def _one(self, row: list[int]):
        import fcntl

        import httpx
        from safetensors.torch import load_file

        r = httpx.post(f"{self.server.url}/v1/completions", timeout=600,
                       json={"model": self.server.model, "prompt": row, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
        path = Path(r.json()["kv_transfer_params"]["hidden_states_path"])
        lock = path.with_name(path.name + ".lock")
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # the connector holds it exclusively until the file is written
            data = load_file(str(path))
        path.unlink()
        lock.unlink()
        if data["token_ids"].tolist() != row:
            raise RuntimeError(f"{path}: vLLM returned the states of other tokens than were sent")
        return data["hidden_states"]  # [T, n_aux + 1, H]

    def forward(self, rows: list[list[int]]):
        """Like forward_states: aux [N, n_aux*H] and final-norm last [N, H] of rows concatenated."""
        import torch

        with ThreadPoolExecutor(max_workers=len(rows)) as pool:  # concurrent requests: vLLM batches them
            states = torch.cat(list(pool.map(self._one, rows)))  # [N, n_aux + 1, H]
        aux = states[:, :-1].flatten(1).to(self.dtype)  # [N, n_aux*H]
        pre = states[:, -1].float()  # [N, H]: the residual before the final norm
        normed = pre * torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        last = self.norm_weight.to(self.dtype) * normed.to(self.dtype)  # as transformers' RMSNorm rounds
        return aux, last


def to_host(tensors: dict) -> dict:
    """Device tensors -> host tensors; from a GPU, asynchronously into pinned memory (the caller
    synchronizes before reading them)."""
    import torch

    out = {}
    for name, t in tensors.items():
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out[name] = host
        else:
            out[name] = t
    return out


def shard_plan_hash(target_desc: dict, cfg: ExtractConfig, members: list[int],
                    samples: list[tuple[list[int], list[int]]]) -> str:
    """What a shard's content depends on: the target, its layers, the dtypes and the exact tokens."""
    h = hashlib.sha256(json.dumps({"format": FORMAT, "target": target_desc, "dtype": cfg.dtype,
                                   "store_dtype": cfg.store_dtype, "members": members}, sort_keys=True).encode())
    for i in members:
        h.update(json.dumps(samples[i]).encode())
    return h.hexdigest()[:32]


def check_disk(out: Path, need_bytes: int, margin: float, tokens: int, store_dtype: str,
               alt_bytes: int | None) -> None:
    """Refuse to start when `need_bytes` plus `margin` does not fit in the free disk under `out`."""
    free = shutil.disk_usage(out).free
    want = int(need_bytes * (1 + margin))
    if want <= free:
        return
    hints = []
    if alt_bytes is not None:
        hints.append(f"--store-dtype fp8_e4m3 (needs {alt_bytes * (1 + margin) / GB:.2f} GB)")
    hints.append("training with --hidden online (needs no disk)")
    raise DiskSpaceError(
        f"{out}: extracting {tokens:,} tokens as {store_dtype} needs {want / GB:.2f} GB "
        f"({need_bytes / GB:.2f} GB + {margin:.0%} margin) but {free / GB:.2f} GB is free: "
        f"{(want - free) / GB:.2f} GB missing. Free disk, or use " + ", or ".join(hints))


def extract(target: Target, samples: list[tuple[list[int], list[int]]], out: Path, cfg: ExtractConfig,
            model=None) -> dict:
    """Write the hidden states of `samples` as shards under `out` (resuming); return what it did."""
    cfg = resolved(cfg)
    if cfg.store_dtype not in STORE_DTYPES:
        raise ValueError(f"extract.store_dtype = {cfg.store_dtype!r}: expected one of {list(STORE_DTYPES)}")
    lengths = [len(ids) for ids, _ in samples]
    n_states = len(target.aux_layer_ids) + 1
    bpt = disk_bytes_per_token(n_states, target.hidden_size, cfg.store_dtype)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".shard-*.tmp-*"):  # left by a killed run: never renamed, never valid
        stale.unlink()
    shards = plan_shards(lengths, bpt, cfg.shard_bytes)
    desc = target.describe()
    plans = [shard_plan_hash(desc, cfg, members, samples) for members in shards]
    placement = {}
    for n, members in enumerate(shards):
        offset = 0
        for i in members:
            placement[i] = {"shard": shard_name(n), "offset": offset, "tokens": lengths[i]}
            offset += lengths[i]
    index = {
        "state": "partial",
        "format": FORMAT,
        "aux_layer_ids": target.aux_layer_ids,
        "last": "final_norm_output",
        "hidden_size": target.hidden_size,
        "dtype": cfg.dtype,
        "store_dtype": cfg.store_dtype,
        "bytes_per_token": bytes_per_token(n_states, target.hidden_size, cfg.store_dtype),  # hidden states only
        "disk_bytes_per_token": bpt,  # with the token id and loss mask
        "target": desc,
        "shards": [{"name": shard_name(n), "tokens": sum(lengths[i] for i in m), "samples": len(m), "plan": p}
                   for n, (m, p) in enumerate(zip(shards, plans))],
        "samples": [placement[i] for i in range(len(samples))],
    }

    def complete(n: int) -> bool:
        header = shard_header(out / shard_name(n))
        return header is not None and header.get("__metadata__", {}).get("plan") == plans[n]

    todo = [n for n in range(len(shards)) if not complete(n)]
    todo_tokens = sum(lengths[i] for n in todo for i in shards[n])
    total = sum(lengths)
    alt = None
    if cfg.store_dtype != "fp8_e4m3":
        alt = todo_tokens * disk_bytes_per_token(n_states, target.hidden_size, "fp8_e4m3")
    print(f"extract: {len(samples)} samples, {total:,} tokens x {bpt:,} bytes/token ({cfg.store_dtype}) = "
          f"{total * bpt / GB:.2f} GB in {len(shards)} shards; {len(todo)} to write "
          f"({todo_tokens * bpt / GB:.2f} GB), {shutil.disk_usage(out).free / GB:.1f} GB free", flush=True)
    check_disk(out, todo_tokens * bpt, cfg.disk_margin, todo_tokens, cfg.store_dtype, alt)
    write_json(out / INDEX, index)

    stats = {"tokens_written": todo_tokens, "shards_written": len(todo), "bytes_written": 0, "seconds": 0.0}
    if todo:
        with contextlib.ExitStack() as stack:
            if cfg.backend == "vllm":
                server = stack.enter_context(VllmStates(target, cfg, out / ".vllm", max(lengths)))
                forward = server.forward
            elif cfg.backend == "transformers":
                model = model if model is not None else load_target_model(target, cfg)
                forward = functools.partial(forward_states, model, target)
            else:
                raise ValueError(f"extract.backend = {cfg.backend!r}: expected 'transformers' or 'vllm'")
            _write_shards(forward, samples, lengths, shards, todo, plans, out, cfg, len(target.aux_layer_ids),
                          stats)
    index["state"] = "done"
    write_json(out / INDEX, index)
    stats.update(samples=len(samples), tokens=total, shards=len(shards), bytes_per_token=index["bytes_per_token"],
                 disk_bytes_per_token=bpt,
                 disk_bytes=sum((out / s["name"]).stat().st_size for s in index["shards"]))
    return stats


def _write_shards(forward, samples, lengths, shards, todo, plans, out: Path, cfg: ExtractConfig, num_aux: int,
                  stats: dict) -> None:
    """Compute the `todo` shards batch by batch with `forward` and write each one (in a thread)."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    bar = tqdm(total=stats["tokens_written"], desc="extract", unit="tok", unit_scale=True)
    writer = ThreadPoolExecutor(max_workers=1)  # one shard written while the next one computes
    pending = None

    def write(n: int, parts: list[dict], event) -> int:
        if event is not None:
            event.synchronize()
        tensors = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        with atomic_path(out / shard_name(n)) as tmp:
            save_file(tensors, str(tmp), metadata={"plan": plans[n]})
        return (out / shard_name(n)).stat().st_size

    t0 = time.time()
    for n in todo:
        parts = []
        for batch in token_batches(shards[n], lengths, cfg.batch_tokens):
            rows = [samples[i][0] for i in batch]
            aux, last = forward(rows)
            stored = encode_states(aux, last, cfg.store_dtype, num_aux)
            parts.append(to_host(stored))
            parts[-1]["input_ids"] = torch.tensor([t for r in rows for t in r], dtype=torch.int32)
            parts[-1]["loss_mask"] = torch.tensor([m for i in batch for m in samples[i][1]], dtype=torch.uint8)
            bar.update(sum(lengths[i] for i in batch))
        event = None
        if torch.cuda.is_available() and any(t.is_pinned() for t in parts[0].values()):
            event = torch.cuda.Event()
            event.record()
        if pending is not None:
            stats["bytes_written"] += pending.result()
            bar.set_postfix(written=f"{stats['bytes_written'] / GB:.2f} GB")
        pending = writer.submit(write, n, parts, event)
    if pending is not None:
        stats["bytes_written"] += pending.result()
    writer.shutdown()
    stats["seconds"] = time.time() - t0
    bar.set_postfix(written=f"{stats['bytes_written'] / GB:.2f} GB")
    bar.close()


def run(recipe: Recipe, run: Run) -> dict:
    cfg = resolved(recipe.extract)
    t_start = time.time()
    run.require("render")
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)
    _, samples = load_tokens(run.path)
    stats = extract(target, samples, run.path / HIDDEN_DIR, cfg)
    seconds = stats["seconds"]
    counts = {k: stats[k] for k in ("samples", "tokens", "shards", "shards_written", "tokens_written",
                                    "disk_bytes")}
    metrics = {"bytes_per_token": stats["bytes_per_token"], "disk_bytes_per_token": stats["disk_bytes_per_token"],
               "tokens_per_s": round(stats["tokens_written"] / seconds, 1) if seconds else None,
               "mb_per_s_written": round(stats["bytes_written"] / 1e6 / seconds, 1) if seconds else None}
    print(f"next: specdraft train --run {run.path}")
    return run.record("extract", state="done", config=cfg, counts=counts, metrics=metrics,
                      seconds=time.time() - t_start,
                      extra={"aux_layer_ids": target.aux_layer_ids, "store_dtype": cfg.store_dtype})


class OnlineHidden:
    """The hidden states of the rendered samples, computed on access by the target in this process
    (nothing on disk). Same interface as HiddenStore; `batch()` runs one forward for many samples."""

    def __init__(self, recipe: Recipe, run: Run):
        run.require("render")
        cfg = resolved(recipe.extract)
        self.target = Target(recipe.target.model, recipe.target.aux_layer_ids)
        _, self.samples = load_tokens(run.path)
        self.lengths = [len(ids) for ids, _ in self.samples]
        self.aux_layer_ids: list[int] = self.target.aux_layer_ids
        self.hidden_size: int = self.target.hidden_size
        self.store_dtype = cfg.dtype  # what the states are computed in; nothing is stored
        self.model = load_target_model(self.target, cfg)

    def __len__(self) -> int:
        return len(self.samples)

    def last(self, i: int, device=None):
        last = self[i]["last"]
        return last.to(device) if device is not None else last

    def tokens(self, i: int) -> tuple[list[int], list[int]]:
        return list(self.samples[i][0]), list(self.samples[i][1])

    def batch(self, indices: list[int]) -> list[dict]:
        """One padded forward over `indices`; per sample the same dict as HiddenStore[i] (on the CPU)."""
        import torch

        aux, last = forward_states(self.model, self.target, [self.samples[i][0] for i in indices])
        aux, last = aux.to("cpu", torch.bfloat16), last.to("cpu", torch.bfloat16)
        out, offset = [], 0
        for i in indices:
            ids, mask = self.samples[i]
            T = len(ids)
            out.append({"input_ids": torch.tensor(ids, dtype=torch.int32),
                        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
                        "aux": aux[offset: offset + T], "last": last[offset: offset + T]})
            offset += T
        return out

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self.samples):
            raise IndexError(f"sample {i} outside 0..{len(self.samples) - 1}")
        return self.batch([i])[0]

    def loader(self, batches: list[list[int]], num_workers: int = 0, prefetch: int = 2):
        """Like HiddenStore.loader; the forward of the next batches runs in a thread while the caller
        trains. Worker processes would each need their own copy of the target, so there are none."""
        if num_workers:
            raise ValueError("online hidden states are computed by the target in this process: num_workers must "
                             "be 0 (use prefetch to overlap the target's forward with training)")
        return _read_ahead(self.batch, batches, prefetch)
