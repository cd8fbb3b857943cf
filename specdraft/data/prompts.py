"""Which prompts a run answers (gen) and measures on (eval): the data source's conversations of one
split, cut at their first user turn, tokenized with the target's chat template and kept when they fit.
"""

from __future__ import annotations

from specdraft.config import Recipe
from specdraft.data.sources import DataError, prompts
from specdraft.targets import Target


def _prompt_messages(conv: dict) -> list[dict]:
    """The conversation up to its first user turn (keeping a leading system message)."""
    out = []
    for m in conv["messages"]:
        out.append(m)
        if m["role"] == "user":
            return out
    raise DataError(f"conversation {conv['id']}: no user turn")


def _source_answer(conv: dict, prompt_len: int) -> dict | None:
    """The source's answer to the prompt: the assistant turn right after it, None when there is none.

    Only the turn right after: an answer that follows a second user turn answers that one too.
    """
    following = conv["messages"][prompt_len: prompt_len + 1]
    if following and following[0]["role"] == "assistant" and following[0]["content"].strip():
        return {"role": "assistant", "content": following[0]["content"]}
    return None


def select_prompts(recipe: Recipe, target: Target, split: str, limit: int | None) -> tuple[list[dict], int]:
    """The first `limit` (None: all) prompts of a split that fit `max_prompt_tokens`, each with the
    source's own answer (or None); also how many were too long."""
    d = recipe.data
    chosen, too_long = [], 0
    for conv in prompts(d.source, split, d.eval_fraction, d.split_seed):
        messages = _prompt_messages(conv)
        ids = target.chat_ids(messages, add_generation_prompt=True)
        if len(ids) > d.max_prompt_tokens:
            too_long += 1
            continue
        later = [m["content"] for m in conv["messages"][len(messages):] if m["role"] == "user"]
        chosen.append({"id": conv["id"], "messages": messages, "prompt_ids": ids,
                       "source_answer": _source_answer(conv, len(messages)), "later_users": later})
        if limit is not None and len(chosen) >= limit:
            break
    return chosen, too_long
