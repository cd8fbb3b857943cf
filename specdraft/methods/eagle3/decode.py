"""EAGLE-3's decode state for the reference decoder (decoding/rounds.py's one round loop), on each
engine: DrafterState on the eager one (its step-0 key/value cache grown by concatenation), and
StaticDrafterState on preallocated buffers whose calls are CUDA graphs on the GPU. Its rounds are
rounds.GreedyTree (EAGLE-2 trees; a chain is the tree of top-k 1) and rounds.SampledChain.
"""

from __future__ import annotations

import torch

from specdraft.decoding.rounds import GreedyTree, SampledChain, Stats, decode
from specdraft.decoding.static import StepGraphs
from specdraft.decoding.tree import TreeShape, grow_tree
from specdraft.drafters.common import Step0Cache
from specdraft.methods.contract import DecodeStates


class DrafterState(Step0Cache):
    """The drafter's own cache of step-0 keys (one per target position) and its root for the next round."""

    @torch.inference_mode()
    def step(self, hidden, tokens: torch.Tensor, depth: int, diag: list):
        """One drafting step for sibling nodes at `depth`: each of `tokens` [1, F] reads its parent's output
        state `hidden` [1, F, H] and sees the whole step-0 cache plus its ancestors' keys (`diag`) and its own."""
        positions = torch.full(tokens.shape, self.root_position + depth, device=hidden.device)  # [1, F]
        return self.drafter(hidden, tokens, positions, base=self.cache, diag=diag, q_offset=self.cache[0].shape[2] - 1)

    def draft(self, shape: TreeShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every node of this round's dynamic tree (grow_tree)."""
        return grow_tree(self.drafter, self.step, self.root_hidden, self.root_logits, shape)


class StaticDrafterState:
    """DrafterState's interface (advance, step, draft, root_*) on a preallocated step-0 key/value cache,
    its calls of fixed shape: advance padded to `max_accepted` rows after the prefill, one graph for a
    whole tree drafting per tree shape, one per depth for the sampled chain's single steps."""

    def __init__(self, drafter, capacity: int, graphs: StepGraphs):
        cfg = drafter.config
        dtype, device = drafter.fc.weight.dtype, drafter.fc.weight.device
        self.drafter, self.capacity, self.graphs = drafter, capacity, graphs
        shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [1, kv heads, C, d]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.root_hidden = self.root_logits = None
        self.root_position = -1
        self.max_accepted = 1

    def reset(self, max_accepted: int):
        """A new sequence whose rounds accept at most `max_accepted` tokens (the advance's padded rows)."""
        self.root_hidden = self.root_logits = None
        self.root_position = -1
        self.max_accepted = max_accepted

    @torch.inference_mode()
    def advance(self, aux: torch.Tensor, next_tokens: list[int], first_position: int):
        """As DrafterState.advance. After the prefill the call is padded to `max_accepted` rows: the
        padded rows come last, no real row sees them, and the slots they write are rewritten by the next
        advance before anything reads them."""
        m, dev = len(next_tokens), self.keys.device
        if first_position == 0:  # the prefill: its length differs per prompt, so it is never captured
            logits, h = self._advance(aux, torch.tensor([next_tokens], device=dev), torch.tensor(0, device=dev))
        else:
            rows = max(m, self.max_accepted)
            if first_position + rows > self.capacity:
                raise RuntimeError(f"drafter cache of {self.capacity} slots is full: reserve() more before decoding")
            padded = aux.new_zeros((rows, aux.shape[1]))  # [rows, n_aux*Ht]
            padded[:m] = aux
            logits, h = self.graphs(
                ("advance", rows),
                self._advance,
                padded,
                torch.tensor([next_tokens + [0] * (rows - m)]),
                torch.tensor(first_position),
            )
        self.root_hidden, self.root_logits = h[m - 1][None, None], logits[m - 1]  # [1, 1, H], [Vd]
        self.root_position = first_position + m - 1

    def _advance(self, aux, tokens, first):
        """aux [W, n_aux*Ht], tokens [1, W], first [] -> logits [W, Vd], h [W, H]; writes W slots."""
        d, W = self.drafter, tokens.shape[1]
        slots = first + torch.arange(W, device=tokens.device)  # [W]
        # Row j sees the cache before `first` and the new rows 0..j.
        mask = torch.cat(
            [
                (torch.arange(self.capacity, device=tokens.device) < first)[None].expand(W, -1),
                torch.ones(W, W, dtype=torch.bool, device=tokens.device).tril(),
            ],
            dim=1,
        )  # [W, C+W]
        logits, h, (k, v) = d(
            d.project(aux.to(self.keys.dtype))[None], tokens, slots[None], base=(self.keys, self.values), mask=mask
        )
        self.keys.index_copy_(2, slots, k)
        self.values.index_copy_(2, slots, v)
        return logits[0], h[0]

    @torch.inference_mode()
    def step(self, hidden, tokens: torch.Tensor, depth: int, diag: list):
        """As DrafterState.step (sampled chains draft step by step); the outputs are a graph's: read or
        copy them before the next step of the same depth."""
        flat = [t for kv in diag for t in kv]
        return self.graphs(
            ("step", depth, tokens.shape[1]),
            lambda *xs: self._step(depth, *xs),
            hidden,
            tokens,
            torch.tensor(self.root_position),
            *flat,
        )

    @torch.inference_mode()
    def draft(self, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As DrafterState.draft: the whole tree's drafting steps and selections in one graph."""

        def grow(hidden, logits, root):
            def step(h, tokens, depth, diag):
                return self._step(depth, h, tokens, root, *(t for kv in diag for t in kv))

            return grow_tree(self.drafter, step, hidden, logits, shape)

        return self.graphs(
            ("draft", shape.topk, shape.depth),
            grow,
            self.root_hidden,
            self.root_logits,
            torch.tensor(self.root_position),
        )

    def _step(self, depth, hidden, tokens, root, *flat):
        """hidden [1, F, H], tokens [1, F], root [] (the root's position), flat = the ancestors' keys
        and values, each [1, kv heads, F, d] -> logits [1, F, Vd], h [1, F, H], this step's (k, v)."""
        positions = (root + depth).expand(1, tokens.shape[1])  # [1, F]: siblings share a depth
        mask = (torch.arange(self.capacity, device=tokens.device) <= root)[None]  # [1, C]: the whole cache
        diag = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
        return self.drafter(hidden, tokens, positions, base=(self.keys, self.values), diag=diag, mask=mask)


STATES = DecodeStates(DrafterState, StaticDrafterState)


def speculative(
    runner, drafter, prompt: list[int], max_new: int, eos: int, shape: TreeShape, stats: Stats
) -> list[int]:
    """Greedy speculative decoding with tree (or chain) drafts; returns the generated ids."""
    return decode(runner, drafter, prompt, max_new, eos, GreedyTree(shape, STATES), stats)


def speculative_sampled(
    runner,
    drafter,
    prompt: list[int],
    max_new: int,
    eos: int,
    K: int,
    temperature: float,
    stats: Stats,
    generator: torch.Generator,
) -> list[int]:
    """Sampled speculative decoding with chains of K drafted tokens; the output is distributed as the
    target's own sampling at `temperature`."""
    return decode(runner, drafter, prompt, max_new, eos, SampledChain(K, temperature, generator, STATES), stats)
