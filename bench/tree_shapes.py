"""Tree shapes of one drafter with the reference decoder: greedy, batch 1, the recipe's held-out prompts.

    python bench/tree_shapes.py DRAFTER --recipe smollm2-h200 --target MODEL \
        [--prompts 16] [--new-tokens 256] [--shapes 8,6,60 8,8,64 ...] [--dtype float32] [--device auto]

DRAFTER is any folder an engine loads (an `export/vllm`, a published drafter); the recipe gives the
held-out prompts and the tokenizer. Prints one JSON line per shape (TOPK,DEPTH,TOKENS; a chain is 1,K,K):
τ, per-position acceptance and the share of prompts whose output matched the target's own greedy one.
τ is what the shape buys on any hardware; the seconds are this machine's (a CPU verifies a 64-token tree
at far more than a GPU's cost, so speed belongs to bench/speedup.py on the GPU).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specdraft import environment
from specdraft.config import load_recipe
from specdraft.decoding import rounds, runners, tree
from specdraft.methods.eagle3.decode import speculative
from specdraft.methods.eagle3.formats import read_drafter
from specdraft.stages import eval as eval_stage
from specdraft.targets import Target, resolve_device


def shape(text: str) -> tree.TreeShape:
    topk, depth, tokens = (int(x) for x in text.split(","))
    return tree.TreeShape(topk, depth, tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter", type=Path)
    ap.add_argument("--recipe", default="smollm2-h200")
    ap.add_argument("--target", default=None, help="the target model (default: the recipe's target.model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--shapes", nargs="+", type=shape, default=[shape("8,6,60"), shape("8,8,64")])
    ap.add_argument("--dtype", default="float32", help="float32 keeps greedy speculation exact (docs/engine-facts.md)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()

    recipe = load_recipe(args.recipe)
    if args.target:
        recipe.target.model = args.target
    recipe.eval.num_prompts = args.prompts
    device = torch.device(resolve_device(args.device))
    meta = json.loads((args.drafter / "config.json").read_text())
    target = Target(recipe.target.model, meta.get("eagle_aux_hidden_state_layer_ids"))
    drafter = read_drafter(args.drafter, target.embed_weight()).to(device=device, dtype=getattr(torch, args.dtype))
    runner = runners.make_runner(target, target.load_model(args.dtype, device=str(device)), recipe.eval.engine)
    prompts = eval_stage.load_prompts(recipe, target)
    eos = target.eos_token_id
    runner.reserve(
        max(tree.cache_tokens(len(p["prompt_ids"]), args.new_tokens, s) for p in prompts for s in args.shapes)
    )
    refs = [
        rounds.greedy(runner, p["prompt_ids"], args.new_tokens, eos)
        for p in tqdm(prompts, desc="greedy", unit="prompt")
    ]
    for sh in args.shapes:
        stats, exact, t0 = rounds.Stats(sh.depth), 0, time.time()
        for p, (ref, gaps) in zip(tqdm(prompts, desc=f"tree {sh.topk},{sh.depth},{sh.tokens}", unit="prompt"), refs):
            spec = speculative(runner, drafter, p["prompt_ids"], args.new_tokens, eos, sh, stats)
            exact += rounds.check_exact(spec, ref, gaps, recipe.eval.tie_tolerance, p["id"])["exact"]
        s = stats.summary()
        print(
            json.dumps(
                {
                    "bench": "tree_shapes",
                    "drafter": str(args.drafter),
                    "prompts": len(prompts),
                    "max_new_tokens": args.new_tokens,
                    "tree": vars(sh),
                    "tau": s["tau"],
                    "per_position_acceptance": s["per_position_acceptance"],
                    "rounds": s["rounds"],
                    "exact_prompts": exact,
                    "dtype": args.dtype,
                    "device": str(device),
                    "engine": runner.engine,
                    "seconds": round(time.time() - t0, 1),
                    "hardware": environment.hardware_line(),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
