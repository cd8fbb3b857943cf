"""render: conversations -> input_ids + loss_mask through the target's own chat template.

The drafter must see exactly the tokens the target sees when served, so the template is the
tokenizer's own, and each assistant turn is placed after the tokens of the rendered prefix. Before
a turn is appended, the rendered prefix must extend what was built so far; a template that renders
earlier turns differently once later turns exist (template drift) is an error, not a silent skew.
When gen kept the answer's token ids, they are used as they are instead of re-tokenized text.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from ..config import Recipe
from ..run import Run, atomic_path, write_json
from ..targets import Target
from .generate import CONVERSATIONS
from .sources import DataError, read_jsonl

TOKENS_DIR = "tokens"


def render_conversation(target: Target, record: dict, max_length: int) -> tuple[list[int], list[int]]:
    """Token ids and a loss mask (1 on assistant tokens and their end-of-turn token)."""
    messages = record["messages"]
    eos = target.eos_token_id
    last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last_assistant is None:
        raise DataError(f"conversation {record['id']}: no assistant turn to learn from")
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages[: last_assistant + 1]):
        if m["role"] != "assistant":
            continue
        prefix = target.chat_ids(messages[:i], add_generation_prompt=True)
        if prefix[: len(ids)] != ids:
            raise DataError(f"conversation {record['id']}: the chat template renders turn {i} with a prefix "
                            f"that differs from the earlier turns (template drift)")
        mask += [0] * (len(prefix) - len(ids))
        ids = prefix
        turn = target.chat_ids(messages[: i + 1], add_generation_prompt=False)
        if turn[: len(prefix)] != prefix:
            raise DataError(f"conversation {record['id']}: the template renders turn {i} differently with "
                            f"and without the generation prompt (template drift)")
        segment = turn[len(prefix):]
        # What the template puts after the end-of-turn token (e.g. "\n") is not the model's answer.
        end = segment.index(eos) + 1 if eos in segment else len(segment)
        answer, suffix = segment[:end], segment[end:]
        if i == last_assistant and m.get("token_ids"):
            answer = list(m["token_ids"])
            if answer[-1] != eos:
                suffix = []  # cut at max_new_tokens: the turn never ended
        ids = ids + answer + suffix
        mask += [1] * len(answer) + [0] * len(suffix)
    return ids[:max_length], mask[:max_length]


def run(recipe: Recipe, run: Run) -> dict:
    import torch
    from safetensors.torch import save_file

    t_start = time.time()
    run.require("gen")
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)
    tok = target.tokenizer
    src = run.path / CONVERSATIONS
    all_ids, all_mask, offsets, conv_ids = [], [], [0], []
    empty = 0
    for record in read_jsonl(src):
        ids, mask = render_conversation(target, record, recipe.render.max_length)
        if sum(mask) == 0:
            empty += 1
            continue
        all_ids += ids
        all_mask += mask
        offsets.append(len(all_ids))
        conv_ids.append(record["id"])
    if not conv_ids:
        raise DataError(f"{src}: no conversation with assistant tokens to render")
    out = run.path / TOKENS_DIR
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "tokens.safetensors") as tmp:
        save_file({"input_ids": torch.tensor(all_ids, dtype=torch.int32),
                   "loss_mask": torch.tensor(all_mask, dtype=torch.uint8),
                   "offsets": torch.tensor(offsets, dtype=torch.int64)}, str(tmp))
    template = tok.chat_template or ""
    index = {
        "ids": conv_ids,
        "num_samples": len(conv_ids),
        "num_tokens": len(all_ids),
        "num_loss_tokens": int(sum(all_mask)),
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16],
        "target": target.describe(),
    }
    write_json(out / "index.json", index)
    counts = {"samples": len(conv_ids), "tokens": len(all_ids), "loss_tokens": index["num_loss_tokens"],
              "skipped_no_answer": empty}
    return run.record("render", state="done", config=recipe.render, counts=counts,
                      seconds=time.time() - t_start)


def load_tokens(run_path: Path) -> tuple[dict, list[tuple[list[int], list[int]]]]:
    """The rendered samples: (index, [(input_ids, loss_mask), ...])."""
    from safetensors.torch import load_file

    out = Path(run_path) / TOKENS_DIR
    index = json.loads((out / "index.json").read_text())
    t = load_file(str(out / "tokens.safetensors"))
    ids, mask, off = t["input_ids"].tolist(), t["loss_mask"].tolist(), t["offsets"].tolist()
    return index, [(ids[a:b], mask[a:b]) for a, b in zip(off[:-1], off[1:])]
