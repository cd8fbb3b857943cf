"""The hidden-state shard format, its index, and the reader the trainer uses.

A shard `hidden/shard-NNNNN.safetensors` holds a few hundred MB of samples concatenated along the
token axis: `input_ids` [N] int32, `loss_mask` [N] uint8, `aux` [N, n_aux * H] (the aux layers'
states concatenated in `aux_layer_ids` order, the order the drafter's fc expects) and `last` [N, H].
`last` is the output of the target's final norm, i.e. exactly what its lm_head sees (not vLLM's
pre-norm layer-L residual): the trainer turns it into the target's logits with the lm_head weight.

Storage dtypes: "bfloat16" keeps the target's states as computed; "fp8_e4m3" halves the disk by
storing each H-wide row (one layer at one token) as float8_e4m3fn times a float32 scale
(`aux_scale` [N, n_aux], `last_scale` [N, 1]), chosen so the row's largest value maps to the largest
finite e4m3 value. Either way the reader returns bfloat16.

`hidden/index.json` gives every sample (in render order) its shard, token offset and token count,
and records the layer ids, dtypes and the target's fingerprint, so training and export can never
disagree about which layers were used.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specdraft.config import ExtractConfig, field_choices
from specdraft.files import FileError, open_safetensors, read_json

INDEX = "index.json"
STORE_DTYPES = field_choices(ExtractConfig, "store_dtype")
# The largest finite float8_e4m3fn value: each row's scale maps its largest magnitude here.
FP8_E4M3_MAX = 448.0
# bytes per element of the stored states, and the float32 scale each H-wide row carries in fp8.
STATE_BYTES = {"bfloat16": 2, "fp8_e4m3": 1}
SCALE_BYTES = {"bfloat16": 0, "fp8_e4m3": 4}
# input_ids (int32) + loss_mask (uint8) per token.
TOKEN_BYTES = 5
# What the reader hands out, whatever the storage (the trainer casts as it needs).
READ_DTYPE = "bfloat16"


def shard_name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


def bytes_per_token(num_states: int, hidden_size: int, store_dtype: str) -> int:
    """Bytes of one token's `num_states` hidden rows (and their scales) as stored."""
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"extract.store_dtype = {store_dtype!r}: expected one of {list(STORE_DTYPES)}")
    return num_states * (hidden_size * STATE_BYTES[store_dtype] + SCALE_BYTES[store_dtype])


def disk_bytes_per_token(num_states: int, hidden_size: int, store_dtype: str) -> int:
    """Disk bytes one token costs: its hidden rows plus its id and loss mask."""
    return bytes_per_token(num_states, hidden_size, store_dtype) + TOKEN_BYTES


def token_batches(indices: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive (length-sorted) samples grouped so that rows x longest row <= batch_tokens."""
    batches, current, longest = [], [], 0
    for i in indices:
        longest_if = max(longest, lengths[i])
        if current and longest_if * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if = [], lengths[i]
        current.append(i)
        longest = longest_if
    if current:
        batches.append(current)
    return batches


def quantize_fp8(x, rows: int):
    """x [N, rows*H] -> (float8_e4m3fn [N, rows*H], float32 scale [N, rows]), one scale per H-wide row."""
    import torch

    N = x.shape[0]
    grouped = x.float().reshape(N, rows, -1)  # [N, rows, H]
    # An all-zero row (padding, or a dead state) keeps scale 1 rather than dividing by zero.
    amax = grouped.abs().amax(dim=-1, keepdim=True)  # [N, rows, 1]
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (grouped / scale).to(torch.float8_e4m3fn).reshape(N, -1)  # [N, rows*H]
    return q, scale.reshape(N, rows)


def dequantize_fp8(q, scale):
    """(float8_e4m3fn [N, rows*H], scale [N, rows]) -> bfloat16 [N, rows*H]."""
    import torch

    N, rows = scale.shape
    x = q.float().reshape(N, rows, -1) * scale.float()[:, :, None]  # [N, rows, H]
    return x.reshape(N, -1).to(torch.bfloat16)


def encode_states(aux, last, store_dtype: str, num_aux: int) -> dict:
    """The tensors a shard stores for aux [N, n_aux*H] and last [N, H] under `store_dtype`."""
    import torch

    if store_dtype == "bfloat16":
        return {"aux": aux.to(torch.bfloat16).contiguous(), "last": last.to(torch.bfloat16).contiguous()}
    if store_dtype == "fp8_e4m3":
        aux_q, aux_s = quantize_fp8(aux, num_aux)
        last_q, last_s = quantize_fp8(last, 1)
        return {"aux": aux_q, "aux_scale": aux_s, "last": last_q, "last_scale": last_s}
    raise ValueError(f"extract.store_dtype = {store_dtype!r}: expected one of {list(STORE_DTYPES)}")


def shard_header(path: Path) -> dict | None:
    """A shard's safetensors header, or None when the file is torn (shorter or longer than its header
    says) or not a safetensors file. Reads only the header: cheap enough to check every shard on resume."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size:
                return None
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, AttributeError, KeyError, TypeError, IndexError):
        return None  # unreadable, not JSON, or JSON of another shape than a safetensors header
    return header if 8 + n + end == size else None


