"""The one checked path for every file specdraft reads, and the disk-full case of what it writes.

A file a stage reads may be torn (a kill, a copy cut short), damaged, or another program's. Each reader
here turns what the parsers raise (json's errors, a byte that is not UTF-8, safetensors' SafetensorError)
into one `FileError` line that names the file (and line), says what is wrong with it and what to do:
the caller passes `fix`, e.g. "rerun `specdraft extract`". A full disk while writing is one `DiskFull`
line naming the path and the bytes the write needed.

    read_json(path, fix=...)                 a JSON document, of the type `kind` (an object by default)
    read_jsonl(path, fix=...)                (line number, record) of a JSON Lines file
    load_safetensors(path, fix=..., need=)   every tensor of a safetensors file
    open_safetensors(path, fix=..., need=)   a safe_open handle (tensors read lazily, memory-mapped)
    save_safetensors(tensors, path)          save_file, a full disk raised as DiskFull
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

# What a write that found no room raises: no space on the device, or the user's quota spent.
FULL = (errno.ENOSPC, errno.EDQUOT)
# safetensors (Rust) reports an I/O error as text: "... (os error 28)".
_RUST_OS_ERROR = "(os error {})"
# The bytes safetensors writes besides the tensors: the 8-byte length and a JSON header (an estimate
# of its size per tensor, for the number DiskFull names; the exact size is the library's).
_HEADER_BYTES_PER_TENSOR = 96


class FileError(ValueError):
    """A file that cannot be read as what it should be; the message names the file (and line) and the fix."""


class DiskFull(OSError):
    """A write that found the disk (or the quota) full; the message names the path and the bytes it needed."""

    def __init__(self, path, needed: int | None, written: int | None = None):
        self.path, self.needed, self.written = Path(path), needed, written
        super().__init__(errno.ENOSPC, "no space left on the device", str(path))

    def __str__(self) -> str:
        # Said when printed, after the failed write's temporary file is gone: the free space it reports
        # is what there is to work with.
        free = _free_bytes(self.path)
        if self.needed is not None:
            need = f"writing it needed {self.needed:,} bytes"
        elif self.written is not None:
            need = f"writing it needed more than the {self.written:,} bytes written before the disk filled"
        else:
            need = "writing it needed more room than there was"
        where = f", {free:,} are free there" if free is not None else ""
        return f"{self.path}: the disk is full: {need}{where}; free some space and rerun the same command"


def _free_bytes(path: Path) -> int | None:
    for folder in (path.parent, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def is_full(e: BaseException) -> bool:
    """Whether `e` says a write found no room: an OSError of ENOSPC / EDQUOT, or safetensors' text of one."""
    if isinstance(e, OSError):
        return e.errno in FULL
    return type(e).__name__ == "SafetensorError" and any(_RUST_OS_ERROR.format(n) in str(e) for n in FULL)


def _not_found(path: Path, fix: str) -> FileError:
    return FileError(f"{path}: not found; {fix}")


# --- JSON ------------------------------------------------------------------------------------------


def _utf8(data: bytes, path: Path, fix: str, line: int | None = None) -> str:
    """`data` decoded; a byte that is not UTF-8 is named with its line (counted in `data` when not given)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        at = line if line is not None else data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise FileError(f"{path}:{at}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {column}); {fix}") from None


def parse_json(text: str, path: Path, fix: str, line: int | None = None):
    """A JSON document's value; bad JSON is one FileError naming `path` and the line (`line`: the file's
    line the text is, for a JSON Lines record)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = line if line is not None else e.lineno
        raise FileError(f"{path}:{at}: not valid JSON ({e.msg} at column {e.colno}); {fix}") from None
    except RecursionError:
        raise FileError(f"{path}{f':{line}' if line else ''}: JSON nested too deeply to read; {fix}") from None


def _kind_name(kind) -> str:
    return {dict: "an object", list: "an array", str: "a string"}.get(kind, getattr(kind, "__name__", str(kind)))


