"""Extraction speed against the bare forward pass: one JSON line of figures.

    python bench/extract.py                          # tiny on the CPU (20 K tokens)
    python bench/extract.py --tokens 4000000         # the H200 bar: >= 4 M tokens of rendered ShareGPT

Renders ShareGPT conversations with the target's own chat template until `--tokens` are reached (or
reads already rendered ones: `--samples runs/x/tokens/tokens.safetensors`), plans the same shards and
length-bucketed batches as `specdraft extract`, times the target's decoder alone on those batches
(the bare forward pass: no hooks, nothing copied or written), then runs the real extraction into a
scratch folder on the same model and batches. The goal is extraction/forward >= 0.9.

`--random-weights` builds the target from its config.json alone (same shapes, same speed, no
checkpoint): for machines that cannot hold the weights. The figures say which was used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specdraft import environment  # noqa: E402
from specdraft.config import ExtractConfig  # noqa: E402
from specdraft.hidden.capture import input_device, padded_batch
from specdraft.hidden.store import disk_bytes_per_token, token_batches  # noqa: E402
from specdraft.stages.extract import extract, forward_states, load_target_model, plan_shards
from specdraft.targets import Target, get_attr, resolve_device  # noqa: E402

# Batches timed before measuring: kernel selection, allocator warm-up, first-call overheads.
WARMUP_BATCHES = 3
# ShareGPT conversations run to tens of thousands of tokens; turns are added while the characters
# so far stay under this many per kept token (English text averages ~4 per token), so rendering does
# not tokenize long tails that max_length cuts off anyway.
CHARS_PER_TOKEN_CAP = 4


_worker_target: Target | None = None


def _init_worker(model: str) -> None:
    global _worker_target
    _worker_target = Target(model)


def _render(args: tuple[dict, int]) -> tuple[list[int], list[int]] | None:
    from specdraft.data.sources import DataError
    from specdraft.stages.render import render_conversation

    record, max_length = args
    try:
        ids, mask = render_conversation(_worker_target, record, max_length)
    except DataError:
        return None  # a template that drifts on this conversation: not a training sample
    return (ids, mask) if any(mask) else None


def _records(max_length: int):
    """ShareGPT conversations that open with the user, cut to the turns that can fit max_length."""
    from specdraft.data.sources import read_sharegpt

    for record in read_sharegpt():
        if record["messages"][0]["role"] != "user":
            continue  # the target answers users; conversations that open otherwise are not used
        messages, chars = [], 0
        for m in record["messages"]:
            if chars > max_length * CHARS_PER_TOKEN_CAP:
                break
            messages.append(m)
            chars += len(m["content"])
        if any(m["role"] == "assistant" for m in messages):
            yield {"id": record["id"], "messages": messages}, max_length


def render_sharegpt(model: str, tokens: int, max_length: int) -> list[tuple[list[int], list[int]]]:
    """Rendered ShareGPT conversations (the dataset's own answers) until `tokens` tokens, rendered by
    one process per core (the chat template and tokenizer run in Python: ~7 K tok/s per core)."""
    import multiprocessing
    import os

    from tqdm import tqdm

    samples, total = [], 0
    bar = tqdm(total=tokens, desc="render", unit="tok", unit_scale=True, file=sys.stderr)
    with multiprocessing.get_context("spawn").Pool(os.cpu_count(), _init_worker, (model,)) as pool:
        for sample in pool.imap(_render, _records(max_length), chunksize=8):
            if sample is None:
                continue
            samples.append(sample)
            total += len(sample[0])
            bar.update(len(sample[0]))
            if total >= tokens:
                break
        pool.terminate()
    bar.close()
    if total < tokens:
        print(f"bench: ShareGPT holds only {total:,} tokens at max length {max_length}", file=sys.stderr)
    return samples


def save_samples(samples: list[tuple[list[int], list[int]]], path: Path) -> None:
    """The samples in the render stage's tokens.safetensors layout (readable by --samples)."""
    from safetensors.torch import save_file

    offsets = [0]
    for ids, _ in samples:
        offsets.append(offsets[-1] + len(ids))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "input_ids": torch.tensor([t for ids, _ in samples for t in ids], dtype=torch.int32),
            "loss_mask": torch.tensor([m for _, mask in samples for m in mask], dtype=torch.uint8),
            "offsets": torch.tensor(offsets, dtype=torch.int64),
        },
        str(path),
    )


