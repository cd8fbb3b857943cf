"""DFlash rounds in the reference decoder's one round loop (rounds.decode): a round drafts a whole block
in one drafter forward, and the target verifies it in one forward as it verifies an EAGLE-3 chain.

The block context (BlockContext on the eager engine, StaticBlockContext on preallocated buffers, below)
is the drafter's state across rounds: its context is the keys and values every drafter layer makes of
the target's aux states, one per accepted position, appended as rounds accept them (vLLM writes the
same into its drafter KV cache), and the next round's anchor. A round whose last token x_n (the anchor: produced by the
target, not yet fed to it) sits at position n drafts positions n + 1 .. n + K from the context of the
positions < n and the block [x_n, mask, ..., mask]; the target is then fed x_n and the K drafts at
positions n .. n + K, and GreedyBlock keeps the longest drafted prefix the target itself picks, plus the
target's own next token (the next round's anchor). Greedy output is the target's own, whatever the
drafts; K = block_size - 1.
"""

from __future__ import annotations

import torch

from specdraft.decoding.clock import host_read
from specdraft.decoding.rounds import GreedyTree, Stats, decode
from specdraft.decoding.static import StepGraphs
from specdraft.decoding.tree import Tree, TreeShape
from specdraft.methods.contract import DecodeStates
from specdraft.methods.dflash.drafter import DFlashDrafter


class BlockContext:
    """A DFlash drafter's state on the eager engine: its context (every drafter layer's keys and values of
    the positions the target has verified, one per position: what vLLM writes into the drafter's KV
    cache), grown by concatenation each round, and the next round's anchor."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.kv = None  # per layer (keys, values) [1, kv heads, T, d]
        self.anchor, self.anchor_position = -1, -1

    def reset(self, max_accepted: int):
        """A fresh context per decode: nothing to reset."""

    @torch.inference_mode()
    def advance(self, aux: torch.Tensor, next_tokens: list[int], first_position: int):
        """Newly accepted positions first_position, ... with the target's aux states aux [m, n_aux*Ht];
        next_tokens[i] is the token after position first_position + i, so the last one is the next
        round's anchor, at the position after them."""
        d = self.drafter
        positions = torch.arange(first_position, first_position + aux.shape[0], device=aux.device)[None]  # [1, m]
        new = d.context(aux.to(d.fc.weight.dtype)[None], positions)
        self.kv = (
            new
            if self.kv is None
            else [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.kv, new)]
        )
        self.anchor, self.anchor_position = next_tokens[-1], first_position + len(next_tokens)

    def draft(self) -> list[int]:
        """The block's K drafts: target ids of positions anchor + 1 .. anchor + K."""
        return self.draft_ids().tolist()

    def draft_ids(self) -> torch.Tensor:
        """As draft, left on the device: [K]."""
        return self.drafter.draft_ids(self.kv, self.anchor, self.anchor_position)


