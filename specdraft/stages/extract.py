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
import functools
import hashlib
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdraft.config import ExtractConfig, Recipe
from specdraft.data.tokens import load_tokens
from specdraft.files import save_safetensors
from specdraft.hidden.capture import (
    VllmStates,
    forward_states,
    load_target_model,
    resolved,
    to_host,
)
from specdraft.hidden.store import (
    INDEX,
    bytes_per_token,
    disk_bytes_per_token,
    encode_states,
    shard_header,
    shard_name,
    token_batches,
)
from specdraft.run import RunFolder, atomic_path, write_json
from specdraft.targets import Target

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


def shard_plan_hash(
    target_desc: dict, cfg: ExtractConfig, members: list[int], samples: list[tuple[list[int], list[int]]]
) -> str:
    """What a shard's content depends on: the target, its layers, the dtypes and the exact tokens."""
    h = hashlib.sha256(
        json.dumps(
            {
                "format": FORMAT,
                "target": target_desc,
                "dtype": cfg.dtype,
                "store_dtype": cfg.store_dtype,
                "members": members,
            },
            sort_keys=True,
        ).encode()
    )
    for i in members:
        h.update(json.dumps(samples[i]).encode())
    return h.hexdigest()[:32]


def check_disk(out: Path, need_bytes: int, margin: float, tokens: int, store_dtype: str, alt_bytes: int | None) -> None:
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
        f"{(want - free) / GB:.2f} GB missing. Free disk, or use " + ", or ".join(hints)
    )


def extract(
    target: Target,
    samples: list[tuple[list[int], list[int]]],
    out: Path,
    cfg: ExtractConfig,
    model=None,
    states: VllmStates | None = None,
) -> dict:
    """Write the hidden states of `samples` as shards under `out` (resuming); return what it did.
    `states`: for the vllm backend, a VllmStates of a server already running (else one is started)."""
    cfg = resolved(cfg)
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
        "shards": [
            {"name": shard_name(n), "tokens": sum(lengths[i] for i in m), "samples": len(m), "plan": p}
            for n, (m, p) in enumerate(zip(shards, plans))
        ],
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
    print(
        f"extract: {len(samples)} samples, {total:,} tokens x {bpt:,} bytes/token ({cfg.store_dtype}) = "
        f"{total * bpt / GB:.2f} GB in {len(shards)} shards; {len(todo)} to write "
        f"({todo_tokens * bpt / GB:.2f} GB), {shutil.disk_usage(out).free / GB:.1f} GB free",
        flush=True,
    )
    check_disk(out, todo_tokens * bpt, cfg.disk_margin, todo_tokens, cfg.store_dtype, alt)
    write_json(out / INDEX, index)

    stats = {"tokens_written": todo_tokens, "shards_written": len(todo), "bytes_written": 0, "seconds": 0.0}
    if todo:
        with contextlib.ExitStack() as stack:
            if cfg.backend == "vllm":
                server = stack.enter_context(states or VllmStates(target, cfg, out / ".vllm", max(lengths)))
                forward = server.forward
            elif cfg.backend == "transformers":
                model = model if model is not None else load_target_model(target, cfg)
                forward = functools.partial(forward_states, model, target)
            else:
                raise ValueError(f"extract.backend = {cfg.backend!r}: expected 'transformers' or 'vllm'")
            _write_shards(forward, samples, lengths, shards, todo, plans, out, cfg, len(target.aux_layer_ids), stats)
    index["state"] = "done"
    write_json(out / INDEX, index)
    stats.update(
        samples=len(samples),
        tokens=total,
        shards=len(shards),
        bytes_per_token=index["bytes_per_token"],
        disk_bytes_per_token=bpt,
        disk_bytes=sum((out / s["name"]).stat().st_size for s in index["shards"]),
    )
    return stats


def _write_shards(
    forward, samples, lengths, shards, todo, plans, out: Path, cfg: ExtractConfig, num_aux: int, stats: dict
) -> None:
    """Compute the `todo` shards batch by batch with `forward` and write each one (in a thread)."""
    import torch
    from tqdm import tqdm

    bar = tqdm(total=stats["tokens_written"], desc="extract", unit="tok", unit_scale=True)
    writer = ThreadPoolExecutor(max_workers=1)  # one shard written while the next one computes
    pending = None

    def write(n: int, parts: list[dict], event) -> int:
        if event is not None:
            event.synchronize()
        tensors = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        with atomic_path(out / shard_name(n)) as tmp:
            save_safetensors(tensors, tmp, metadata={"plan": plans[n]})
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


def run(recipe: Recipe, folder: RunFolder) -> dict:
    cfg = resolved(recipe.extract)
    t_start = time.time()
    folder.require("render")
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)
    _, samples = load_tokens(folder.tokens, target.vocab_size)
    stats = extract(target, samples, folder.hidden, cfg)
    seconds = stats["seconds"]
    counts = {k: stats[k] for k in ("samples", "tokens", "shards", "shards_written", "tokens_written", "disk_bytes")}
    metrics = {
        "bytes_per_token": stats["bytes_per_token"],
        "disk_bytes_per_token": stats["disk_bytes_per_token"],
        "tokens_per_s": round(stats["tokens_written"] / seconds, 1) if seconds else None,
        "mb_per_s_written": round(stats["bytes_written"] / 1e6 / seconds, 1) if seconds else None,
    }
    print(f"next: specdraft train --run {folder.path}")
    return folder.record(
        "extract",
        state="done",
        config=cfg,
        counts=counts,
        metrics=metrics,
        seconds=time.time() - t_start,
        extra={"aux_layer_ids": target.aux_layer_ids, "store_dtype": cfg.store_dtype},
    )
