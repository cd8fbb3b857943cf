"""The static decode engine: preallocated KV caches for the target and the drafter, and on CUDA
every fixed-shape decode step captured once as a CUDA graph and replayed after.

Why: at batch 1 a small target is bound by Python and kernel launches, not by the GPU (bench/RESULTS.md: eager
HF decoding ran at 12 tok/s on an H200, 265 tok/s with a static cache, compiled), so a speedup measured
on the eager engine measures launch overhead more than the algorithm. The autoregressive baseline and
speculative decoding both run here, with the same caches and the same graphs, so their ratio is fair.

Shapes: the prefill is eager (any length). After it, every target forward is a decode step of one of
a few widths: 1 token (autoregressive), K+1 (chain verification), tree tokens + 1 (tree verification).
The cache has a fixed capacity; attention reads all of it under a [n, capacity] mask that the step
builds on the device from the cache length and the tree's visibility, so one graph per width serves
every position. Keeping the accepted path is a gather and a scatter inside the same buffers. The
drafter's cache works the same way; its step-0 call over the accepted tokens is padded to the most
a round can accept, and a round's whole tree drafting (every depth and its top-k selections, no host
sync: tree.grow_tree) is one graph.

A graph is captured the first time its shape is met, with that call's real inputs: the warm-up calls
on a side stream write the same keys to the same slots as the replay that follows, so capturing lazily
changes no result. A failed capture is said on stderr and every later step runs the same code eagerly
on the static cache, so a GPU run still produces figures, with the engine it really used in the report.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from specdraft.targets import Target, cache_argument, get_attr, tap_hidden_states

# Eager calls on a side stream before a capture: the first call picks kernels and allocates library
# workspaces (cuBLAS), which must not happen inside the capture (PyTorch's CUDA graph notes use 3).
GRAPH_WARMUP_CALLS = 3
# Cache capacities are rounded up to this: memory-efficient SDPA wants the mask's last dimension aligned
# to 16 elements and otherwise copies a padded mask at every call.
CAPACITY_ALIGNMENT = 16


class CapturedCall:
    """`fn` captured as one CUDA graph for the shapes of `inputs`. Calling it copies new inputs into the
    graph's static input tensors and replays it; the outputs are the graph's own tensors, so a caller
    reads (or copies) them before the next call of the same shape."""

    def __init__(self, fn: Callable, inputs: tuple[torch.Tensor, ...], device: torch.device):
        self.inputs = tuple(x.to(device, copy=True) for x in inputs)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP_CALLS):
                fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor):
        for static, x in zip(self.inputs, inputs):
            static.copy_(x, non_blocking=True)
        self.graph.replay()
        return self.outputs


class StepGraphs:
    """Fixed-shape calls by key: captured as a CUDA graph the first time a key is met and replayed after,
    or run eagerly where graphs are off (the CPU) or a capture failed."""

    def __init__(self, device: torch.device, enabled: bool):
        self.device, self.enabled = device, enabled
        self.calls: dict = {}
        self.failure = ""

    def __call__(self, key, fn: Callable, *inputs: torch.Tensor):
        if self.enabled:
            call = self.calls.get(key)
            if call is None:
                try:
                    call = self.calls[key] = CapturedCall(fn, inputs, self.device)
                except Exception as e:  # noqa: BLE001 - any capture failure falls back; the warm-up ran the
                    # same calls eagerly, so a bug in the step itself is raised again by the eager call below
                    self.enabled = False
                    self.failure = f"capture of {key} failed: {(str(e).splitlines() or [type(e).__name__])[0]}"
                    print(
                        f"engine: CUDA graph capture of {key} failed: {type(e).__name__}: {e}\nengine: every "
                        "step now runs eagerly on the static cache (the report says so)",
                        file=sys.stderr,
                        flush=True,
                    )
            if call is not None:
                return call(*inputs)
        return fn(*(x.to(self.device, non_blocking=True) for x in inputs))

    def clear(self):
        self.calls.clear()


class StaticKV:
    """A KV cache of fixed capacity, used by transformers through `update` like its own caches: layer l
    writes its new keys at `slots` and attends over all `capacity` positions, the 4-D mask hiding the
    unused ones. All layers live in one tensor, so keeping a tree path is one gather and one scatter."""

    def __init__(self, layers: int, capacity: int):
        self.layers, self.capacity = layers, capacity
        self.keys: torch.Tensor | None = None  # [L, B, kv heads, capacity, key width]
        self.values: torch.Tensor | None = None  # [L, B, kv heads, capacity, value width]
        self.slots: torch.Tensor | None = None  # [n] cache slots of the tokens being fed
        self.length = 0

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.keys is None:  # the first forward (an eager prefill) sizes the buffers: head counts and
            # widths differ by architecture (MLA keys are wider than its values)
            self.keys = keys.new_zeros((self.layers, *keys.shape[:2], self.capacity, keys.shape[-1]))
            self.values = values.new_zeros((self.layers, *values.shape[:2], self.capacity, values.shape[-1]))
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.slots, keys)
        v.index_copy_(2, self.slots, values)
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


class StaticTargetRunner:
    """TargetRunner's interface (reset, length, forward, keep) on a StaticKV, with decode steps replayed
    as CUDA graphs when `graphs` is on."""

    def __init__(self, target: Target, model, graphs: bool):
        self.target, self.model = target, model
        self.base = get_attr(model, target.family.decoder)
        self.cache_name = cache_argument(self.base)
        self.layers = len(get_attr(model, target.family.layers))
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.graphs = StepGraphs(self.device, graphs)
        self.cache = StaticKV(self.layers, 0)
        self._drafter_state = None  # the last decode's drafter state, reused while the drafter is the same

    @property
    def engine(self) -> str:
        if self.graphs.enabled:
            return "cuda-graphs"
        return f"static ({self.graphs.failure})" if self.graphs.failure else "static"

    def reserve(self, tokens: int):
        """Make room for `tokens` cache slots. Growing reallocates the buffers and drops the captured
        graphs (they hold the old addresses), so callers reserve once for all their prompts."""
        if tokens > self.cache.capacity:
            self.cache = StaticKV(self.layers, -(-tokens // CAPACITY_ALIGNMENT) * CAPACITY_ALIGNMENT)
            self.graphs.clear()
            self._drafter_state = None

    def reset(self):
        self.cache.length = 0  # stale keys stay in the buffers, hidden by the mask and overwritten

    @property
    def length(self) -> int:
        return self.cache.length

    def drafter_state(self, drafter, states, max_accepted: int):
        """The drafter's decode state as its method makes it on preallocated buffers (`states`: the
        method's contract.DecodeStates), kept while the drafter and its method stay the same."""
        kept = self._drafter_state
        if kept is None or kept[0] is not states or kept[1].drafter is not drafter:
            self.graphs.clear()  # the drafter's graphs hold the old state's buffers
            self._drafter_state = kept = (states, states.static(drafter, self.cache.capacity, self.graphs))
        kept[1].reset(max_accepted)
        return kept[1]

    @torch.inference_mode()
    def forward(
        self, ids: list[int] | torch.Tensor, positions: list[int] | None = None, visible: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As TargetRunner.forward; None means causal at the next positions. The returned tensors are
        the graph's outputs on the graph path: read them before the next forward of the same width."""
        n, start = len(ids), self.cache.length
        if start + n > self.cache.capacity:
            raise RuntimeError(
                f"static KV cache of {self.cache.capacity} slots is full ({start} + {n}): "
                "reserve() more before decoding"
            )
        if positions is None:
            positions = list(range(start, start + n))
        if visible is None:
            visible = torch.ones(n, n, dtype=torch.bool).tril()
        ids = ids[None] if isinstance(ids, torch.Tensor) else torch.tensor([ids])  # a device tensor stays there
        inputs = (ids, torch.tensor([positions]), visible, torch.tensor(start))
        if start == 0:  # the prefill: its length differs per prompt, so it is never captured
            out = self._step(*(x.to(self.device) for x in inputs))
        else:
            out = self.graphs(("target", n), self._step, *inputs)
        self.cache.length += n
        return out

    def _step(self, ids, positions, visible, start):
        """ids, positions [1, n], visible [n, n] bool, start [] (the first new slot) -> logits [n, V],
        aux [n, n_aux*H]. Device tensors only and no host sync, so it can be captured."""
        n, capacity = ids.shape[1], self.cache.capacity
        self.cache.slots = start + torch.arange(n, device=self.device)  # [n]
        rel = torch.arange(capacity, device=self.device) - start  # [C] slot relative to the first new one
        # Every token sees the whole cache before it, and among the new tokens what `visible` says.
        seen = (rel < 0)[None] | ((rel < n)[None] & visible[:, rel.clamp(0, n - 1)])  # [n, C]
        mask = torch.zeros(seen.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~seen, torch.finfo(self.dtype).min)[None, None]  # [1, 1, n, C]
        with tap_hidden_states(self.model, self.target.family, self.target.aux_layer_ids) as cap:
            out = self.base(
                input_ids=ids,
                position_ids=positions,
                attention_mask=mask,
                use_cache=True,
                **{self.cache_name: self.cache},
            )
        logits = self.model.lm_head(out.last_hidden_state)[0].float()  # [n, V]
        aux = torch.cat([cap[k] for k in self.target.aux_layer_ids], dim=-1)[0]  # [n, n_aux*H]
        return logits, aux

    @torch.inference_mode()
    def keep(self, length: int, extra: list[int]):
        """Keep slots [0, length) followed by the slots `extra` (the accepted tree path), in place. A
        chain's path is already in place: nothing to copy (and no index tensors sent to the device)."""
        if extra and extra != list(range(length, length + len(extra))):
            src = torch.tensor(extra, device=self.device)
            dst = torch.arange(length, length + len(extra), device=self.device)
            for buf in (self.cache.keys, self.cache.values):  # [L, B, heads, C, d]; slots are dim 3
                buf.index_copy_(3, dst, buf.index_select(3, src))  # gathered first: src and dst may overlap
        self.cache.length = length + len(extra)
