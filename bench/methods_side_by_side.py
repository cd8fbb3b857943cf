"""Every registered method (EAGLE-3, DFlash, P-EAGLE, ...) trained on the same run's hidden states and
measured by the reference decoder on the same held-out prompts (the run's eval split), one after the
other on this machine.

    python bench/methods_side_by_side.py RUN --out bench/results/methods-cpu.jsonl \
        [--common train.epochs=10 ...] [--dflash train.block_size=8 ...] [--eagle3 ...] [--peagle ...] \
        [--methods eagle3 peagle]

RUN must have been through extract; it is copied once per method (RUN-eagle3, RUN-dflash, ... beside it,
hidden states shared by copy), so RUN itself is not written. Prints and appends one JSON line: per method tau,
per-position acceptance, the accepted-length histogram, exactness, tok/s and speedup on this engine,
and the training time; with the CPU model and the settings.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from specdraft import environment
from specdraft.cli import main as cli
from specdraft.methods import METHODS
from specdraft.run import RunFolder


def train_and_eval(run: Path, method: str, sets: list[str]) -> dict:
    """A copy of `run` trained with `method` and evaluated; its figures."""
    copy = run.with_name(f"{run.name}-{method}")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints", "export", "eval"))
    flags = [f for s in [f"train.method={method}", *sets] for f in ("--set", s)]
    for stage in ("train", "eval"):
        if cli([stage, "--run", str(copy), *flags]) != 0:
            raise SystemExit(f"{stage} failed on {copy}")
    return figures(RunFolder(copy))


def figures(folder: RunFolder) -> dict:
    """A trained and evaluated run's figures."""
    report = json.loads(folder.eval_report.read_text())
    first = report["drafting"][0]
    return {
        "run": str(folder.path),
        "drafting": first,
        "shape": report[first]["shape"],
        "tau": report["tau"],
        "per_position_acceptance": report["per_position_acceptance"],
        "accepted_length_histogram": report["accepted_length_histogram"],
        "exact_prompts": report["exact_prompts"],
        "prompts": report["prompts"],
        "speculative_tokens_per_s": report["speculative_tokens_per_s"],
        "speedup": report["speedup"],
        "train_seconds": folder.stage("train")["seconds"],
        "trainable_params": folder.stage("train")["counts"]["trainable_params"],
        "heldout_simulated_tau": folder.stage("train")["metrics"]["best_tau"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--common", nargs="*", default=[], help="--set items for both methods")
    for name in METHODS:
        ap.add_argument(f"--{name}", nargs="*", default=[], help=f"--set items for {name} only")
    ap.add_argument(
        "--methods",
        nargs="*",
        default=list(METHODS),
        choices=list(METHODS),
        help="the methods to measure (default: every registered one)",
    )
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="take RUN's own trained and evaluated drafter for its "
        "method (e.g. the demo's EAGLE-3) instead of training that method again",
    )
    args = ap.parse_args()
    run = args.run.resolve()
    manifest = RunFolder(run).manifest()
    own = manifest["stages"]
    reused = own["train"]["config"]["method"] if args.reuse and own.get("eval", {}).get("state") == "done" else None
    line = {
        "date": time.strftime("%Y-%m-%d"),
        "hardware": environment.hardware_line(),
        "recipe": manifest["name"],
        "common": args.common,
    }
    for method in args.methods:
        sets = args.common + getattr(args, method)
        if method == reused:
            line[method] = {"sets": "the run's own", **figures(RunFolder(run))}
        else:
            line[method] = {"sets": sets, **train_and_eval(run, method, sets)}
    text = json.dumps(line)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
