"""The hidden-state shard format, its index, and the reader the trainer uses.

`hidden/shard-NNNNN.safetensors` holds, per sample i, `i.input_ids` [T], `i.loss_mask` [T],
`i.aux` [T, n_aux * H] (the aux layers' states concatenated in `aux_layer_ids` order, which is the
order the drafter's fc expects) and `i.last` [T, H] (the final-norm output, what lm_head sees).
`hidden/index.json` lists the shards, each sample's shard and length, the layer ids, the dtype and
the target's fingerprint, so training and export can never disagree about which layers were used.
"""

from __future__ import annotations

import json
from pathlib import Path

HIDDEN_DIR = "hidden"
INDEX = "index.json"


def shard_name(n: int) -> str:
    return f"shard-{n:05d}.safetensors"


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


class HiddenStore:
    """Random access to the extracted samples (safe for DataLoader workers: handles open lazily)."""

    def __init__(self, run_path: Path):
        self.dir = Path(run_path) / HIDDEN_DIR
        index_path = self.dir / INDEX
        if not index_path.exists():
            raise FileNotFoundError(f"{index_path}: no hidden states; run `specdraft extract` first")
        self.index = json.loads(index_path.read_text())
        if self.index.get("state") != "done":
            raise RuntimeError(f"{index_path}: extraction is {self.index.get('state')}; rerun `specdraft extract`")
        self.samples = self.index["samples"]  # [{"key", "shard", "tokens"}]
        self.aux_layer_ids: list[int] = self.index["aux_layer_ids"]
        self.hidden_size: int = self.index["hidden_size"]
        self._handles: dict = {}

    def __len__(self) -> int:
        return len(self.samples)

    def _open(self, shard: str):
        from safetensors import safe_open

        if shard not in self._handles:
            self._handles[shard] = safe_open(self.dir / shard, "pt")
        return self._handles[shard]

    def __getitem__(self, i: int) -> dict:
        s = self.samples[i]
        f = self._open(s["shard"])
        return {name: f.get_tensor(f"{s['key']}.{name}") for name in ("input_ids", "loss_mask", "aux", "last")}

    def tokens(self, i: int) -> tuple[list[int], list[int]]:
        """Only the token ids and loss mask of sample i (cheap: no hidden states are read)."""
        s = self.samples[i]
        f = self._open(s["shard"])
        return f.get_tensor(f"{s['key']}.input_ids").tolist(), f.get_tensor(f"{s['key']}.loss_mask").tolist()

    def __getstate__(self):
        # Open file handles do not cross into worker processes; each worker opens its own.
        return {**self.__dict__, "_handles": {}}


def open_hidden(recipe, run):
    """The trainer's source of hidden states, chosen by `train.hidden`: the extracted shards ("disk") or
    the target running beside the trainer ("online"). Both give the same interface as HiddenStore."""
    if recipe.train.hidden == "disk":
        return HiddenStore(run.path)
    if recipe.train.hidden == "online":
        from .extract import OnlineHidden

        return OnlineHidden(recipe, run)
    raise ValueError(f"train.hidden = {recipe.train.hidden!r}: expected 'disk' or 'online'")
