"""The trainer's source of hidden states: the extracted shards, the target computing them in the trainer's
process batch by batch (nothing written), or a vLLM server streaming them (hidden/served.py).
"""

from __future__ import annotations

from specdraft.config import Recipe
from specdraft.data.tokens import load_tokens
from specdraft.hidden.capture import forward_states, load_target_model, resolved
from specdraft.hidden.store import HiddenStore, read_ahead
from specdraft.run import RunFolder
from specdraft.targets import Target


class OnlineHidden:
    """The hidden states of the rendered samples, computed on access by the target in this process
    (nothing on disk). Same interface as HiddenStore; `batch()` runs one forward for many samples."""

    def __init__(self, recipe: Recipe, folder: RunFolder):
        folder.require("render")
        cfg = resolved(recipe.extract)
        self.target = Target(recipe.target.model, recipe.target.aux_layer_ids)
        _, self.samples = load_tokens(folder.tokens, self.target.vocab_size)
        self.lengths = [len(ids) for ids, _ in self.samples]
        self.aux_layer_ids: list[int] = self.target.aux_layer_ids
        self.hidden_size: int = self.target.hidden_size
        self.store_dtype = cfg.dtype  # what the states are computed in; nothing is stored
        self.model = load_target_model(self.target, cfg)

    def __len__(self) -> int:
        return len(self.samples)

    def last(self, i: int, device=None):
        last = self[i]["last"]
        return last.to(device) if device is not None else last

    def tokens(self, i: int) -> tuple[list[int], list[int]]:
        return list(self.samples[i][0]), list(self.samples[i][1])

    def batch(self, indices: list[int]) -> list[dict]:
        """One padded forward over `indices`; per sample the same dict as HiddenStore[i] (on the CPU)."""
        import torch

        aux, last = forward_states(self.model, self.target, [self.samples[i][0] for i in indices])
        aux, last = aux.to("cpu", torch.bfloat16), last.to("cpu", torch.bfloat16)
        out, offset = [], 0
        for i in indices:
            ids, mask = self.samples[i]
            T = len(ids)
            out.append(
                {
                    "input_ids": torch.tensor(ids, dtype=torch.int32),
                    "loss_mask": torch.tensor(mask, dtype=torch.uint8),
                    "aux": aux[offset : offset + T],
                    "last": last[offset : offset + T],
                }
            )
            offset += T
        return out

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self.samples):
            raise IndexError(f"sample {i} outside 0..{len(self.samples) - 1}")
        return self.batch([i])[0]

    def loader(self, batches: list[list[int]], num_workers: int = 0, prefetch: int = 2):
        """Like HiddenStore.loader; the forward of the next batches runs in a thread while the caller
        trains. Worker processes would each need their own copy of the target, so there are none."""
        if num_workers:
            raise ValueError(
                "online hidden states are computed by the target in this process: num_workers must "
                "be 0 (use prefetch to overlap the target's forward with training)"
            )
        return read_ahead(self.batch, batches, prefetch)


def open_hidden(recipe: Recipe, folder: RunFolder, servers: list | None = None):
    """The trainer's source of hidden states, chosen by `train.hidden`: the extracted shards ("disk"), the
    target running in the trainer's process ("online"), or states servers ("served", hidden/served.py:
    `servers` are started ones handed over). All give the same interface as HiddenStore."""
    if recipe.train.hidden == "disk":
        return HiddenStore(folder.hidden)
    if recipe.train.hidden == "online":
        return OnlineHidden(recipe, folder)
    if recipe.train.hidden == "served":
        from specdraft.hidden.served import ServedHidden

        return ServedHidden(recipe, folder, servers)
    raise ValueError(f"train.hidden = {recipe.train.hidden!r}: expected 'disk', 'online' or 'served'")