# What to do about hidden states that cannot be read: extract checks every shard and rewrites the torn ones.
REEXTRACT = "rerun `specdraft extract` (it rewrites torn or missing shards)"
# What index.json must hold for the reader, with the JSON type of each.
INDEX_FIELDS = {
    "state": str,
    "samples": list,
    "shards": list,
    "aux_layer_ids": list,
    "hidden_size": int,
    "store_dtype": str,
}


def read_index(hidden_dir: Path, need: tuple[str, ...] = tuple(INDEX_FIELDS)) -> dict:
    """hidden/index.json, checked for the fields `need` (of INDEX_FIELDS; all of them: the reader's)."""
    path = Path(hidden_dir) / INDEX
    if not path.exists():
        raise FileNotFoundError(f"{path}: no hidden states; run `specdraft extract` first")
    index = read_json(path, fix=REEXTRACT)
    wrong = [k for k in need if not isinstance(index.get(k), INDEX_FIELDS[k])]
    if wrong:
        raise FileError(f"{path}: {', '.join(wrong)} missing or of the wrong type (not extract's index); {REEXTRACT}")
    return index


def check_shards(hidden_dir: Path, index: dict) -> None:
    """Refuse, before any is read, a shard that is missing, torn, not a safetensors file, or short of the
    tensors or tokens index.json places in it (headers only: cheap for thousands of shards)."""
    names = ["input_ids", "loss_mask", "aux", "last"]
    names += ["aux_scale", "last_scale"] if index["store_dtype"] == "fp8_e4m3" else []
    ends: dict[str, int] = {}
    for s in index["samples"]:
        ok = isinstance(s, dict) and all(
            isinstance(s.get(k), t) for k, t in (("shard", str), ("offset", int), ("tokens", int))
        )
        if not ok:
            raise FileError(
                f"{Path(hidden_dir) / INDEX}: a sample placed as {s!r:.80} (not extract's index); {REEXTRACT}"
            )
        ends[s["shard"]] = max(ends.get(s["shard"], 0), s["offset"] + s["tokens"])
    for shard, end in ends.items():
        path = Path(hidden_dir) / shard
        header = shard_header(path)
        if not path.exists():
            raise FileError(f"{path}: missing; {REEXTRACT}")
        if header is None:
            raise FileError(
                f"{path}: not a whole safetensors file (torn by a kill or a copy, or another program's); {REEXTRACT}"
            )
        missing = [n for n in names if n not in header]
        shape = header["input_ids"].get("shape") if not missing else None
        rows = shape[0] if isinstance(shape, list) and shape and isinstance(shape[0], int) else 0
        if missing or rows < end:
            raise FileError(
                f"{path}: "
                + (f"no tensor(s) {missing}" if missing else f"{rows} tokens where index.json places {end}")
                + f" (not this run's shard); {REEXTRACT}"
            )
        H, n_aux = index["hidden_size"], len(index["aux_layer_ids"])
        widths = {"aux": [rows, n_aux * H], "last": [rows, H]}
        wrong = {k: header[k].get("shape") for k, want in widths.items() if header[k].get("shape") != want}
        if wrong:
            raise FileError(
                f"{path}: states of shape {wrong} where index.json's {n_aux} aux layers of width {H} "
                f"need {widths} (another target's shard?); {REEXTRACT}"
            )


