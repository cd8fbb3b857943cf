"""The static engine's steps as the GPU would capture them, checked on the CPU: run eagerly under a torch
function mode and a dispatch mode that refuse every op reading tensor values on the host (.item(),
.tolist(), data-dependent shapes: a sync a CUDA graph capture cannot hold) and every tensor built from
Python data (a host-to-device copy inside the graph)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from specdraft.decoding.static import StepGraphs

# aten ops by name (or name.overload) that read values on the host, or make a tensor of host data.
REFUSED_OPS = {
    "aten.item",
    "aten._local_scalar_dense",
    "aten.is_nonzero",
    "aten.equal",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.lift_fresh",
    "aten.repeat_interleave.Tensor",
    "aten.repeat_interleave.self_Tensor",
}
# Tensor methods that read values without an aten op of their own.
REFUSED_METHODS = {"tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}


class NoHostOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)  # aten.op.overload
        boolean_index = name == "aten.index.Tensor" and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        )
        assert not boolean_index and name not in REFUSED_OPS and name.rsplit(".", 1)[0] not in REFUSED_OPS, (
            f"{name} in a CUDA graph step"
        )
        return func(*args, **(kwargs or {}))


class NoHostMethods(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        assert getattr(func, "__name__", "") not in REFUSED_METHODS, f"Tensor.{func.__name__} in a CUDA graph step"
        return func(*args, **(kwargs or {}))


class CheckedGraphs(StepGraphs):
    """Graphs off: each step runs eagerly, under both modes; `keys` lists the steps met."""

    def __init__(self, device):
        super().__init__(device, enabled=False)
        self.keys = []

    def __call__(self, key, fn, *inputs):
        self.keys.append(key)
        with NoHostMethods(), NoHostOps():
            return super().__call__(key, fn, *inputs)
