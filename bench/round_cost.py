"""Where a speculative round's time goes, for each drafter method at the same K on the same engine.

    python bench/round_cost.py RUN [RUN ...] [--engine eager static ...] [--prompts 8] [--new-tokens 64]
                               [--K 3] [--target-model PATH] [--label before] [--out FILE.jsonl]

Each RUN holds a trained drafter (EAGLE-3, DFlash, ...); all must share one target. Every run's first
drafting (EAGLE-3: its chain of K; a block method: its block) decodes the same prompts (the first RUN's
conversations: the memorised drafters' own prompts; or its held-out split with --held-out) on each engine,
greedy, batch 1, after one untimed warm-up prompt (kernel choice, graph capture). Prints one JSON line
per engine and method: tau, exactness, speedup, Leviathan's bound and the speedup's share of it, and
round_cost, a round's parts in autoregressive target steps (decoding/clock.py's ROUND_PARTS: drafting,
verification, host reads, keeping the cache, the drafter's advance; `round`, the rounds' whole time).
Compare figures within one run of this script: on a shared CPU the machine's speed drifts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdraft import environment
from specdraft.decoding import runners
from specdraft.decoding.tree import TreeShape, cache_tokens
from specdraft.methods import load_trained
from specdraft.run import RunFolder
from specdraft.stages import eval as eval_stage
from specdraft.targets import resolve_device


def memorised_prompts(run: Path, target, n: int) -> list[dict]:
    """The first n prompts of a run's conversations (what a memorised drafter learnt to answer)."""
    records = [json.loads(line) for line in (run / "conversations.jsonl").read_text().splitlines()][:n]
    return [
        {"id": str(r.get("id", i)), "prompt_ids": target.chat_ids(r["messages"][:-1], add_generation_prompt=True)}
        for i, r in enumerate(records)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--engine", nargs="+", default=["eager", "static"], choices=runners.ENGINES)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--K", type=int, default=3, help="drafts per round (a block drafter's own K must equal it)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--held-out", action="store_true", help="the first run's held-out split, not its conversations")
    ap.add_argument("--target-model", default=None, help="the target's file or folder (default: the recipe's)")
    ap.add_argument("--label", default="", help="recorded in each line (e.g. before / after)")
    ap.add_argument("--out", type=Path, default=None, help="append the lines to this JSONL too")
    args = ap.parse_args()

    device = torch.device(resolve_device(args.device))
    loaded = []
    for path in args.runs:
        folder = RunFolder(path)
        recipe = folder.recipe()
        if args.target_model:
            recipe.target.model = args.target_model
        cfg = recipe.eval
        cfg.max_new_tokens, cfg.dtype, cfg.draft_tokens, cfg.num_prompts = (
            args.new_tokens,
            args.dtype,
            args.K,
            args.prompts,
        )
        drafter, target, _ = load_trained(recipe, folder)
        loaded.append((path, recipe, drafter.to(device=device, dtype=getattr(torch, args.dtype)), target))
    path0, recipe0, _, target = loaded[0]
    prompts = (
        eval_stage.load_prompts(recipe0, target) if args.held_out else memorised_prompts(path0, target, args.prompts)
    )
    model = target.load_model(args.dtype, device=str(device))
    for engine in args.engine:
        runner = runners.make_runner(target, model, engine)
        runner.reserve(
            max(cache_tokens(len(p["prompt_ids"]), args.new_tokens, TreeShape.chain(args.K)) for p in prompts)
        )
        for path, recipe, drafter, _ in loaded:
            cfg = recipe.eval
            warm = type(cfg)(**{**vars(cfg), "max_new_tokens": min(cfg.max_new_tokens, 16)})
            eval_stage.evaluate(runner, drafter, prompts[:1], warm, target.eos_token_id, ways=1)
            t0 = time.time()
            r = eval_stage.evaluate(runner, drafter, prompts, cfg, target.eos_token_id, ways=1)
            way = next(k for k in r if isinstance(r[k], dict) and "tau" in r[k])
            w = r[way]
            line = {
                "bench": "round_cost",
                "label": args.label,
                "run": str(path),
                "method": drafter.METHOD,
                "drafting": way,
                "K": r["draft_tokens"],
                "engine": r["engine"],
                "prompts": len(prompts),
                "max_new_tokens": args.new_tokens,
                "dtype": args.dtype,
                "device": str(device),
                "ar_tokens_per_s": r["autoregressive_tokens_per_s"],
                **{
                    k: w[k]
                    for k in (
                        "tau",
                        "per_position_acceptance",
                        "exact_prompts",
                        "numerical_ties",
                        "speculative_tokens_per_s",
                        "speedup",
                        "draft_to_target_cost",
                        "alpha",
                        "leviathan_bound",
                        "share_of_bound",
                        "round_cost",
                        "round_seconds",
                    )
                },
                "seconds": round(time.time() - t0, 1),
                "date": time.strftime("%Y-%m-%d"),
                "hardware": environment.hardware_line(),
            }
            text = json.dumps(line)
            print(text, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(text + "\n")


if __name__ == "__main__":
    main()
