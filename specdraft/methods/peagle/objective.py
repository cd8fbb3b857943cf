"""P-EAGLE's training objective: every position of a packed row anchors a block of K slots, all trained in
one forward of the objective, with a loss against the target's distribution at every slot.

Alignment (T tokens x_0..x_{T-1} of one document, target aux states h_t, final-norm states z_t), the
block anchored at t (its last accepted position, as a round at inference):

- slot 0 at position t reads (x_{t+1}, fc(h_t)): EAGLE-3's step 0, one query per position;
- slot i (1 <= i < K) at position t + i reads (mask token, fc(mask_hidden)) and sees the slot-0 keys
  <= t of its document and the keys of slots 1..i of its own block (drafters/common.attend's diagonal
  keys: slot i's keys of the block at t are stored at t);
- slot i predicts x_{t+2+i}, whose target distribution is softmax(lm_head(z_{t+1+i})) restricted to the
  draft vocabulary, counted where x_{t+2+i} is an assistant token of the same document and the target's
  top token is inside the draft vocabulary (EAGLE-3's rule).

This is the peers' scheme (speculators' P-EAGLE: depth-d copies of the row, each query seeing the
depth-0 keys up to its anchor and the same anchor's earlier depths) with every anchor kept rather than
a sampled share per depth. Slot i is weighted step_weight_decay^i, as EAGLE-3's TTT steps. The slots are
run as K layer calls of T queries (the mask slots' inputs do not depend on earlier slots' outputs, so the
order is only the diagonal keys'); statistics rows are per slot, as DFlash's.
"""

from __future__ import annotations

import torch

from specdraft.drafters.common import ShiftedObjective, document_mask, shift
from specdraft.methods.peagle.drafter import PEagleDrafter


def slot_logits(
    drafter: PEagleDrafter, aux, ids, documents, positions, slots: int, checkpointing: bool = False, mask=None
):
    """Yield each slot's logits [B, T, Vd] over anchors t (module docstring)."""
    mask = document_mask(documents) if mask is None else mask
    B, T = ids.shape
    hidden, tokens = drafter.project(aux), shift(ids, 1)
    base, diag = None, []
    for i in range(slots):
        if i:
            hidden, tokens = drafter.mask_inputs(B, T, ids.device)
        args = (hidden, tokens, positions + i, base, diag if i else None, 0, mask)
        if checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            logits, _, kv = checkpoint(drafter, *args, use_reentrant=False)
        else:
            logits, _, kv = drafter(*args)
        if i == 0:
            base = kv
        else:
            diag = diag + [kv]
        yield logits


class ParallelSlots(ShiftedObjective):
    """The objective of one P-EAGLE drafter on one packed batch (drafters.common.ShiftedObjective: the
    loss and per-slot statistics [K, len(STAT_COLUMNS)]), its K slots in one forward."""

    def position_logits(self, aux, ids, documents, positions):
        d = self.drafter
        return slot_logits(d, aux, ids, documents, positions, d.config.speculative_tokens, self.checkpointing)
