"""DFlash's training objective: many drafting rounds of a sequence in one forward pass, each a block
anchored at a random assistant token, with a position-weighted loss against the target's distribution.

Alignment (one packed document: tokens x_t, target aux states h_t, final-norm states z_t). An anchor a
plays a round's bonus token: its block is [x_a, mask, ..., mask] at positions a .. a + bs - 1, and it
sees the context features of positions < a of its own document (h_a itself is not known when x_a is
the bonus token) and its whole block, nothing of other blocks. Slot j >= 1 predicts the token at a + j,
whose target distribution is softmax(lm_head(z_{a+j-1})) over the draft vocabulary. It counts where
x_{a+j} is an assistant token of the same document and the target's top token there is inside the
draft vocabulary (as in EAGLE-3's objective), weighted w_j = exp(-(j - 1) / gamma) (the paper's
weighting: a round stops at its first wrong draft, so early slots matter more). Anchors are assistant
tokens whose next token is one too, drawn at random, at most `max_anchors` per row.

The statistics are those of the EAGLE-3 objective (common.STAT_COLUMNS, read by common.summarize), with
block slot j in place of drafting step j - 1: per slot, top-1 agreement with the target's greedy token
and the chance that a round's drafts are all right through slot j, whence tau.
"""

from __future__ import annotations

import torch
from torch import nn

from specdraft.drafters.common import PAD_DOCUMENT, position_loss
from specdraft.methods.dflash.drafter import DFlashDrafter

# The paper's and SpecForge's weighting for blocks of 16: slot 16 weighs exp(-14 / 7) = 0.14 of slot 1.
DEFAULT_GAMMA = 7.0
# Blocks per row, at most (SpecForge and speculators draw up to 512 per sequence).
DEFAULT_MAX_ANCHORS = 512


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_j for slots 0 .. bs - 1: 0 for the anchor, exp(-(j - 1) / gamma) after it [bs]."""
    j = torch.arange(block_size, dtype=torch.float32)
    return torch.where(j == 0, torch.zeros(()), torch.exp(-(j - 1) / gamma))


def candidate_anchors(loss_mask: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """Positions that can anchor a block [B, T] (bool): an assistant token followed by another one of
    the same document, so that slot 1 has a label."""
    nxt_mask = torch.cat([loss_mask[:, 1:], torch.zeros_like(loss_mask[:, :1])], dim=1)
    nxt_doc = torch.cat([documents[:, 1:], torch.full_like(documents[:, :1], PAD_DOCUMENT)], dim=1)
    return loss_mask & nxt_mask & (nxt_doc == documents) & (documents != PAD_DOCUMENT)


def sample_anchors(
    candidates: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to max_anchors candidates per row, at random, in ascending order -> anchors [B, N] and which
    are real [B, N] (rows with fewer candidates are padded with anchor 0, not real). N is the most any
    row has, at most max_anchors."""
    B, T = candidates.shape
    scores = torch.rand(B, T, generator=generator).to(candidates.device)  # drawn on the CPU: reproducible
    scores = scores.masked_fill(~candidates, 2.0)  # non-candidates sort last
    N = max(1, min(max_anchors, int(candidates.sum(1).max())))
    chosen = scores.topk(N, dim=1, largest=False).indices  # [B, N]
    real = candidates.gather(1, chosen)
    chosen = torch.where(real, chosen, torch.full_like(chosen, T))  # padding sorts last
    anchors, order = chosen.sort(dim=1)
    real = real.gather(1, order)
    return torch.where(real, anchors, torch.zeros_like(anchors)), real


