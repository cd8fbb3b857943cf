"""The target as the reference decoder runs it: one forward per round over the tokens fed to it,
returning logits and the aux states the drafter reads, with a KV cache that keeps only the accepted path.

Engines (make_runner): the eager one here (transformers' DynamicCache and masks), and static.py's
preallocated KV caches with CUDA graphs on the GPU. Greedy and speculative decoding of one evaluation
always share one engine, so their speed ratio is fair.
"""

from __future__ import annotations

import torch

from specdraft.decoding.static import StaticTargetRunner
from specdraft.decoding.tree import TreeShape, grow_tree
from specdraft.targets import Target, cache_argument, get_attr, tap_hidden_states

ENGINES = ("auto", "eager", "static", "cuda-graphs")


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TargetRunner:
    """The target with a KV cache, returning logits and aux states for the tokens it is fed: the eager
    engine (transformers' DynamicCache and its own masks). static.StaticTargetRunner is the fast one."""

    engine = "eager"

    def __init__(self, target: Target, model):
        self.target, self.model = target, model
        self.base = get_attr(model, target.family.decoder)
        self.cache_name = cache_argument(self.base)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = None

    def reserve(self, tokens: int):
        """The dynamic cache grows as it goes: nothing to reserve."""

    def drafter_state(self, drafter, max_accepted: int) -> DrafterState:
        return DrafterState(drafter)

    def block_context(self, drafter) -> BlockContext:
        return BlockContext(drafter)

    def reset(self):
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, ids: list[int], positions: list[int] | None = None,
                visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n, V] and aux states [n, n_aux*H] for `ids` appended to the cache. `visible` [n, n]
        says which of the new tokens each new token sees; None (a chain, or plain decoding) is causal and
        goes the model's own way, which also knows sliding windows and attention sinks (gpt-oss) that a
        custom 4-D mask bypasses. `positions` go with `visible`."""
        x = torch.tensor([ids], device=self.device)
        kwargs = {}
        if visible is not None:
            past = self.length
            allowed = torch.cat([torch.ones(len(ids), past, dtype=torch.bool, device=self.device),
                                 visible.to(self.device)], dim=1)  # [n, past+n]
            # A 4-D additive mask is used as given by transformers (eager and sdpa alike).
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill(~allowed, torch.finfo(self.dtype).min)[None, None]  # [1, 1, n, past+n]
            kwargs = {"attention_mask": mask, "position_ids": torch.tensor([positions], device=self.device)}
        with tap_hidden_states(self.model, self.target.family, self.target.aux_layer_ids) as cap:
            out = self.base(input_ids=x, use_cache=True, **{self.cache_name: self.cache}, **kwargs)
        logits = self.model.lm_head(out.last_hidden_state)[0].float()
        aux = torch.cat([cap[k] for k in self.target.aux_layer_ids], dim=-1)[0]
        return logits, aux

    def keep(self, length: int, extra: list[int]):
        """Keep cache positions [0, length) followed by the positions `extra` (the accepted tree path)."""
        idx = torch.cat([torch.arange(length), torch.tensor(extra, dtype=torch.long)]).to(self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)


def make_runner(target: Target, model, engine: str):
    """The engine named by EvalConfig.engine: "eager", "static" (preallocated caches, eager kernels),
    "cuda-graphs" (static, with decode steps replayed as CUDA graphs), or "auto": cuda-graphs on CUDA,
    eager elsewhere (on the CPU there are no graphs and attending over the whole static capacity costs
    more than it saves). Sliding-window targets (gpt-oss) stay eager: their windows live in the model's
    own masks, which the static engine replaces with one full-attention mask."""

    if engine not in ENGINES:
        raise ValueError(f"eval.engine {engine!r}: expected one of {ENGINES}")
    on_cuda = next(model.parameters()).device.type == "cuda"
    sliding = "sliding" in target.family.attention
    if engine == "auto":
        engine = "cuda-graphs" if on_cuda and not sliding else "eager"
        if on_cuda and sliding:
            print(f"eval: {target.family.attention} attention: the eager engine (no static cache, no CUDA graphs)")
    if engine != "eager" and sliding:
        raise ValueError(f"eval.engine {engine!r}: {target.family.attention} attention needs the eager engine")
    if engine == "cuda-graphs" and not on_cuda:
        raise ValueError("eval.engine 'cuda-graphs' needs the model on a CUDA device")
    if engine == "eager":
        return TargetRunner(target, model)
    return StaticTargetRunner(target, model, graphs=engine == "cuda-graphs")


class DrafterState:
    """The drafter's own cache of step-0 keys (one per target position) and its root for the next round."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.cache = None
        self.root_hidden = self.root_logits = None
        self.root_position = -1

    @torch.inference_mode()
    def advance(self, aux: torch.Tensor, next_tokens: list[int], first_position: int):
        """Step 0 over newly accepted positions: position t reads (target aux h_t, token x_{t+1})."""
        d = self.drafter
        positions = torch.arange(first_position, first_position + len(next_tokens), device=aux.device)[None]
        tokens = torch.tensor([next_tokens], device=aux.device)
        logits, h, kv = d(d.project(aux.to(d.fc.weight.dtype))[None], tokens, positions, base=self.cache)
        self.cache = kv if self.cache is None else (torch.cat([self.cache[0], kv[0]], 2),
                                                    torch.cat([self.cache[1], kv[1]], 2))
        self.root_hidden, self.root_logits = h[:, -1:], logits[0, -1]  # [1, 1, H], [Vd]
        self.root_position = first_position + len(next_tokens) - 1

    @torch.inference_mode()
    def step(self, hidden, tokens: torch.Tensor, depth: int, diag: list):
        """One drafting step for sibling nodes at `depth`: each of `tokens` [1, F] reads its parent's output
        state `hidden` [1, F, H] and sees the whole step-0 cache plus its ancestors' keys (`diag`) and its own."""
        positions = torch.full(tokens.shape, self.root_position + depth, device=hidden.device)  # [1, F]
        return self.drafter(hidden, tokens, positions, base=self.cache, diag=diag, q_offset=self.cache[0].shape[2] - 1)

    def draft(self, shape: TreeShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every node of this round's dynamic tree (grow_tree)."""
        return grow_tree(self.drafter, self.step, self.root_hidden, self.root_logits, shape)


class BlockContext:
    """A DFlash drafter's state on the eager engine: its context (every drafter layer's keys and values of
    the positions the target has verified, one per position: what vLLM writes into the drafter's KV
    cache), grown by concatenation each round, and the next round's anchor."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.kv = None  # per layer (keys, values) [1, kv heads, T, d]
        self.anchor, self.anchor_position = -1, -1

    @torch.inference_mode()
    def advance(self, aux: torch.Tensor, next_tokens: list[int], first_position: int):
        """Newly accepted positions first_position, ... with the target's aux states aux [m, n_aux*Ht];
        next_tokens[i] is the token after position first_position + i, so the last one is the next
        round's anchor, at the position after them."""
        d = self.drafter
        positions = torch.arange(first_position, first_position + aux.shape[0], device=aux.device)[None]  # [1, m]
        new = d.context(aux.to(d.fc.weight.dtype)[None], positions)
        self.kv = new if self.kv is None else [(torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                                               for (k, v), (nk, nv) in zip(self.kv, new)]
        self.anchor, self.anchor_position = next_tokens[-1], first_position + len(next_tokens)

    def draft(self) -> list[int]:
        """The block's K drafts: target ids of positions anchor + 1 .. anchor + K."""
        return self.drafter.draft(self.kv, self.anchor, self.anchor_position)
