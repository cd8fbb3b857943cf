"""Which prompts a run answers (gen) and measures on (eval): the data source's conversations of one
split, cut at their first user turn, tokenized with the target's chat template and kept when they fit;
or, for a source of pre-rendered rows, the rows of the split cut before their first trained token.
"""

from __future__ import annotations

import re

from specdraft.config import DataConfig, Recipe
from specdraft.data.sources import DataError, prompts, read_rendered, source_is_rendered, split_of
from specdraft.targets import Target


def _prompt_messages(conv: dict) -> list[dict]:
    """The conversation up to its first user turn (keeping a leading system message)."""
    out = []
    for m in conv["messages"]:
        out.append(m)
        if m["role"] == "user":
            return out
    raise DataError(f"conversation {conv['id']}: no user turn")


def _source_answer(conv: dict, prompt_len: int) -> list[dict] | None:
    """The source's answer to the prompt, None when there is none: the assistant turn right after it, or,
    where that turn calls tools, the calls, the tools' results and the assistant turns after them up to
    the first that calls none.

    Only up to there: an answer that follows a second user turn answers that one too.
    """
    answer = []
    for m in conv["messages"][prompt_len:]:
        if m["role"] not in ("assistant", "tool") or (not answer and m["role"] == "tool"):
            break
        answer.append({k: m[k] for k in ("role", "content", "tool_calls", "tool_call_id", "name") if k in m})
        if m["role"] == "assistant" and not m.get("tool_calls"):
            break
    last = answer[-1] if answer else None
    if last and last["role"] == "assistant" and (last["content"].strip() or last.get("tool_calls")):
        return answer
    return None


# Words that mark a question about code; a turn needs two different ones (or a code fence) so that a
# stray "class" or "return" in prose does not count.
_CODE_WORDS = re.compile(
    r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|kotlin|swift|php|ruby|sql|html|css|react|vue|"
    r"angular|django|flask|node\.?js|bash|shell|regex|api|json|yaml|function|class|method|variable|compiler?|"
    r"debug|code|script|algorithm|array|loop|exception|github|docker|kubernetes|linux|query|database|pandas|"
    r"numpy|programming|program|implement|def|import|return|int|const|var|async|await)\b",
    re.IGNORECASE,
)


def is_programming(conv: dict) -> bool:
    """Whether a conversation's first user turn is about code: a code fence, or two different code words."""
    text = next(m["content"] for m in conv["messages"] if m["role"] == "user")
    return "```" in text or len({w.lower() for w in _CODE_WORDS.findall(text)}) >= 2


def ordered(convs: list[dict], prefer: str) -> list[dict]:
    """The conversations in the order `data.prefer` asks: programming ones first, or as the source has them."""
    if prefer == "programming":
        return sorted(convs, key=lambda c: not is_programming(c))  # stable: source order within each group
    return convs


def select_prompts(recipe: Recipe, target: Target, split: str, limit: int | None) -> tuple[list[dict], int]:
    """The first `limit` (None: all) prompts of a split that fit `max_prompt_tokens` (tool definitions
    included), each with its tools (or None) and the source's own answer (a list of turns, or None); also
    how many were too long."""
    d = recipe.data
    if source_is_rendered(d):
        return rendered_prompts(d, split, limit)
    chosen, too_long = [], 0
    for conv in ordered(prompts(d.source, split, d.eval_fraction, d.split_seed, data=d), d.prefer):
        messages = _prompt_messages(conv)
        ids = target.chat_ids(messages, add_generation_prompt=True, tools=conv.get("tools"))
        if len(ids) > d.max_prompt_tokens:
            too_long += 1
            continue
        later = [m["content"] for m in conv["messages"][len(messages) :] if m["role"] == "user"]
        chosen.append(
            {
                "id": conv["id"],
                "messages": messages,
                "prompt_ids": ids,
                "tools": conv.get("tools"),
                "source_answer": _source_answer(conv, len(messages)),
                "later_users": later,
            }
        )
        if limit is not None and len(chosen) >= limit:
            break
    return chosen, too_long


def rendered_prompts(d: DataConfig, split: str, limit: int | None) -> tuple[list[dict], int]:
    """The prompts of a split of pre-rendered rows: each row's ids before its first trained token (the
    template's prompt through the assistant's header, as add_generation_prompt writes it). There is no
    text: the reference decoder drafts them; a server is asked for text (bench's vLLM runs) only with
    eval.prompts_file."""
    chosen, too_long = [], 0
    for _, row in read_rendered(d):
        if split_of(row["id"], d.eval_fraction, d.split_seed) != split:
            continue
        ids = row["input_ids"][: row["loss_mask"].index(1)]
        if len(ids) > d.max_prompt_tokens:
            too_long += 1
            continue
        chosen.append(
            {
                "id": row["id"],
                "messages": None,
                "prompt_ids": ids,
                "tools": None,
                "source_answer": None,
                "later_users": [],
            }
        )
        if limit is not None and len(chosen) >= limit:
            break
    return chosen, too_long