def read_samples(path: Path, tokens: int) -> list[tuple[list[int], list[int]]]:
    """Rendered samples from a `tokens.safetensors` of the render stage, up to `tokens` tokens."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    ids, mask, off = t["input_ids"].tolist(), t["loss_mask"].tolist(), t["offsets"].tolist()
    samples, total = [], 0
    for a, b in zip(off[:-1], off[1:]):
        if total >= tokens:
            break
        samples.append((ids[a:b], mask[a:b]))
        total += b - a
    return samples


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bare_forward(model, target: Target, samples, batches: list[list[int]]) -> float:
    """Seconds for the decoder alone (no lm_head, no hooks) over `batches`."""
    base = get_attr(model, target.family.decoder)
    device = input_device(model, target)
    synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            ids, attn = padded_batch([samples[i][0] for i in batch])
            if device.type == "cuda":  # as extract does: copies queued behind the running forward
                ids, attn = ids.pin_memory(), attn.pin_memory()
            base(
                input_ids=ids.to(device, non_blocking=True),
                attention_mask=attn.to(device, non_blocking=True),
                use_cache=False,
            )
    synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="target: bundled name, HF folder or .gguf")
    p.add_argument("--tokens", type=int, default=4_000_000 if on_gpu else 20_000)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--samples", type=Path, help="a render stage's tokens.safetensors instead of rendering ShareGPT")
    p.add_argument("--save-samples", type=Path, help="also write the rendered samples there (for --samples)")
    p.add_argument("--batch-tokens", type=int, default=65_536 if on_gpu else ExtractConfig.batch_tokens)
    p.add_argument("--store-dtype", default="bfloat16", choices=["bfloat16", "fp8_e4m3"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, help="scratch folder for the shards (default: a temporary folder, removed)")
    p.add_argument("--random-weights", action="store_true", help="build the target from its config alone")
    args = p.parse_args(argv)

    target = Target(args.model)
    cfg = dataclasses.replace(
        ExtractConfig(), batch_tokens=args.batch_tokens, store_dtype=args.store_dtype, dtype=args.dtype
    )
    t0 = time.time()
    samples = (
        read_samples(args.samples, args.tokens)
        if args.samples
        else render_sharegpt(args.model, args.tokens, args.max_length)
    )
    render_s = time.time() - t0
    if args.save_samples:
        save_samples(samples, args.save_samples)
    if args.random_weights:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(target.config, dtype=getattr(torch, cfg.dtype))
        model = model.to(resolve_device(cfg.device)).eval()
    else:
        model = load_target_model(target, cfg)
    lengths = [len(ids) for ids, _ in samples]
    bpt = disk_bytes_per_token(len(target.aux_layer_ids) + 1, target.hidden_size, cfg.store_dtype)
    batches = [
        b
        for shard in plan_shards(lengths, bpt, cfg.shard_bytes)
        for b in token_batches(shard, lengths, cfg.batch_tokens)
    ]
    tokens = sum(lengths)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)

    for batch in batches[:WARMUP_BATCHES]:
        forward_states(model, target, [samples[i][0] for i in batch])
    bare_forward(model, target, samples, batches[:WARMUP_BATCHES])
    forward_s = bare_forward(model, target, samples, batches)

    out = args.out or Path(tempfile.mkdtemp(prefix="specdraft-bench-extract-"))
    try:
        stats = extract(target, samples, out / "hidden", cfg, model=model)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    extract_tps = tokens / stats["seconds"]
    forward_tps = tokens / forward_s
    figures = {
        "bench": "extract",
        "hardware": environment.hardware_line(),
        "device": str(input_device(model, target)),
        "model": target.name,
        "weights": "random (config only)" if args.random_weights else "checkpoint",
        "dtype": cfg.dtype,
        "store_dtype": cfg.store_dtype,
        "samples": len(samples),
        "tokens": tokens,
        "batch_tokens": cfg.batch_tokens,
        "batches": len(batches),
        "padding_fraction": round(1 - tokens / padded, 4),
        "extract_tokens_per_s": round(extract_tps, 1),
        "forward_tokens_per_s": round(forward_tps, 1),
        "ratio": round(extract_tps / forward_tps, 3),
        "bytes_per_token": stats["bytes_per_token"],
        "disk_bytes_per_token": stats["disk_bytes_per_token"],
        "gb_written": round(stats["bytes_written"] / 1e9, 3),
        "mb_per_s_written": round(stats["bytes_written"] / 1e6 / stats["seconds"], 1),
        "render_s": round(render_s, 1),
        "torch": torch.__version__,
    }
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
