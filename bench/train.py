"""Training speed of the EAGLE-3 trainer (TTT) and the DFlash trainer (DFlashObjective): one JSON line
per configuration.

    python bench/train.py [--configs smollm2,llama8b,smollm2-dflash] [--compile off,on] [--steps 20] [--tiny]

Configurations, on random inputs shaped like packed training rows (documents of random lengths):
  smollm2  the SmolLM2-135M drafter, 3 TTT steps, draft vocab 8,192, 8,192-token packed rows
           (the speculators trainer ran this at ~160 k tok/s on an H200: bench/RESULTS.md)
  llama8b  a Llama-3.1-8B-shaped drafter (hidden 4096, 32/8 heads, intermediate 14336, draft vocab
           32,000, target vocab 128,256), 7 TTT steps
  smollm2-dflash[-L]  a DFlash drafter for SmolLM2-135M: L decoder layers (default 5, as the published
           drafters), blocks of 16, up to 512 blocks per 8,192-token row, the target's own lm_head (frozen)
Figures: tokens/s, model FLOPs per token (counted below), TFLOP/s, MFU against 790 TFLOP/s (H200
bf16 dense), peak memory. Without CUDA (or with --tiny) each shape is scaled down so it runs on a CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from specdraft import environment
from specdraft.drafters.common import PAD_DOCUMENT
from specdraft.methods.dflash.drafter import DFlashConfig, DFlashDrafter
from specdraft.methods.dflash.objective import DFlashObjective
from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter
from specdraft.methods.eagle3.objective import TTT

# H200 bf16 dense matrix peak (measured 788 TFLOP/s on 8192^3 products on these machines).
PEAK_TFLOPS = 790.0
# Share of positions that are assistant tokens (loss-masked) in a typical chat sample.
ANSWER_SHARE = 0.7
# Document lengths of the packed rows: ShareGPT first turns with 128-512-token answers span about this.
DOC_TOKENS = (128, 1536)
# Different packed rows cycled through the timed steps.
BATCHES = 4

CONFIGS = {
    "smollm2": dict(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        draft_vocab_size=8192,
        target_hidden_size=576,
        ttt_steps=3,
        batch_tokens=8192,
    ),
    "llama8b": dict(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        draft_vocab_size=32000,
        target_hidden_size=4096,
        ttt_steps=7,
        batch_tokens=8192,
    ),
}
DFLASH = {
    "smollm2-dflash": dict(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        draft_vocab_size=49152,
        target_hidden_size=576,
        block_size=16,
        num_layers=5,
        batch_tokens=8192,
        anchors=512,
    ),
}
# CPU-sized: the same code path, shapes divided down so a step takes well under a second on 2 cores.
TINY = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=4096,
    draft_vocab_size=512,
    target_hidden_size=64,
    batch_tokens=512,
)


def doc_lengths(total: int, rng: random.Random) -> list[int]:
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(rng.randint(*DOC_TOKENS), total - sum(lengths)))
    return lengths


def random_batch(cfg: DrafterConfig, tokens: int, device, seed: int = 0) -> dict:
    """One packed row [1, tokens] of random documents, with the tensors the trainer reads."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    lengths = doc_lengths(tokens, rng)
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    n_aux = len(cfg.aux_layer_ids)
    batch = {
        "input_ids": torch.randint(0, cfg.vocab_size, (1, tokens), generator=g),
        "loss_mask": torch.rand(1, tokens, generator=g) < ANSWER_SHARE,
        "documents": documents[None],
        "positions": positions[None],
        "top": torch.randint(0, cfg.vocab_size, (1, tokens), generator=g),
        "aux": torch.randn(1, tokens, n_aux * cfg.target_hidden_size, generator=g).to(torch.bfloat16),
        "last": torch.randn(1, tokens, cfg.target_hidden_size, generator=g).to(torch.bfloat16),
    }
    assert (batch["documents"] != PAD_DOCUMENT).all()
    return {k: v.to(device) for k, v in batch.items()}, lengths


