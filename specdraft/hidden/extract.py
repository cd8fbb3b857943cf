"""extract: run the target over the rendered samples and keep the aux + last hidden states.

Samples are sorted by length and batched by a token budget (little padding), the target's base
model runs without its lm_head, and hooks keep only the chosen layers. Shards are planned up front
from the sorted order, so a rerun after an interruption skips the shards already on disk (each one
written under a temporary name, then renamed) and redoes only the rest.
"""

from __future__ import annotations

import time

from ..config import Recipe
from ..data.render import load_tokens
from ..run import Run, atomic_path, write_json
from ..targets import Target, get_attr, tap_hidden_states
from .store import HIDDEN_DIR, INDEX, shard_name, token_batches


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


def _shard_complete(path, expected_keys: int) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return len(list(f.keys())) == expected_keys
    except Exception:  # a torn or foreign file: redo the shard
        return False


def run(recipe: Recipe, run: Run) -> dict:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    cfg = recipe.extract
    t_start = time.time()
    run.require("render")
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)
    tok_index, samples = load_tokens(run.path)
    lengths = [len(ids) for ids, _ in samples]
    dtype = getattr(torch, cfg.dtype)
    n_states = len(target.aux_layer_ids) + 1
    bytes_per_token = n_states * target.hidden_size * dtype.itemsize
    out = run.path / HIDDEN_DIR
    out.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(lengths, bytes_per_token, cfg.shard_bytes)
    index = {
        "state": "partial",
        "aux_layer_ids": target.aux_layer_ids,
        "last": "final_norm_output",
        "hidden_size": target.hidden_size,
        "dtype": cfg.dtype,
        "bytes_per_token": bytes_per_token,
        "target": target.describe(),
        "shards": [shard_name(n) for n in range(len(shards))],
        "samples": [{"key": str(i), "shard": shard_name(n), "tokens": lengths[i]}
                    for n, members in enumerate(shards) for i in members],
    }
    todo = [n for n, members in enumerate(shards)
            if not _shard_complete(out / shard_name(n), 4 * len(members))]
    total_tokens = sum(lengths[i] for n in todo for i in shards[n])
    print(f"extract: {len(samples)} samples, {sum(lengths):,} tokens, {bytes_per_token:,} bytes/token -> "
          f"{sum(lengths) * bytes_per_token / 2**30:.2f} GiB in {len(shards)} shards ({len(todo)} to write)")
    forward_seconds = 0.0
    if todo:
        model = target.load_model(cfg.dtype)
        base = get_attr(model, target.family.decoder)  # the decoder without lm_head
        bar = tqdm(total=total_tokens, desc="extract", unit="tok", unit_scale=True)
        for n in todo:
            tensors = {}
            for batch in token_batches(shards[n], lengths, cfg.batch_tokens):
                width = max(lengths[i] for i in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                attn = torch.zeros(len(batch), width, dtype=torch.long)
                for r, i in enumerate(batch):
                    ids[r, : lengths[i]] = torch.tensor(samples[i][0])
                    attn[r, : lengths[i]] = 1
                t0 = time.time()
                with torch.inference_mode(), tap_hidden_states(model, target.family, target.aux_layer_ids) as cap:
                    base(input_ids=ids, attention_mask=attn, use_cache=False)
                aux = torch.cat([cap[k] for k in target.aux_layer_ids], dim=-1)  # [B, T, n_aux*H]
                forward_seconds += time.time() - t0
                for r, i in enumerate(batch):
                    T = lengths[i]
                    tensors[f"{i}.aux"] = aux[r, :T].to(dtype).contiguous()
                    tensors[f"{i}.last"] = cap["last"][r, :T].to(dtype).contiguous()
                    tensors[f"{i}.input_ids"] = torch.tensor(samples[i][0], dtype=torch.int32)
                    tensors[f"{i}.loss_mask"] = torch.tensor(samples[i][1], dtype=torch.uint8)
                bar.update(sum(lengths[i] for i in batch))
            with atomic_path(out / shard_name(n)) as tmp:
                save_file(tensors, str(tmp))
            write_json(out / INDEX, index)
        bar.close()
    index["state"] = "done"
    write_json(out / INDEX, index)
    disk = sum((out / s).stat().st_size for s in index["shards"])
    counts = {"samples": len(samples), "tokens": sum(lengths), "shards": len(shards), "shards_written": len(todo),
              "disk_bytes": disk}
    metrics = {"bytes_per_token": bytes_per_token,
               "tokens_per_s": round(total_tokens / forward_seconds, 1) if forward_seconds else None}
    return run.record("extract", state="done", config=cfg, counts=counts, metrics=metrics,
                      seconds=time.time() - t_start, extra={"aux_layer_ids": target.aux_layer_ids})