class HiddenStore:
    """Random access to the extracted samples: `store[i]` reads only sample i's rows (memory-mapped
    slices of its shard). Safe for DataLoader workers: file handles are opened lazily in each process."""

    def __init__(self, hidden_dir: Path):
        self.dir = Path(hidden_dir)
        index_path = self.dir / INDEX
        self.index = read_index(self.dir)
        if self.index.get("state") != "done":
            raise RuntimeError(f"{index_path}: extraction is {self.index.get('state')}; rerun `specdraft extract`")
        check_shards(self.dir, self.index)
        self.samples = self.index["samples"]  # [{"shard", "offset", "tokens"}], in render order
        self.aux_layer_ids: list[int] = self.index["aux_layer_ids"]
        self.hidden_size: int = self.index["hidden_size"]
        self.store_dtype: str = self.index["store_dtype"]
        self.lengths: list[int] = [s["tokens"] for s in self.samples]
        self._handles: dict = {}

    def __len__(self) -> int:
        return len(self.samples)

    def _open(self, shard: str):
        if shard not in self._handles:
            self._handles[shard] = open_safetensors(self.dir / shard, fix=REEXTRACT)
        return self._handles[shard]

    def _rows(self, i: int, name: str):
        s = self.samples[i]
        return self._open(s["shard"]).get_slice(name)[s["offset"] : s["offset"] + s["tokens"]]

    def __getitem__(self, i: int) -> dict:
        """Sample i: input_ids [T] int32, loss_mask [T] uint8, aux [T, n_aux*H] and last [T, H] bfloat16."""
        if not 0 <= i < len(self.samples):
            raise IndexError(f"sample {i} outside 0..{len(self.samples) - 1}")
        out = {"input_ids": self._rows(i, "input_ids"), "loss_mask": self._rows(i, "loss_mask")}
        for name in ("aux", "last"):
            out[name] = self._states(i, name)
        return out

    def _states(self, i: int, name: str, device=None):
        """Sample i's `name` states ("aux" or "last") in bfloat16 on `device` (None: the CPU), dequantised
        when stored as fp8 — on `device`, after the copy, so a GPU does the conversion and the copy moves
        half the bytes."""
        rows = self._rows(i, name)
        if device is not None:
            rows = rows.to(device)
        if self.store_dtype == "fp8_e4m3":
            scale = self._rows(i, f"{name}_scale")
            return dequantize_fp8(rows, scale if device is None else scale.to(device))
        return rows

    def last(self, i: int, device=None):
        """Only sample i's last-layer states [T, H] bfloat16 on `device`: what the target's top tokens need
        (fp8 stores dequantise a quarter of what `self[i]` would)."""
        return self._states(i, "last", device)

    def tokens(self, i: int) -> tuple[list[int], list[int]]:
        """Only the token ids and loss mask of sample i (cheap: no hidden states are read)."""
        return self._rows(i, "input_ids").tolist(), self._rows(i, "loss_mask").tolist()

    def batch(self, indices: list[int]) -> list[dict]:
        return [self[i] for i in indices]

    def loader(self, batches: list[list[int]], num_workers: int = 0, prefetch: int = 2):
        """Yield `self.batch(b)` for each list of indices in `batches`, read ahead of the consumer:
        by `num_workers` DataLoader processes (each reading `prefetch` batches ahead), or, with no
        workers, by one background thread `prefetch` batches ahead (reads release the GIL)."""
        if num_workers > 0:
            from torch.utils.data import DataLoader

            return iter(
                DataLoader(
                    self, batch_sampler=batches, collate_fn=_as_list, num_workers=num_workers, prefetch_factor=prefetch
                )
            )
        return read_ahead(self.batch, batches, prefetch)

    def __getstate__(self):
        # Open file handles do not cross into worker processes; each worker opens its own.
        return {**self.__dict__, "_handles": {}}


def _as_list(items: list[dict]) -> list[dict]:
    return items


def read_ahead(read, batches: list[list[int]], depth: int):
    """read(b) for each b in batches, with up to `depth` reads running ahead in a thread."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = [pool.submit(read, b) for b in batches[:depth]]
        for n in range(len(batches)):
            result = pending.pop(0).result()
            if n + depth < len(batches):
                pending.append(pool.submit(read, batches[n + depth]))
            yield result