def flops_per_token(cfg: DrafterConfig, steps: int, lengths: list[int]) -> float:
    """Model FLOPs per training token: 2 per multiply-add; backward = 2x forward for trained layers.

    Per TTT step: q/k/v (input 2H), o, the MLP, lm_head (H x draft vocab) and attention (base keys of
    the same document, causal, plus the diagonal keys of earlier steps), forward + backward. Once per
    token: fc (forward + weight gradient: its input needs no gradient) and the frozen target head over
    the draft vocab (forward only, for the target distribution).
    """
    H, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    proj = 2 * H * (nh + 2 * nkv) * d + nh * d * H  # q, k, v, o weights
    mlp = 3 * H * cfg.intermediate_size
    head = H * cfg.draft_vocab_size
    tokens = sum(lengths)
    keys_per_query = sum(n * (n + 1) / 2 for n in lengths) / tokens  # causal within the document
    per_step = 0.0
    for i in range(steps):
        attn = 2 * nh * d * (keys_per_query + i)  # QK^T and PV, multiply-adds
        per_step += 3 * 2 * (proj + mlp + head + attn)
    fc = 2 * 2 * len(cfg.aux_layer_ids) * cfg.target_hidden_size * H
    target_head = 2 * H * cfg.draft_vocab_size
    return per_step + fc + target_head


def dflash_flops_per_token(cfg: DFlashConfig, anchors: int, lengths: list[int]) -> float:
    """Model FLOPs per training token of the DFlash objective (2 per multiply-add, backward = 2x forward
    for trained weights, 1x for frozen ones that pass gradients on).

    Per block slot (anchors x block_size of them per row, fewer where a row has fewer answer tokens): every
    layer's q/k/v/o and MLP, attention over the context keys the slot sees (its document's positions before
    its anchor, about half the document on average) and its block's keys, forward + backward; the frozen
    shared lm_head, forward + input gradient. Per token: fc and every layer's k/v projections of the
    context feature (forward + backward), and the frozen target head (forward: the target distribution).
    The dense context scores the implementation computes over the whole row are not counted: model FLOPs.
    """
    H, nh, nkv, d, L = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_layers
    proj = 2 * H * (nh + 2 * nkv) * d + nh * d * H
    mlp = 3 * H * cfg.intermediate_size
    tokens = sum(lengths)
    keys = sum(n * n / 2 for n in lengths) / tokens + cfg.block_size  # context before the anchor + the block
    per_slot = L * 3 * 2 * (proj + mlp + 2 * nh * d * keys) + 2 * 2 * H * cfg.draft_vocab_size
    row = tokens / BATCHES  # tokens per packed row
    slots_per_token = min(anchors, row * ANSWER_SHARE) * cfg.block_size / row
    per_token = (
        3 * 2 * len(cfg.aux_layer_ids) * cfg.target_hidden_size * H
        + L * 3 * 2 * H * 2 * nkv * d
        + 2 * H * cfg.draft_vocab_size
    )
    return per_slot * slots_per_token + per_token


def eagle3_model(shape: dict) -> tuple[torch.nn.Module, object, dict, callable]:
    """The TTT objective of a drafter shaped `shape`, its config, the line's own fields, its FLOPs rule."""
    ttt_steps = shape.pop("ttt_steps")
    cfg = DrafterConfig(**shape, aux_layer_ids=[2, 15, 27])
    drafter = Eagle3Drafter(cfg)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]] = True
    drafter.t2d.copy_(t2d)
    drafter.d2t.copy_(t2d.nonzero().squeeze(1) - torch.arange(cfg.draft_vocab_size))
    draft_head = torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size) * cfg.target_hidden_size**-0.5
    return (
        TTT(drafter, draft_head, ttt_steps, 0.8),
        cfg,
        {"ttt_steps": ttt_steps},
        lambda lengths: flops_per_token(cfg, ttt_steps, lengths),
    )


