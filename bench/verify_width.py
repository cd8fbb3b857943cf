"""What verifying K + 1 positions costs the target, against one autoregressive step, on each engine.

    python bench/verify_width.py [--target smollm2] [--widths 1 2 4 8 16] [--engine static cuda-graphs]
                                 [--context 300] [--calls 50] [--profile FILE]

Leviathan's bound takes a verification to cost one target step whatever K; a block drafter that drafts
15 positions verifies 16. For each engine and width this feeds the target `width` tokens after a
`context`-token prefill, `calls` times (the cache rewound each time, so every call sees the same
length), and prints one JSON line: milliseconds per call and per width-1 call. --profile writes the
static engine's (no graphs) heaviest operators per width to FILE, to say which grow with the width.
"""

from __future__ import annotations

import argparse
import json
import time

from specdraft import environment
from specdraft.decoding import runners
from specdraft.decoding.runners import sync
from specdraft.targets import Target, resolve_device


def per_call(runner, width: int, context: int, calls: int) -> float:
    """Seconds per forward of `width` tokens at cache length `context` (after 3 untimed calls)."""
    ids = list(range(100, 100 + width))
    for i in range(calls + 3):
        if i == 3:
            sync(runner.device)
            t0 = time.perf_counter()
        runner.keep(context, [])  # rewind: the same length every call
        runner.forward(ids)
    sync(runner.device)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--engine", nargs="+", default=["static", "cuda-graphs"], choices=runners.ENGINES)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--profile", default=None)
    args = ap.parse_args()
    device = resolve_device("auto")
    target = Target(args.target)
    model = target.load_model(args.dtype, device=device)
    for engine in args.engine:
        runner = runners.make_runner(target, model, engine)
        runner.reserve(args.context + max(args.widths) + 16)
        runner.reset()
        runner.forward(list(range(200, 200 + args.context)))
        ms = {w: 1000 * per_call(runner, w, args.context, args.calls) for w in args.widths}
        print(
            json.dumps(
                {
                    "bench": "verify_width",
                    "engine": runner.engine,
                    "dtype": args.dtype,
                    "context": args.context,
                    "ms": {w: round(v, 3) for w, v in ms.items()},
                    "target_steps": {w: round(v / ms[args.widths[0]], 3) for w, v in ms.items()},
                    "device": device,
                    "hardware": environment.hardware_line(),
                }
            ),
            flush=True,
        )
        if args.profile and engine == "static":
            from torch.profiler import ProfilerActivity, profile

            with open(args.profile, "w") as f:
                for w in (args.widths[0], args.widths[-1]):
                    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
                    with profile(activities=acts) as prof:
                        per_call(runner, w, args.context, 10)
                    key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
                    f.write(f"== width {w}, 13 calls\n{prof.key_averages().table(sort_by=key, row_limit=25)}\n")


if __name__ == "__main__":
    main()
