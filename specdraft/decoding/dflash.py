"""DFlash rounds in the reference decoder's one round loop (rounds.decode): a round drafts a whole block
in one drafter forward, and the target verifies it in one forward as it verifies an EAGLE-3 chain.

BlockContext is the drafter's state across rounds: its context is the keys and values every drafter
layer makes of the target's aux states, one per accepted position, appended as rounds accept them (vLLM
writes the same into its drafter KV cache). A round whose last token x_n (the anchor: produced by the
target, not yet fed to it) sits at position n drafts positions n + 1 .. n + K from the context of the
positions < n and the block [x_n, mask, ..., mask]; the target is then fed x_n and the K drafts at
positions n .. n + K, and GreedyBlock keeps the longest drafted prefix the target itself picks, plus the
target's own next token (the next round's anchor). Greedy output is the target's own, whatever the
drafts; K = block_size - 1.
"""

from __future__ import annotations

import torch

from specdraft.decoding.rounds import GreedyTree, Stats, decode
from specdraft.decoding.tree import Tree, TreeShape
from specdraft.drafters.dflash import KV, DFlashDrafter


class BlockContext:
    """The drafter's context (every layer's keys and values of the accepted positions) and the anchor
    of the next round."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.context: list[KV] | None = None
        self.anchor, self.anchor_position = -1, -1

    @torch.inference_mode()
    def advance(self, aux: torch.Tensor, next_tokens: list[int], first_position: int) -> None:
        """Newly accepted positions first_position, ... with the target's aux states aux [n, n_aux*H];
        next_tokens[i] is the token after position first_position + i, so the last one is the next
        round's anchor, at the position after them."""
        d = self.drafter
        positions = torch.arange(first_position, first_position + aux.shape[0], device=aux.device)[None]  # [1, n]
        new = d.context(aux.to(d.fc.weight.dtype)[None], positions)  # per layer 2 x [1, nkv, n, d]
        self.context = new if self.context is None else [
            (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2)) for (k, v), (nk, nv) in zip(self.context, new)]
        self.anchor, self.anchor_position = next_tokens[-1], first_position + len(next_tokens)

    def draft(self) -> list[int]:
        """The block's K drafts (target ids of positions anchor + 1 .. anchor + K)."""
        return self.drafter.draft(self.context, self.anchor, self.anchor_position)


class GreedyBlock(GreedyTree):
    """Greedy DFlash rounds: one block of K drafts per round, verified and accepted as a chain of K."""

    forwards = 1  # the whole block is one drafter forward

    def __init__(self, K: int):
        super().__init__(TreeShape.chain(K))

    def start(self, runner, drafter: DFlashDrafter) -> BlockContext:
        return BlockContext(drafter)

    def draft(self, state: BlockContext) -> Tree:
        return Tree.chain(state.draft())


def speculative_dflash(runner, drafter: DFlashDrafter, prompt: list[int], max_new: int, eos: int,
                       stats: Stats) -> list[int]:
    """Greedy speculative decoding with DFlash blocks; returns the generated ids."""
    return decode(runner, drafter, prompt, max_new, eos, GreedyBlock(drafter.config.speculative_tokens), stats)
