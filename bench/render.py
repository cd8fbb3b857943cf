"""How fast render turns real ShareGPT conversations into token ids + loss masks through the bundled
target's chat template (every turn rendered and checked against the template).

    python bench/render.py [--conversations 200]

Prints one JSON line: conversations/s, turns/s and tokens/s, the samples per conversation (more than
one where a turn's history is re-rendered differently), and the machine. CPU only: render is tokenizer
and template work, no model runs.
"""

from __future__ import annotations

import argparse
import json
import time

from specdraft import environment
from specdraft.data.sources import read_sharegpt
from specdraft.stages.render import ChatTemplate, render_conversation
from specdraft.targets import Target

# Long enough for real multi-turn chats, as the demo recipe's render.max_length.
MAX_LENGTH = 2048


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=200)
    args = ap.parse_args()
    template = ChatTemplate.of_target(Target("smollm2"))
    convs = []
    for conv in read_sharegpt():
        if conv["messages"][0]["role"] == "user" and any(m["role"] == "assistant" for m in conv["messages"]):
            convs.append(conv)
        if len(convs) == args.conversations:
            break
    turns = tokens = samples = mismatches = 0
    t0 = time.perf_counter()
    for conv in convs:
        r = render_conversation(template, conv, MAX_LENGTH)
        turns += r.turns
        samples += len(r.samples)
        tokens += sum(len(ids) for ids, _ in r.samples)
        mismatches += len(r.mismatches)
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "bench": "render",
                "target": "smollm2",
                "conversations": len(convs),
                "turns": turns,
                "samples": samples,
                "tokens": tokens,
                "template_mismatches": mismatches,
                "seconds": round(seconds, 2),
                "conversations_per_s": round(len(convs) / seconds, 1),
                "turns_per_s": round(turns / seconds, 1),
                "tokens_per_s": round(tokens / seconds),
                "hardware": environment.hardware_line(),
            }
        )
    )


if __name__ == "__main__":
    main()