class StaticBlockContext:
    """BlockContext's interface (advance, draft) for a DFlash drafter on preallocated buffers: every
    layer's context keys and values at the cache's capacity, a position's slot its position. After the
    prefill both calls have fixed shapes: advance padded to block_size rows (a round accepts at most
    block_size - 1 drafts and the target's own token), and the block drafted against the whole capacity
    under a mask of the positions before the anchor, so each is one CUDA graph when graphs are on."""

    def __init__(self, drafter, capacity: int, graphs: StepGraphs):
        cfg = drafter.config
        dtype, device = drafter.fc.weight.dtype, drafter.fc.weight.device
        self.drafter, self.capacity, self.graphs = drafter, capacity, graphs
        shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.kv = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]  # per layer (keys, values) [1, kv heads, C, d]
        self.anchor, self.anchor_position = -1, -1

    def reset(self, max_accepted: int):
        """A new sequence: its prefill overwrites the context from slot 0 (the block needs no padding
        beyond block_size rows)."""
        self.anchor, self.anchor_position = -1, -1

    @torch.inference_mode()
    def advance(self, aux: torch.Tensor, next_tokens: list[int], first_position: int):
        """As BlockContext.advance. The padded rows write slots past the next anchor, which the next
        draft does not see and the next advance overwrites."""
        m, rows, dev = aux.shape[0], self.drafter.config.block_size, aux.device
        self.anchor, self.anchor_position = next_tokens[-1], first_position + len(next_tokens)
        if first_position == 0:  # the prefill: its length differs per prompt, so it is never captured
            self._advance(aux, torch.tensor(0, device=dev))
            return
        if first_position + rows > self.capacity:
            raise RuntimeError(f"drafter cache of {self.capacity} slots is full: reserve() more before decoding")
        padded = aux.new_zeros((rows, aux.shape[1]))  # [rows, n_aux*Ht]
        padded[:m] = aux
        self.graphs(("block-advance", rows), self._advance, padded, torch.tensor(first_position))

    def _advance(self, aux, first):
        """aux [W, n_aux*Ht], first [] -> writes every layer's keys and values at slots first .. first + W - 1."""
        d = self.drafter
        slots = first + torch.arange(aux.shape[0], device=aux.device)  # [W]
        for (keys, values), (k, v) in zip(self.kv, d.context(aux.to(d.fc.weight.dtype)[None], slots[None])):
            keys.index_copy_(2, slots, k)
            values.index_copy_(2, slots, v)
        return slots

    def draft(self) -> list[int]:
        """As BlockContext.draft."""
        return self.draft_ids().tolist()

    @torch.inference_mode()
    def draft_ids(self) -> torch.Tensor:
        """As BlockContext.draft_ids: the block-draft graph's own output [K], valid until its next call."""
        return self.graphs(
            ("block-draft",), self._draft, torch.tensor([[self.anchor]]), torch.tensor(self.anchor_position)
        )

    def _draft(self, token, position):
        """token [1, 1], position [] -> the drafted target ids [block_size - 1]."""
        d = self.drafter
        bs = d.config.block_size
        ids = d.block_inputs(token)  # [1, bs]: the anchor, then the mask token
        positions = (position + torch.arange(bs, device=token.device))[None]  # [1, bs]
        visible = (torch.arange(self.capacity, device=token.device) < position)[None, None].expand(
            1, bs, -1
        )  # [1, bs, C]
        logits = d(ids, positions, self.kv, visible)  # [1, bs, Vd]
        return d.to_target_ids(logits[0, 1:].argmax(-1))


STATES = DecodeStates(BlockContext, StaticBlockContext)


class GreedyBlock(GreedyTree):
    """Greedy DFlash rounds: one block of K drafts per round, verified and accepted as a chain of K. The
    block stays on the device: the target is fed the drafted ids where the drafter left them, and the host
    reads the drafts and the target's picks together after verification, one wait for the device per
    round where reading the drafts first made two (and sent them back to the device)."""

    forwards = 1  # the whole block is one drafter forward

    def __init__(self, K: int):
        super().__init__(TreeShape.chain(K), STATES)

    def draft(self, state) -> torch.Tensor:
        return state.draft_ids()  # [K] target ids, on the device

    def verify(
        self, runner, root: int, draft: torch.Tensor, n: int
    ) -> tuple[tuple[list[int], list[int]], torch.Tensor]:
        logits, aux = runner.forward(torch.cat([torch.tensor([root], device=draft.device), draft]))
        read = torch.cat([draft, logits.argmax(-1)])  # the drafts, then the target's token after each fed row
        with host_read():
            read = read.tolist()
        K = draft.shape[0]
        return (read[:K], read[K:]), aux

    def accept(self, draft: torch.Tensor, verdict: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
        tokens, choice = verdict
        return super().accept(Tree.chain(tokens), choice)


def speculative_dflash(
    runner, drafter: DFlashDrafter, prompt: list[int], max_new: int, eos: int, stats: Stats
) -> list[int]:
    """Greedy speculative decoding with DFlash blocks; returns the generated ids."""
    return decode(runner, drafter, prompt, max_new, eos, GreedyBlock(drafter.config.speculative_tokens), stats)