def shifted(x: torch.Tensor, index: torch.Tensor, fill) -> torch.Tensor:
    """x [B, T, ...] gathered at index [B, Q] along T; positions outside 0..T-1 get `fill`."""
    T = x.shape[1]
    inside = (index >= 0) & (index < T)
    safe = index.clamp(0, T - 1)
    flat = safe.reshape(safe.shape[0], -1, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    out = x.gather(1, flat)
    mask = inside.reshape(*inside.shape, *([1] * (x.dim() - 2)))
    return torch.where(mask, out, torch.as_tensor(fill, dtype=x.dtype, device=x.device))


class DFlashObjective(nn.Module):
    """The DFlash objective of one drafter on one packed batch (the same batch dict as TTT's:
    input_ids, loss_mask, documents, positions, top [B, T], aux [B, T, n_aux*Ht], last [B, T, H]).
    Returns the weighted loss and per-slot statistics [block_size - 1, len(STAT_COLUMNS)]."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        draft_head: torch.Tensor,
        gamma: float = DEFAULT_GAMMA,
        max_anchors: int = DEFAULT_MAX_ANCHORS,
        loss: str = "soft_ce",
    ):
        super().__init__()
        self.drafter = drafter
        # The draft vocab's rows of the target's lm_head [Vd, H]: frozen, it gives the target distribution.
        self.register_buffer("draft_head", draft_head, persistent=False)
        self.gamma, self.max_anchors, self.loss = gamma, max_anchors, loss
        self.generator: torch.Generator | None = None  # set for reproducible anchors

    def blocks(self, batch: dict) -> dict:
        """The blocks of a batch: anchors, the blocks' inputs and positions, what each query sees, and
        per slot the label index, whether it is supervised, and whether its anchor is real."""
        d = self.drafter
        bs = d.config.block_size
        ids, docs, pos, mask = batch["input_ids"], batch["documents"], batch["positions"], batch["loss_mask"]
        anchors, real = sample_anchors(candidate_anchors(mask, docs), self.max_anchors, self.generator)  # [B, N]
        B, N = anchors.shape
        T = ids.shape[1]
        slot = torch.arange(bs, device=ids.device)
        at = (anchors[..., None] + slot).reshape(B, N * bs)  # [B, Q]: slot j of block n sits at anchor + j
        anchor_q = anchors.repeat_interleave(bs, dim=1)  # [B, Q]
        anchor_doc = docs.gather(1, anchor_q)  # [B, Q]
        # Context: positions before the anchor, in the anchor's document, of real blocks only.
        t = torch.arange(T, device=ids.device)
        visible = (
            (t[None, None] < anchor_q[..., None])
            & (docs[:, None, :] == anchor_doc[..., None])
            & real.repeat_interleave(bs, dim=1)[..., None]
        )  # [B, Q, T]
        label_mask = shifted(mask, at, False) & (shifted(docs, at, PAD_DOCUMENT) == anchor_doc)  # [B, Q]
        supervised = label_mask & (slot.repeat(N)[None] > 0) & real.repeat_interleave(bs, dim=1)  # [B, Q]
        return {
            "anchors": anchors,
            "real": real,
            "at": at,
            "visible": visible,
            "supervised": supervised,
            "block_ids": d.block_inputs(ids.gather(1, anchors)),  # [B, Q]
            "block_positions": (pos.gather(1, anchors)[..., None] + slot).reshape(B, N * bs),  # [B, Q]
        }

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.drafter
        bs = d.config.block_size
        b = self.blocks(batch)
        N = b["anchors"].shape[1]
        context = d.context(batch["aux"].to(d.fc.weight.dtype), batch["positions"])
        logits = d(b["block_ids"], b["block_positions"], context, b["visible"])  # [B, Q, Vd]
        with torch.no_grad():
            # Slot j's label is the token at a + j: the target's distribution from z_{a+j-1}.
            last = shifted(batch["last"], b["at"] - 1, 0)  # [B, Q, H]
            probs = torch.softmax((last @ self.draft_head.T.to(last.dtype)).float(), -1)  # [B, Q, Vd]
            top = shifted(batch["top"], b["at"] - 1, 0)  # [B, Q]: the target's greedy token at a + j
            where = b["supervised"] & d.t2d[top]  # [B, Q]
        weights = slot_weights(bs, self.gamma).to(logits.device).repeat(N)[None]  # [1, Q]
        per = position_loss(self.loss, logits, probs)  # [B, Q]
        total = (per * weights * where).sum() / (weights * where).sum().clamp(min=torch.finfo(torch.float32).tiny)
        with torch.no_grad():
            pred = logits.argmax(-1)
            correct = (pred + d.d2t[pred]) == top  # [B, Q]
            stats = slot_stats(per.detach(), correct, where, b["supervised"], bs)
        return total, stats


def slot_stats(
    per: torch.Tensor, correct: torch.Tensor, where: torch.Tensor, evaluable: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Per drafted slot j = 1 .. bs - 1, common.STAT_COLUMNS: summed loss and its count, top-1 correct among
    them, evaluable slots, rounds correct through slot j, rounds correct before it -> [bs - 1, 6]."""
    B, Q = per.shape
    shape = (B, Q // block_size, block_size)
    per, correct, where, evaluable = (x.reshape(shape)[..., 1:] for x in (per, correct, where, evaluable))
    chain = torch.cumprod(correct.long(), dim=-1).bool()  # all drafts correct through slot j
    before = torch.cat([torch.ones_like(chain[..., :1]), chain[..., :-1]], dim=-1)
    rows = [
        (per * where).sum((0, 1)),
        where.sum((0, 1)),
        (correct & where).sum((0, 1)),
        evaluable.sum((0, 1)),
        (chain & evaluable).sum((0, 1)),
        (before & evaluable).sum((0, 1)),
    ]
    return torch.stack([r.float() for r in rows], dim=-1)  # [bs - 1, 6]
