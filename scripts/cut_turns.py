"""Keep the first N answers of every conversation of gen conversations.jsonl files (.xz, .gz or plain; stdin
when none are named) on stdout, as a gen run with gen.max_turns = N would have saved them.

    python3 scripts/cut_turns.py 1 MODEL bench/data/*.conversations.jsonl.xz > RUN/conversations.jsonl

A multi-turn run answers every first turn exactly as a first-turns run does (the same prompts, sorted
and batched the same way, greedy), so scripts/gpu-recipe-call.sh reuses one carried file for both rather
than spending device time on the same answers twice. MODEL (the target) gives the end-of-turn token, from
which a cut conversation's finish reason is read.
"""

from __future__ import annotations

import gzip
import json
import lzma
import sys

from specdraft.targets import Target


def lines(paths: list[str]):
    """Every line of the named files, each opened by its suffix (bench/data keeps them xz-compressed: the
    device call that carries them holds 64 MiB), or of stdin."""
    if not paths:
        yield from sys.stdin
    for path in paths:
        opener = lzma.open if path.endswith(".xz") else gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            yield from f


def main() -> None:
    turns, model = int(sys.argv[1]), sys.argv[2]
    eos = Target(model).eos_token_id
    for line in lines(sys.argv[3:]):
        record = json.loads(line)
        answers = [i for i, m in enumerate(record["messages"]) if m["role"] == "assistant"]
        if turns and len(answers) > turns:
            last = answers[turns - 1]
            record["messages"] = record["messages"][: last + 1]
            record["finish_reason"] = "stop" if record["messages"][last]["token_ids"][-1:] == [eos] else "length"
        # every record now is what a run with max_turns = N saves, the conversations it cut or not
        record["generator"]["sampling"]["max_turns"] = turns
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
