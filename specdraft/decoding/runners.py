"""The target as the reference decoder runs it: one forward per round over the tokens fed to it,
returning logits and the aux states the drafter reads, with a KV cache that keeps only the accepted path.

Engines (make_runner): the eager one here (transformers' DynamicCache and masks), and static.py's
preallocated KV caches with CUDA graphs on the GPU. Greedy and speculative decoding of one evaluation
always share one engine, so their speed ratio is fair.
"""

from __future__ import annotations

import torch

from specdraft.config import EvalConfig, field_choices
from specdraft.decoding.static import StaticTargetRunner
from specdraft.targets import Target, cache_argument, get_attr, tap_hidden_states

ENGINES = field_choices(EvalConfig, "engine")


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

    def drafter_state(self, drafter, states, max_accepted: int):
        """The drafter's decode state for one decode, as its method makes it on this engine
        (`states`: the method's contract.DecodeStates): a fresh one on the eager engine."""
        state = states.eager(drafter)
        state.reset(max_accepted)
        return state

    def reset(self):
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(
        self, ids: list[int] | torch.Tensor, positions: list[int] | None = None, visible: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n, V] and aux states [n, n_aux*H] for `ids` (a list, or a tensor [n] on the device:
        drafts the host has not read) appended to the cache. `visible` [n, n]
        says which of the new tokens each new token sees; None (a chain, or plain decoding) is causal and
        goes the model's own way, which also knows sliding windows and attention sinks (gpt-oss) that a
        custom 4-D mask bypasses. `positions` go with `visible`."""
        x = ids[None] if isinstance(ids, torch.Tensor) else torch.tensor([ids], device=self.device)
        kwargs = {}
        if visible is not None:
            past = self.length
            allowed = torch.cat(
                [torch.ones(len(ids), past, dtype=torch.bool, device=self.device), visible.to(self.device)], dim=1
            )  # [n, past+n]
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
        if extra == list(range(length, length + len(extra))):  # a chain's path: already in place, so cut
            for layer in self.cache.layers:  # the rest off instead of copying the whole cache every round
                layer.keys = layer.keys[..., : length + len(extra), :]
                layer.values = layer.values[..., : length + len(extra), :]
            return
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
