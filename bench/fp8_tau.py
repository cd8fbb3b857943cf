"""What fp8 hidden-state storage costs in acceptance: one JSON line of figures.

    python bench/fp8_tau.py                      # tiny, on the CPU
    python bench/fp8_tau.py --samples 2000 --epochs 10 --eval-prompts 64

Renders the same ShareGPT conversations once (their own answers: `gen` is skipped, the comparison
needs the same data for both, not the best data), then for each storage dtype extracts, trains a
drafter with the same recipe and seed, and evaluates it with the reference speculative decoder on
the same held-out prompts. Prints τ, per-position acceptance and the trainer's last held-out score
(top-1 accuracy per TTT step and simulated τ, from the train stage's record) of each, with the disk
each storage took.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import environment
from specdraft.config import Recipe
from specdraft.run import RunFolder

STORES = ("bfloat16", "fp8_e4m3")


def make_recipe(args) -> Recipe:
    recipe = Recipe(name="fp8-tau")
    recipe.render.max_length = args.max_length
    recipe.train.draft_vocab_size = args.draft_vocab
    recipe.train.ttt_steps = 3
    recipe.train.epochs = args.epochs
    recipe.train.lr = 3e-3
    recipe.train.batch_tokens = 2048
    recipe.eval.num_prompts = args.eval_prompts
    recipe.eval.max_new_tokens = args.max_new_tokens
    return recipe


def rendered_run(root: Path, recipe: Recipe, samples: int) -> RunFolder:
    from specdraft.data.sources import read_sharegpt, split_of
    from specdraft.stages import render

    run = RunFolder(root)
    run.init(recipe)
    records = (
        r
        for r in read_sharegpt()
        if len(r["messages"]) >= 2
        and r["messages"][0]["role"] == "user"
        and r["messages"][1]["role"] == "assistant"
        and split_of(r["id"], recipe.data.eval_fraction, recipe.data.split_seed) == "train"
    )
    with open(root / "conversations.jsonl", "w") as f:
        f.writelines(
            json.dumps({"id": r["id"], "messages": r["messages"][:2]}) + "\n" for r in islice(records, samples)
        )
    run.record("gen", state="done")
    render.run(recipe, run)
    return run


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--draft-vocab", type=int, default=2048)
    p.add_argument("--eval-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--stores", default=",".join(STORES), help="which storages to compare (comma-separated)")
    p.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder, removed)")
    args = p.parse_args(argv)

    from specdraft.stages import eval as speculate
    from specdraft.stages import extract, train

    root = args.out or Path(tempfile.mkdtemp(prefix="specdraft-fp8-tau-"))
    figures = {
        "bench": "fp8_tau",
        "hardware": environment.hardware_line(),
        "samples": args.samples,
        "epochs": args.epochs,
        "eval_prompts": args.eval_prompts,
    }
    try:
        base = rendered_run(root / "rendered", make_recipe(args), args.samples)
        figures["tokens"] = base.stage("render")["counts"]["tokens"]
        stores = args.stores.split(",")
        for store in stores:
            recipe = make_recipe(args)
            recipe.extract.store_dtype = store
            path = root / store
            shutil.copytree(base.path, path)
            run = RunFolder(path)
            run.init(recipe)
            ex = extract.run(recipe, run)
            tr = train.run(recipe, run)
            ev = speculate.run(recipe, run)["metrics"]
            heldout = tr["metrics"]["heldout"] or {}  # None when no sample was held out
            figures[store] = {
                "tau": ev["tau"],
                "per_position_acceptance": ev["per_position_acceptance"],
                "train_heldout_accuracy": heldout.get("acc"),
                "train_heldout_tau": heldout.get("tau"),
                "disk_bytes": ex["counts"]["disk_bytes"],
            }
        if set(STORES) <= set(stores):
            figures["tau_ratio_fp8_over_bf16"] = round(figures["fp8_e4m3"]["tau"] / figures["bfloat16"]["tau"], 4)
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
