"""DFlash rounds in the reference decoder's one round loop (rounds.decode): a round drafts a whole block
in one drafter forward, and the target verifies it in one forward as it verifies an EAGLE-3 chain.

The runner's block context (runners.BlockContext, static.StaticBlockContext) is the drafter's state
across rounds: its context is the keys and values every drafter layer makes of the target's aux states,
one per accepted position, appended as rounds accept them (vLLM writes the same into its drafter KV
cache), and the next round's anchor. A round whose last token x_n (the anchor: produced by the
target, not yet fed to it) sits at position n drafts positions n + 1 .. n + K from the context of the
positions < n and the block [x_n, mask, ..., mask]; the target is then fed x_n and the K drafts at
positions n .. n + K, and GreedyBlock keeps the longest drafted prefix the target itself picks, plus the
target's own next token (the next round's anchor). Greedy output is the target's own, whatever the
drafts; K = block_size - 1.
"""

from __future__ import annotations

from specdraft.decoding.rounds import GreedyTree, Stats, decode
from specdraft.decoding.tree import Tree, TreeShape
from specdraft.drafters.dflash import DFlashDrafter


class GreedyBlock(GreedyTree):
    """Greedy DFlash rounds: one block of K drafts per round, verified and accepted as a chain of K."""

    forwards = 1  # the whole block is one drafter forward

    def __init__(self, K: int):
        super().__init__(TreeShape.chain(K))

    def start(self, runner, drafter: DFlashDrafter):
        """The runner's block context: runners.BlockContext on the eager engine, static.StaticBlockContext
        (preallocated, its calls CUDA graphs on the GPU) on the static one."""
        return runner.block_context(drafter)

    def draft(self, state) -> Tree:
        return Tree.chain(state.draft())


def speculative_dflash(runner, drafter: DFlashDrafter, prompt: list[int], max_new: int, eos: int,
                       stats: Stats) -> list[int]:
    """Greedy speculative decoding with DFlash blocks; returns the generated ids."""
    return decode(runner, drafter, prompt, max_new, eos, GreedyBlock(drafter.config.speculative_tokens), stats)
