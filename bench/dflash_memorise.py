"""How fast a DFlash drafter memorises a run's samples: every sample in one packed batch, trained with the
DFlash objective as `train` builds it (bf16 autocast, AdamW, warmup then cosine, grad clip 1), printing
one JSON line of per-slot top-1 every `--every` steps, then probes of what the trained drafter reads:
its context with two aux layers swapped, with the aux states zeroed, and with another mask token.

    python bench/dflash_memorise.py RUN [--lr 3e-4] [--steps 120] [--draft-vocab 0] [--lm-head-init random]
        [--layers 1] [--block 4] [--out bench/results/dflash-memorise-cpu.jsonl]

RUN must have been through extract (the tests' memorised run: 8 ShareGPT samples, 32-token answers).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from specdraft import environment
from specdraft.config import TrainConfig
from specdraft.drafters import vocab
from specdraft.drafters.common import collate, pack, summarize
from specdraft.hidden.store import HiddenStore
from specdraft.methods import METHODS
from specdraft.targets import Target
from specdraft.training import target_top_tokens

BATCH_TOKENS = 4096


def setup(args) -> tuple:
    store = HiddenStore(args.run / "hidden")
    target = Target("smollm2", store.aux_layer_ids)
    idx = list(range(len(store)))
    counts = vocab.token_counts([store.tokens(i) for i in idx], target.vocab_size)
    cfg = TrainConfig(
        method="dflash",
        draft_vocab_size=args.draft_vocab,
        block_size=args.block,
        dflash_layers=args.layers,
        lm_head_init=args.lm_head_init,
        lr=args.lr,
        warmup_steps=args.warmup,
        batch_tokens=BATCH_TOKENS,
    )
    method = METHODS["dflash"]
    drafter = method.build(cfg, target, counts)
    head = target.head_weight()
    batch = collate(
        store, pack(idx, store.lengths, BATCH_TOKENS), target_top_tokens(store, head, idx), BATCH_TOKENS, fixed=False
    )
    objective = method.objective(drafter, head[drafter.t2d].float(), cfg)
    objective.generator = torch.Generator().manual_seed(args.seed)
    return drafter, objective, batch


def scored(objective, batch, autocast) -> dict:
    with torch.no_grad(), autocast:
        s = summarize(objective(batch)[1])
    return {"acc": [round(x, 3) for x in s["acc"]], "tau": round(s["tau"], 3)}


def probes(drafter, objective, batch, autocast) -> dict:
    """The trained drafter's top-1 as trained, and with its inputs broken three ways."""
    H = batch["aux"].shape[-1] // len(drafter.config.aux_layer_ids)
    aux = batch["aux"]
    swapped = {**batch, "aux": torch.cat([aux[..., H : 2 * H], aux[..., :H], aux[..., 2 * H :]], -1)}
    out = {
        "as trained": scored(objective, batch, autocast),
        "aux layers 0 and 1 swapped": scored(objective, swapped, autocast),
        "aux zeroed": scored(objective, {**batch, "aux": torch.zeros_like(aux)}, autocast),
    }
    mask = drafter.config.mask_token_id
    drafter.config.mask_token_id = 2  # eos: a frequent token, not the one trained with
    out["mask token = eos"] = scored(objective, batch, autocast)
    drafter.config.mask_token_id = mask
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=0)
    ap.add_argument("--lm-head-init", default="random", choices=["random", "target", "target-frozen"])
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    drafter, objective, batch = setup(args)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    decay = max(1, args.steps - args.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            (s + 1) / args.warmup
            if s < args.warmup
            else 0.5 * (1 + math.cos(math.pi * min(1.0, (s - args.warmup) / decay)))
        ),
    )
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    curve, t0 = [], time.time()
    for step in range(1, args.steps + 1):
        with autocast:
            loss, stats = objective(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.every == 0 or step in (1, args.steps):
            s = summarize(stats)
            curve.append(
                {
                    "step": step,
                    "seconds": round(time.time() - t0, 1),
                    "loss": round(loss.item(), 3),
                    "acc": [round(x, 3) for x in s["acc"]],
                }
            )
            print(json.dumps(curve[-1]), flush=True)
    drafter.eval()
    line = {
        "date": time.strftime("%Y-%m-%d"),
        "hardware": environment.hardware_line(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("run", "out", "every")},
        "curve": curve,
        "probes": probes(drafter, objective, batch, autocast),
    }
    print(json.dumps(line))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
