"""What two targets' runs differ in, from their run folders: tokens per prompt and per answer, how much
of the answers a draft vocabulary of 4 K / 8 K / 16 K tokens covers, seconds per stage, and the eval's
tau, per-position acceptance and draft/target cost ratio c.

    python bench/family_compare.py runs/qwen-coder runs/smollm2-same [--label qwen --label smollm2]

Coverage: the share of answer (loss-mask) tokens of the run whose token is among the K most frequent
answer tokens of the train split, measured on the train split and on the held-out samples train set aside
(the held-out figure is what a drafter meets). Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from specdraft import environment
from specdraft.data.tokens import load_tokens
from specdraft.run import RunFolder

SIZES = (4096, 8192, 16384)


def coverage(counts: Counter, tokens: list[int], size: int) -> float:
    top = {t for t, _ in counts.most_common(size)}
    return round(sum(t in top for t in tokens) / max(1, len(tokens)), 4)


def answers(samples: list[tuple[list[int], list[int]]]) -> list[int]:
    return [t for ids, mask in samples for t, k in zip(ids, mask) if k]


def describe(path: Path) -> dict:
    run = RunFolder(path)
    manifest = run.manifest()
    _, samples = load_tokens(run.tokens)
    held = max(1, len(samples) // 10)  # the last tenth stands in for unseen answers
    train, unseen = answers(samples[:-held]), answers(samples[-held:])
    counts = Counter(train)
    records = [json.loads(x) for x in run.conversations.read_text().splitlines() if x.strip()]
    prompt_tokens = [r.get("prompt_tokens", 0) for r in records]
    answer_tokens = [len(r["messages"][-1].get("token_ids") or []) for r in records]
    stages = manifest.get("stages", {})
    report = json.loads(run.eval_report.read_text()) if run.eval_report.exists() else {}
    chain = report.get("chain") or {}
    return {
        "run": str(path), "target": manifest.get("recipe", {}).get("target", {}).get("model"),
        "conversations": len(records),
        "prompt_tokens_mean": round(sum(prompt_tokens) / max(1, len(records)), 1),
        "answer_tokens_mean": round(sum(answer_tokens) / max(1, len(records)), 1),
        "answer_tokens_distinct": len(counts),
        "coverage_train": {str(k): coverage(counts, train, k) for k in SIZES},
        "coverage_unseen": {str(k): coverage(counts, unseen, k) for k in SIZES},
        "seconds": {k: v.get("seconds") for k, v in stages.items() if isinstance(v, dict)},
        "eval": {k: chain.get(k) for k in ("tau", "per_position_acceptance", "draft_to_target_cost", "speedup")}
                | {"autoregressive_tokens_per_s": report.get("autoregressive_tokens_per_s")},
        "hardware": environment.hardware_line(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    for path in args.runs:
        print(json.dumps({"bench": "family_compare", **describe(path)}))


if __name__ == "__main__":
    main()
