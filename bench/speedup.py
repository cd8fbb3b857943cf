"""Speedup of a run's drafter with the reference decoder: batch 1, greedy, held-out prompts.

    python bench/speedup.py runs/demo [--prompts 64] [--new-tokens 256] [--dtype bfloat16] [--device auto]
                                      [--engine auto|eager|static|cuda-graphs]
    python bench/speedup.py runs/tiny --prompts 2 --new-tokens 16          # a CPU smoke run

Prints one JSON line: tau of each way the drafter's method drafts (EAGLE-3: chain and tree; DFlash:
block), autoregressive and speculative tokens/s, the speedup, the draft/target cost ratio c, and
Leviathan's bound for the measured α and c. Every
speculative output is checked against the target's own greedy output (ties counted, not failed).
The first prompt is decoded once untimed, so one-time costs (kernel selection, allocator growth, the
capture of every decode step's CUDA graph) are not charged to either side. The engine (eval.engine,
speculate.make_runner) is the same for the autoregressive baseline and speculation; on CUDA the default
is the static KV cache with CUDA graphs, and the line says which engine really ran (a failed capture
falls back to the static cache without graphs, and says so).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdraft import environment
from specdraft.decoding import runners
from specdraft.decoding.tree import decode_capacity
from specdraft.methods import load_trained
from specdraft.run import RunFolder
from specdraft.stages import eval as eval_stage
from specdraft.targets import resolve_device


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="a run folder with a trained drafter (specdraft demo makes runs/demo)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32", help="float32 keeps greedy speculation exact (docs/engine-facts.md)")
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--engine",
        default=None,
        choices=runners.ENGINES,
        help="default: the recipe's eval.engine (auto: cuda-graphs on CUDA, eager elsewhere)",
    )
    ap.add_argument("--K", type=int, default=None, help="chain length (default: the recipe's eval.draft_tokens)")
    ap.add_argument("--tree", default=None, metavar="TOPK,DEPTH,TOKENS", help="default: the recipe's eval.tree_*")
    ap.add_argument("--prompts-file", default=None, help="a JSONL of prompts instead of the run's held-out split")
    args = ap.parse_args()

    run = RunFolder(Path(args.run))
    recipe = run.recipe()
    cfg = recipe.eval
    cfg.num_prompts, cfg.max_new_tokens, cfg.dtype, cfg.device = args.prompts, args.new_tokens, args.dtype, args.device
    if args.K:
        cfg.draft_tokens = args.K
    if args.tree:
        cfg.tree_topk, cfg.tree_depth, cfg.tree_tokens = (int(x) for x in args.tree.split(","))
    if args.prompts_file:
        cfg.prompts_file = args.prompts_file
    if args.engine:
        cfg.engine = args.engine
    device = torch.device(resolve_device(cfg.device))
    drafter, target, _ = load_trained(recipe, run)
    drafter = drafter.to(device=device, dtype=getattr(torch, cfg.dtype))
    runner = runners.make_runner(target, target.load_model(cfg.dtype, device=str(device)), cfg.engine)
    prompts = eval_stage.load_prompts(recipe, target)
    runner.reserve(decode_capacity(prompts, cfg))  # the warm-up then captures the graphs the run replays

    warm = type(cfg)(**{**vars(cfg), "max_new_tokens": min(cfg.max_new_tokens, 32)})
    eval_stage.evaluate(runner, drafter, prompts[:1], warm, target.eos_token_id)
    t0 = time.time()
    r = eval_stage.evaluate(runner, drafter, prompts, cfg, target.eos_token_id)
    ways = [k for k in r if isinstance(r[k], dict) and "tau" in r[k]]  # chain and tree, or DFlash's block
    line = {
        "bench": "speedup",
        "run": str(run.path),
        "method": drafter.METHOD,
        "prompts": len(prompts),
        "max_new_tokens": cfg.max_new_tokens,
        "dtype": cfg.dtype,
        "device": str(device),
        "engine": r["engine"],
        "batch": 1,
        "greedy": True,
        "ar_tokens_per_s": r["autoregressive_tokens_per_s"],
    }
    for way in ways:
        w = r[way]
        line.update(
            {
                way: w["shape"],
                f"tau_{way}": w["tau"],
                f"per_position_acceptance_{way}": w["per_position_acceptance"],
                f"spec_tokens_per_s_{way}": w["speculative_tokens_per_s"],
                f"speedup_{way}": w["speedup"],
                f"c_{way}": w["draft_to_target_cost"],
                f"alpha_{way}": w["alpha"],
                f"bound_{way}": w["leviathan_bound"],
                f"round_cost_{way}": w["round_cost"],
                f"speedup_over_bound_{way}": round(w["speedup"] / w["leviathan_bound"], 3),
                f"exact_prompts_{way}": w["exact_prompts"],
                f"numerical_ties_{way}": w["numerical_ties"],
            }
        )
    line.update(
        {
            "seconds_per_prompt": r["seconds_per_prompt"],
            "seconds_per_prompt_max": {
                k: max(p["seconds"][k] for p in r["per_prompt"]) for k in r["seconds_per_prompt"]
            },
            "seconds": round(time.time() - t0, 1),
            "hardware": environment.hardware_line(),
        }
    )
    print(json.dumps(line))


if __name__ == "__main__":
    main()