def read_json(path, *, fix: str, kind: type | None = dict, what: str | None = None):
    """The JSON document at `path`: an object unless `kind` says otherwise (None: any value). Missing,
    unreadable as UTF-8, malformed or of another type: one FileError naming the file and `fix`. `what`
    names the file's role in that line ("the run's manifest")."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _not_found(path, fix) from None
    except IsADirectoryError:
        raise FileError(f"{path}: a folder, where a JSON file should be; {fix}") from None
    value = parse_json(_utf8(data, path, fix), path, fix)
    if kind is not None and not isinstance(value, kind):
        role = f" ({what})" if what else ""
        raise FileError(f"{path}: a JSON {_json_type(value)} where {_kind_name(kind)} should be{role}; {fix}")
    return value


def _json_type(value) -> str:
    names = {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "number",
        float: "number",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def read_jsonl(path, *, fix: str, kind: type | None = dict, torn_tail: bool = False) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line of a JSON Lines file, read line by line (a byte that is
    not UTF-8 is named with its line). A line that is not JSON, or not of `kind`, is one FileError naming
    file:line. `torn_tail`: a last line without its newline that does not parse (an append cut off by a
    kill, which the writer repairs when it resumes) is skipped."""
    path = Path(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; a generator's `with` would hold it past a break
    except FileNotFoundError:
        raise _not_found(path, fix) from None
    with f:
        lineno = 0
        for lineno, raw in enumerate(f, 1):  # noqa: B007 - lineno names the line in the errors
            if not raw.strip():
                continue
            try:
                value = parse_json(_utf8(raw, path, fix, lineno), path, fix, lineno)
            except FileError:
                if torn_tail and not raw.endswith(b"\n"):
                    return
                raise
            if kind is not None and not isinstance(value, kind):
                raise FileError(
                    f"{path}:{lineno}: a JSON {_json_type(value)} where {_kind_name(kind)} should be; {fix}"
                )
            yield lineno, value


# --- safetensors -----------------------------------------------------------------------------------


def _safetensors_problem(e: Exception) -> str:
    """What a SafetensorError says about the file, as a reason a person acts on."""
    text = str(e).removeprefix("Error while deserializing header: ")
    if "incomplete metadata" in text or "header too large" in text or "invalid header length" in text:
        return f"not a whole safetensors file (truncated, or not safetensors at all: {text})"
    return f"not a readable safetensors file ({text})"


def _check_names(path: Path, have: Iterable[str], need: Iterable[str], fix: str) -> None:
    missing = [n for n in need if n not in set(have)]
    if missing:
        raise FileError(
            f"{path}: a safetensors file without the tensor(s) {missing} it should hold "
            f"(another program's file?); {fix}"
        )


def load_safetensors(path, *, fix: str, need: Iterable[str] = (), device: str = "cpu") -> dict:
    """Every tensor of the safetensors file at `path`, on `device`; `need` names tensors it must hold.
    Missing, torn, garbage or foreign: one FileError naming the file and `fix`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.exists():
        raise _not_found(path, fix)
    try:
        tensors = load_file(str(path), device=device)
    except SafetensorError as e:
        raise FileError(f"{path}: {_safetensors_problem(e)}; {fix}") from None
    _check_names(path, tensors, need, fix)
    return tensors


def open_safetensors(path, *, fix: str, need: Iterable[str] = ()):
    """A safe_open handle of `path` (PyTorch tensors, read lazily); errors as load_safetensors'."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.exists():
        raise _not_found(path, fix)
    try:
        handle = safe_open(str(path), "pt")
    except SafetensorError as e:
        raise FileError(f"{path}: {_safetensors_problem(e)}; {fix}") from None
    _check_names(path, handle.keys(), need, fix)
    return handle


def safetensors_bytes(tensors: dict) -> int:
    """About the bytes a safetensors file of `tensors` takes: their data and the header."""
    return 8 + sum(t.numel() * t.element_size() + _HEADER_BYTES_PER_TENSOR for t in tensors.values())


def save_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """safetensors' save_file; a full disk is DiskFull naming `path` and the bytes the file needed."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except (SafetensorError, OSError) as e:
        if is_full(e):
            raise DiskFull(path, safetensors_bytes(tensors)) from None
        raise


def full_disk(e: OSError, path, needed: int | None = None, written: int | None = None) -> DiskFull:
    """The DiskFull that a write of `path` ending in `e` (a full disk) is: it names `path`, and the bytes
    the write needed (`needed`, or the one `e` carries), or at least those `written` before it failed."""
    if isinstance(e, DiskFull):
        needed = needed if needed is not None else e.needed
        written = written if written is not None else e.written
    return DiskFull(path, needed, written)


def size_of(path: Path) -> int | None:
    """The bytes written at `path` so far (a file, or a folder's files), None when nothing is there."""
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return os.path.getsize(path)
    except OSError:
        return None
