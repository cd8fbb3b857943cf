"""EAGLE-3's training objective: training-time test (TTT), the drafter unrolled over its own drafting
steps on packed rows, with a loss against the target's distribution at every step.

Alignment (T tokens x_0..x_{T-1} of one document, target aux states h_t, final-norm states z_t): at
drafting step i the drafter at position t reads token x_{t+1+i} and, at step 0, fc(h_t) (later: its
own output of step i-1 at t). It predicts x_{t+2+i}, whose target distribution is
softmax(lm_head(z_{t+1+i})) restricted to the draft vocabulary. The loss counts where x_{t+2+i} is an
assistant token of the same document and the target's top token is inside the draft vocabulary
(EAGLE-3's rule: elsewhere the drafter cannot be right). Step i runs at rotary positions t+i (counted
from the document's start), as it does when drafting, and is weighted decay^i.
"""

from __future__ import annotations

import torch

from specdraft.drafters.common import ShiftedObjective, shift
from specdraft.methods.eagle3.drafter import Eagle3Drafter, document_mask


def unroll(drafter: Eagle3Drafter, aux, ids, documents, positions, steps: int, checkpointing: bool = False, mask=None):
    """Training-time test: yield each step's logits [B, T, Vd] over drafter positions t.

    Step i reads token x_{t+1+i} at rotary position t+i; its hidden input is fc(aux) at step 0 and the
    previous step's output after that; its queries see the step-0 keys at positions <= t of the same
    document and the keys of steps 1..i at t, exactly what drafting at inference sees
    (tests/test_drafter.py checks it).
    """
    mask = document_mask(documents) if mask is None else mask
    hidden = drafter.project(aux)  # [B, T, H] (autocast runs fc in bf16)
    base, diag = None, None
    for i in range(steps):
        tokens, pos = shift(ids, 1 + i), positions + i
        if checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            # Recomputed in backward: only this step's inputs are kept, not its activations.
            logits, hidden, kv = checkpoint(drafter, hidden, tokens, pos, base, diag, 0, mask, use_reentrant=False)
        else:
            logits, hidden, kv = drafter(hidden, tokens, pos, base=base, diag=diag, mask=mask)
        base, diag = (kv, []) if i == 0 else (base, diag + [kv])
        yield logits


class TTT(ShiftedObjective):
    """The training-time test of one drafter on one packed batch (drafters.common.ShiftedObjective: the
    loss and per-step statistics [steps, len(STAT_COLUMNS)]), its steps unrolled."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        draft_head: torch.Tensor,
        steps: int,
        decay: float,
        loss: str = "soft_ce",
        checkpointing: bool = False,
        hidden_noise: float = 0.0,
    ):
        super().__init__(drafter, draft_head, decay, loss, checkpointing, hidden_noise)
        self.steps = steps

    def position_logits(self, aux, ids, documents, positions):
        return unroll(self.drafter, aux, ids, documents, positions, self.steps, self.checkpointing)
