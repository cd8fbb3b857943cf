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
from torch import nn

from specdraft.drafters.common import NO_DOCUMENT, position_loss, shift
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


class TTT(nn.Module):
    """The training-time test of one drafter on one packed batch, as one module so DDP and FSDP wrap
    a single forward. Returns the weighted loss and per-step statistics [steps, len(STAT_COLUMNS)]."""

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
        super().__init__()
        self.drafter = drafter
        # The draft vocab's rows of the target's lm_head [Vd, H]: frozen, it gives the target distribution.
        self.register_buffer("draft_head", draft_head, persistent=False)
        self.steps, self.decay, self.loss, self.checkpointing = steps, decay, loss, checkpointing
        self.hidden_noise = hidden_noise

    def noisy(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, n_aux*H] plus uniform noise of +-hidden_noise x each state's RMS, in training only."""
        if not (self.training and self.hidden_noise):
            return aux
        rms = aux.pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, 1]
        return aux + (torch.rand_like(aux) * 2 - 1) * self.hidden_noise * rms

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.drafter
        ids, docs, pos = batch["input_ids"], batch["documents"], batch["positions"]
        with torch.no_grad():
            probs = torch.softmax((batch["last"] @ self.draft_head.T.to(batch["last"].dtype)).float(), -1)  # [B, T, Vd]
            inside = d.t2d[batch["top"]]  # [B, T]
        total = torch.zeros((), device=ids.device)
        stats = []
        chain = torch.ones_like(batch["loss_mask"])  # drafts correct so far, per position
        aux = self.noisy(batch["aux"].float())
        for i, logits in enumerate(unroll(d, aux, ids, docs, pos, self.steps, self.checkpointing)):
            # x_{t+2+i}: an assistant token of the same document
            evaluable = shift(batch["loss_mask"], 2 + i, False) & (shift(docs, 2 + i, NO_DOCUMENT) == docs)
            where = evaluable & shift(inside, 1 + i, False)  # [B, T]
            count = where.sum()
            loss_sum = (position_loss(self.loss, logits, shift(probs, 1 + i)) * where).sum()
            total = total + self.decay**i * loss_sum / count.clamp(min=1)
            with torch.no_grad():
                pred = logits.argmax(-1)
                correct = (pred + d.d2t[pred]) == shift(batch["top"], 1 + i)  # the target's greedy token
                before = chain & evaluable
                chain = chain & correct
                row = [
                    loss_sum.detach(),
                    count,
                    (correct & where).sum(),
                    evaluable.sum(),
                    (chain & evaluable).sum(),
                    before.sum(),
                ]
                stats.append(torch.stack([x.float() for x in row]))
        return total, torch.stack(stats)
