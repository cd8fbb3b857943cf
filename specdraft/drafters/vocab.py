"""The draft vocabulary: the most frequent target tokens the drafter is trained to predict.

A smaller lm_head makes each drafting step cheaper; tokens outside it can never be drafted. Draft ids
are the chosen target ids in ascending order, so d2t (target id = draft id + d2t[draft id]) holds
non-negative offsets, the form vLLM and SGLang read.
"""

from __future__ import annotations

import torch


def token_counts(samples, vocab_size: int) -> torch.Tensor:
    """How often each target id appears as a loss-masked (assistant) token."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in samples:
        ids = torch.as_tensor(ids, dtype=torch.long)
        mask = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def build(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [size] int64 offsets, t2d [vocab] bool) for the `size` most frequent ids.

    Ties (including never-seen ids, when the data has fewer distinct tokens than `size`) go to the
    lower id, so the choice is deterministic.
    """
    vocab = counts.numel()
    size = min(size, vocab)
    # Stable sort by descending count keeps ties in ascending id order.
    order = torch.sort(-counts, stable=True).indices[:size]
    draft_to_target = torch.sort(order).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_to_target] = True
    d2t = draft_to_target - torch.arange(size)
    return d2t, t2d


def checked_t2d(
    d2t: torch.Tensor, draft_vocab_size: int, vocab_size: int, given: torch.Tensor | None, where
) -> torch.Tensor:
    """t2d [vocab] bool rebuilt from a folder's d2t [draft vocab] offsets, which the engines add unchecked:
    refused where d2t is not of that shape or maps outside the target vocabulary, or where the folder's
    own t2d (`given`, which the engines skip) marks other ids."""
    if d2t.shape != (draft_vocab_size,):
        raise ValueError(f"{where}: d2t has shape {list(d2t.shape)}, expected [{draft_vocab_size}]")
    targets = torch.arange(draft_vocab_size) + d2t
    if targets.numel() and (targets.min() < 0 or targets.max() >= vocab_size):
        raise ValueError(
            f"{where}: d2t maps draft ids outside the target vocabulary (0..{vocab_size - 1}); "
            "it must hold offsets (target id = draft id + d2t[draft id]), not absolute ids"
        )
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[targets] = True
    if given is not None and not torch.equal(given.bool(), t2d):
        raise ValueError(f"{where}: t2d does not mark the target ids that d2t maps the draft vocabulary to")
    return t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the loss-masked tokens that the draft vocabulary contains."""
    total = counts.sum().item()
    return counts[t2d].sum().item() / total if total else 0.0