def dflash_model(shape: dict) -> tuple[torch.nn.Module, object, dict, callable]:
    """The DFlash objective of a drafter shaped `shape` (over the target's whole vocabulary, its lm_head
    frozen as the published drafters share the target's)."""
    anchors = shape.pop("anchors")
    cfg = DFlashConfig(**shape, mask_token_id=shape["vocab_size"] - 1, aux_layer_ids=[2, 15, 27])
    drafter = DFlashDrafter(cfg)
    draft_head = torch.randn(cfg.draft_vocab_size, cfg.target_hidden_size) * cfg.target_hidden_size**-0.5
    model = DFlashObjective(drafter, draft_head, max_anchors=anchors)
    model.generator = torch.Generator().manual_seed(0)
    return (
        model,
        cfg,
        {"method": "dflash", "layers": cfg.num_layers, "block_size": cfg.block_size, "anchors": anchors},
        lambda lengths: dflash_flops_per_token(cfg, anchors, lengths),
    )


def bench(name: str, shape: dict, compile_: bool, steps: int, warmup: int, device) -> dict:
    shape = dict(shape)
    tokens = shape.pop("batch_tokens")
    torch.manual_seed(0)
    model, cfg, fields, flops = (dflash_model if "anchors" in shape else eagle3_model)(shape)
    model = model.to(device)
    if compile_:
        model.drafter.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    # Distinct rows (other document boundaries each step), as in training: catches per-batch recompiles.
    batches = [random_batch(cfg, tokens, device, seed) for seed in range(BATCHES)]
    lengths = [n for _, ls in batches for n in ls]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(k):
        with autocast:
            loss, _ = model(batches[k % BATCHES][0])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for k in range(warmup):
        step(k)
    sync()
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for k in range(steps):
        loss = step(k)
    sync()
    seconds = (time.perf_counter() - t0) / steps
    fpt = flops(lengths)  # averaged over the rows' documents
    tflops = fpt * tokens / seconds / 1e12
    return {
        "bench": "train",
        "config": name,
        "compile": compile_,
        "device": device.type,
        "hardware": environment.hardware_line(),
        **fields,
        "batch_tokens": tokens,
        "documents_per_row": round(len(lengths) / BATCHES, 1),
        "hidden": cfg.hidden_size,
        "draft_vocab": cfg.draft_vocab_size,
        "trainable_params_m": round(sum(p.numel() for p in params) / 1e6, 1),
        "step_ms": round(seconds * 1e3, 2),
        "tokens_per_s": round(tokens / seconds),
        "model_gflops_per_token": round(fpt / 1e9, 4),
        "tflops": round(tflops, 2),
        "mfu": round(tflops / PEAK_TFLOPS, 4) if device.type == "cuda" else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "warmup_s": round(warmup_s, 1),
        "final_loss": round(loss.item(), 4),
        "torch": torch.__version__,
    }


def config(name: str) -> dict:
    """CONFIGS[name], or a DFlash configuration: "smollm2-dflash" or "smollm2-dflash-L" for L layers."""
    if name in CONFIGS:
        return CONFIGS[name]
    base, _, layers = name.rpartition("-") if name.rsplit("-", 1)[-1].isdigit() else (name, "", "")
    return {**DFLASH[base], **({"num_layers": int(layers)} if layers else {})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="smollm2,llama8b")
    ap.add_argument("--compile", default="off,on", help="off, on, or off,on")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="CPU-sized shapes (the default without CUDA)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    for name in args.configs.split(","):
        shape = {**config(name), **(TINY if tiny else {})}
        if tiny and "anchors" in shape:  # the tiny target's whole vocabulary, as the real one shares it
            shape.update(draft_vocab_size=TINY["vocab_size"], anchors=16)
        for c in args.compile.split(","):
            try:
                print(
                    json.dumps(
                        bench(name + ("-tiny" if tiny else ""), shape, c == "on", args.steps, args.warmup, device)
                    ),
                    flush=True,
                )
            except Exception as e:  # one failing configuration must not hide the others' figures
                print(
                    json.dumps(
                        {
                            "bench": "train",
                            "config": name,
                            "compile": c == "on",
                            "error": f"{type(e).__name__}: {e}"[:2000],
                        }
                    ),
                    flush=True,
                )
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
