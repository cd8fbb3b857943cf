"""P-EAGLE rounds in the reference decoder's one round loop (rounds.decode): a round drafts K tokens in one
drafter forward, verified by the target as a chain of K + 1 (as an EAGLE-3 chain is).

The decode state (SlotState on the eager engine, StaticSlotState on preallocated buffers) is EAGLE-3's
step-0 cache: `advance` runs the real slots of newly accepted positions (position t reads the target's
aux h_t and the token x_{t+1}); its last row is the round's real slot (position n, the next token), whose
logits are draft 1. `draft` then runs the K - 1 mask slots at n + 1 .. n + K - 1 against that cache,
causally, exactly as vLLM's one forward over [accepted positions, next token, mask, ..., mask] computes
them (llm_base_proposer with parallel_drafting: the mask slots' keys are written past the accepted
positions and rewritten by the next round's real ones, as ours are).
"""

from __future__ import annotations

import torch

from specdraft.decoding.rounds import GreedyTree, Stats, decode
from specdraft.decoding.static import StepGraphs
from specdraft.decoding.tree import Tree, TreeShape
from specdraft.drafters.common import Step0Cache
from specdraft.methods.contract import DecodeStates


class SlotState(Step0Cache):
    """The drafter's cache of real-slot keys (one per verified position) and the round's real slot."""

    @torch.inference_mode()
    def draft(self, K: int) -> list[int]:
        """The round's K drafts (target ids): the real slot's and the K - 1 mask slots'."""
        d = self.drafter
        logits = [self.root_logits[None]]
        if K > 1:
            logits.append(d.mask_slots(self.cache, self.root_position, K))
        return d.to_target_ids(torch.cat(logits).argmax(-1)).tolist()


class StaticSlotState:
    """SlotState's interface on a preallocated cache (a position's slot its position): advance padded to
    `max_accepted` rows after the prefill, the mask slots against the whole capacity under a mask of the
    verified positions, each one graph when graphs are on."""

    def __init__(self, drafter, capacity: int, graphs: StepGraphs):
        cfg = drafter.config
        dtype, device = drafter.fc.weight.dtype, drafter.fc.weight.device
        self.drafter, self.capacity, self.graphs = drafter, capacity, graphs
        shape = (cfg.num_layers, 1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.root_logits, self.root_position, self.max_accepted = None, -1, 1

    def reset(self, max_accepted: int):
        self.root_logits, self.root_position, self.max_accepted = None, -1, max_accepted

    @torch.inference_mode()
    def advance(self, aux: torch.Tensor, next_tokens: list[int], first_position: int):
        """As SlotState.advance; padded rows come last, no real row sees them, and the next advance
        rewrites their slots before anything reads them."""
        m, dev = len(next_tokens), self.keys.device
        if first_position == 0:  # the prefill: its length differs per prompt, so it is never captured
            logits = self._advance(aux, torch.tensor([next_tokens], device=dev), torch.tensor(0, device=dev))
        else:
            rows = max(m, self.max_accepted)
            if first_position + rows > self.capacity:
                raise RuntimeError(f"drafter cache of {self.capacity} slots is full: reserve() more before decoding")
            padded = aux.new_zeros((rows, aux.shape[1]))
            padded[:m] = aux
            logits = self.graphs(
                ("slot-advance", rows),
                self._advance,
                padded,
                torch.tensor([next_tokens + [0] * (rows - m)]),
                torch.tensor(first_position),
            )
        self.root_logits = logits[m - 1]
        self.root_position = first_position + m - 1

    def _advance(self, aux, tokens, first):
        """aux [W, n_aux*Ht], tokens [1, W], first [] -> logits [W, Vd]; writes W cache slots."""
        d, W = self.drafter, tokens.shape[1]
        slots = first + torch.arange(W, device=tokens.device)
        mask = torch.cat(
            [
                (torch.arange(self.capacity, device=tokens.device) < first)[None].expand(W, -1),
                torch.ones(W, W, dtype=torch.bool, device=tokens.device).tril(),
            ],
            dim=1,
        )  # [W, C+W]
        logits, _, (k, v) = d(
            d.project(aux.to(self.keys.dtype))[None], tokens, slots[None], base=(self.keys, self.values), mask=mask
        )
        self.keys.index_copy_(3, slots, k)  # [layers, 1, nkv, C, d]
        self.values.index_copy_(3, slots, v)
        return logits[0]

    @torch.inference_mode()
    def draft(self, K: int) -> list[int]:
        if K == 1:
            return self.drafter.to_target_ids(self.root_logits.argmax(-1, keepdim=True)).tolist()
        ids = self.graphs(
            ("slot-draft", K),
            lambda logits, n: self._draft(logits, n, K),
            self.root_logits,
            torch.tensor(self.root_position),
        )
        return ids.tolist()

    def _draft(self, root_logits, n, K):
        """root_logits [Vd], n [] -> the K drafted target ids."""
        d, dev = self.drafter, root_logits.device
        seen = (torch.arange(self.capacity, device=dev) <= n)[None].expand(K - 1, -1)  # [K-1, C]
        mask = torch.cat([seen, torch.ones(K - 1, K - 1, dtype=torch.bool, device=dev).tril()], dim=1)
        logits = torch.cat([root_logits[None], d.mask_slots((self.keys, self.values), n, K, mask)])
        return d.to_target_ids(logits.argmax(-1))


STATES = DecodeStates(SlotState, StaticSlotState)


class GreedySlots(GreedyTree):
    """Greedy P-EAGLE rounds: K drafts from one drafter forward, verified and accepted as a chain of K."""

    forwards = 1  # the real slot and the mask slots are one forward in vLLM

    def __init__(self, K: int):
        super().__init__(TreeShape.chain(K), STATES)
        self.K = K

    def draft(self, state) -> Tree:
        return Tree.chain(state.draft(self.K))


def speculative_peagle(runner, drafter, prompt: list[int], max_new: int, eos: int, K: int, stats: Stats) -> list[int]:
    """Greedy speculative decoding with P-EAGLE's parallel drafts of K; returns the generated ids."""
    return decode(runner, drafter, prompt, max_new, eos, GreedySlots(K), stats)
