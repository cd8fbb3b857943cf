"""The yardstick for stored hidden states: the target's own float32 forward, and how far its forward at
the stages' compute dtype already lies from it.

The stages compute in bfloat16 where the CPU has bf16 instructions (float32 elsewhere). In bf16,
SmolLM2's residual stream carries values near 1000, whose rounding step is 4-8: its final-norm output
lies about 2 % (relative L2) from the float32 forward's, and a batch of other widths rounds differently
again. A fixed tolerance is therefore either too tight on one CPU or too loose on the other; these
helpers state it as "no further from float32 than the target's own forward at that dtype, plus bf16
storage rounding", which a wrong layer (3-100x further) or a missing final norm still fails.
"""

from __future__ import annotations

import torch

from specdraft.targets import resolve_dtype

STORAGE = 0.005  # bf16 storage alone: measured 0.25 % on SmolLM2's states


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def forward(model, ids) -> list:
    """hidden_states[0..L] of one unbatched sequence; [-1] is the final-norm output."""
    with torch.inference_mode():
        out = model.model(input_ids=torch.as_tensor(ids).long()[None], output_hidden_states=True)
    return [h[0].float() for h in out.hidden_states]


class Reference:
    """The target's float32 states of `ids` and the tolerance for each stored tensor."""

    def __init__(self, target, ids, models: dict | None = None):
        models = models if models is not None else {}
        stage_dtype = resolve_dtype("auto", "cpu")  # what the stages computed in on this CPU
        for dtype in {"float32", stage_dtype}:
            if dtype not in models:
                models[dtype] = target.load_model(dtype)
        self.states = forward(models["float32"], ids)
        own = self.states if stage_dtype == "float32" else forward(models[stage_dtype], ids)
        self.noise = [rel(o, s) for o, s in zip(own, self.states)]

    def tolerance(self, k: int) -> float:
        """For aux id k (or -1, the final-norm output): 1.5x the target's own compute noise + storage."""
        return 1.5 * self.noise[k] + STORAGE

    def assert_layer(self, stored, k: int) -> None:
        """`stored` is the target's layer k: within tolerance, and 2x closer than either neighbour."""
        err = rel(stored, self.states[k])
        assert err < self.tolerance(k), (k, err, self.tolerance(k))
        for n in (k - 1, k + 1):
            if 0 <= n < len(self.states) - 1:
                assert err < rel(stored, self.states[n]) / 2, (k, n, err, rel(stored, self.states[n]))
