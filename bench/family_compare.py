"""What two targets differ in, on the same text and in their runs.

    python bench/family_compare.py --targets smollm2 qwen2.5-coder-0.5b --prompts 2000 [--runs RUN ...]

Tokenizers (`--targets`): the first `--prompts` ShareGPT train-split conversations, programming ones first
(the qwen-coder-cpu recipe's order), each target's chat template around the prompt and its tokenizer on
the source's own first answer: tokens per prompt and per answer, and the share of answer tokens that a
draft vocabulary of the 4 K / 8 K / 16 K most frequent answer tokens covers, the vocabulary counted on
nine tenths of the answers and the share measured on the other tenth (what a drafter meets unseen).

Runs (`--runs`): per run folder, seconds per stage, tokens per conversation, the eval's tau, per-position
acceptance and draft/target cost ratio c. Prints one JSON line per target and per run.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from specdraft import environment
from specdraft.config import DataConfig
from specdraft.data.prompts import is_programming, ordered
from specdraft.data.sources import prompts
from specdraft.run import RunFolder
from specdraft.targets import Target

SIZES = (4096, 8192, 16384)


def coverage(counts: Counter, tokens: list[int], size: int) -> float:
    top = {t for t, _ in counts.most_common(size)}
    return round(sum(t in top for t in tokens) / max(1, len(tokens)), 4)


def tokenizer_line(name: str, convs: list[dict]) -> dict:
    target = Target(name)
    prompt_tokens, answers = [], []
    for conv in convs:
        m = conv["messages"]
        prompt_tokens.append(len(target.chat_ids(m[:1], add_generation_prompt=True)))
        answers.append(target.tokenizer.encode(m[1]["content"], add_special_tokens=False))
    cut = len(answers) * 9 // 10
    counts = Counter(t for a in answers[:cut] for t in a)
    unseen = [t for a in answers[cut:] for t in a]
    return {
        "target": name,
        "vocab_size": target.vocab_size,
        "conversations": len(convs),
        "programming": sum(map(is_programming, convs)),
        "prompt_tokens_mean": round(sum(prompt_tokens) / len(convs), 1),
        "answer_tokens_mean": round(sum(map(len, answers)) / len(convs), 1),
        "answer_tokens_distinct": len(counts),
        "coverage_unseen": {str(k): coverage(counts, unseen, k) for k in SIZES},
    }


def run_line(path: Path) -> dict:
    run = RunFolder(path)
    manifest = run.manifest()
    records = [json.loads(x) for x in run.conversations.read_text().splitlines() if x.strip()]
    answer_tokens = [len(r["messages"][-1].get("token_ids") or []) for r in records]
    report = json.loads(run.eval_report.read_text()) if run.eval_report.exists() else {}
    chain = report.get("chain") or {}
    return {
        "run": str(path),
        "target": manifest["recipe"]["target"]["model"],
        "conversations": len(records),
        "prompt_tokens_mean": round(sum(r.get("prompt_tokens", 0) for r in records) / len(records), 1),
        "answer_tokens_mean": round(sum(answer_tokens) / len(records), 1),
        "seconds": {k: v.get("seconds") for k, v in manifest["stages"].items()},
        "eval": {
            k: chain.get(k)
            for k in ("tau", "per_position_acceptance", "draft_to_target_cost", "speedup", "exact_prompts")
        }
        | {"autoregressive_tokens_per_s": report.get("autoregressive_tokens_per_s")},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", nargs="*", default=[])
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--runs", nargs="*", type=Path, default=[])
    args = ap.parse_args()
    d = DataConfig()
    convs = [
        c
        for c in ordered(prompts(d.source, "train", d.eval_fraction, d.split_seed), "programming")
        if len(c["messages"]) >= 2 and c["messages"][0]["role"] == "user" and c["messages"][1]["role"] == "assistant"
    ][: args.prompts]
    common = {"bench": "family_compare", "date": "2026-12-05", "hardware": environment.hardware_line()}
    for name in args.targets:
        print(json.dumps({**common, "tokenizer": tokenizer_line(name, convs)}), flush=True)
    for path in args.runs:
        print(json.dumps({**common, "run": run_line(path)}), flush=True)


if __name__ == "__main__":
    main()
