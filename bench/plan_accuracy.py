"""How far plan's time table lands from what the stages then measure: one JSON line.

    python bench/plan_accuracy.py                            # a small real run of the demo recipe, CPU
    SPECDRAFT_CPU_BF16=0 python bench/plan_accuracy.py       # float32, as on a CPU without AVX512-BF16
    python bench/plan_accuracy.py --run /tmp/demo-f32         # a run already made (specdraft demo)

Runs gen -> render -> extract -> train -> export -> eval on the bundled SmolLM2 with the demo recipe
shrunk by --set items (default: 24 samples, 48-token answers, 2 epochs, 4 eval prompts of 32 tokens),
recording the plan before the first stage as the demo does (calibrated on this machine) and after each
stage. Per stage: the seconds the last plan before it said, the seconds it took, their ratio. The
bar is every ratio within 0.75..1.25. The CPU, the dtype and the load average are in the line:
a shared machine's other jobs move both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import environment  # noqa: E402
from specdraft.billing import make_plan, record  # noqa: E402
from specdraft.cli import main  # noqa: E402
from specdraft.run import PIPELINE, RunFolder, open_run  # noqa: E402
from specdraft.stages.status import collect  # noqa: E402

SMALL = ["data.num_train=24", "gen.max_new_tokens=48", "train.epochs=2", "eval.num_prompts=4", "eval.max_new_tokens=32"]


def small_run(path: Path, sets: list[str]) -> None:
    recipe, folder = open_run(None, str(path), sets)
    record(folder, make_plan(recipe, folder, calibration="measure"))  # gen's plan, before gen runs
    for stage in PIPELINE:
        if main([stage.name, "--run", str(path)]) != 0:
            raise SystemExit(f"plan_accuracy: {stage.name} failed")


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help="a finished run to read instead of making a small one")
    parser.add_argument("--set", action="append", default=None, help="recipe overrides (default: a small run)")
    parser.add_argument("--out", default="bench/results/plan_accuracy-cpu.jsonl")
    args = parser.parse_args()
    t0 = time.time()
    path = Path(args.run) if args.run else Path(tempfile.mkdtemp(prefix="plan-accuracy-")) / "run"
    if not args.run:
        small_run(path, args.set if args.set is not None else SMALL)
    folder = RunFolder(path)
    manifest = folder.manifest()
    rows = collect(folder)["planned_vs_measured"]
    calibration = (manifest.get("plan") or {}).get("calibration") or {}
    line = {
        "bench": "plan_accuracy",
        "date": time.strftime("%Y-%m-%d"),
        "hardware": environment.hardware_line(),
        "dtype": calibration.get("dtype"),
        "cpu_bf16_env": os.environ.get("SPECDRAFT_CPU_BF16"),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "run": str(path),
        "recipe": {
            k: manifest["recipe"][s][k]
            for s, k in (("data", "num_train"), ("gen", "max_new_tokens"), ("train", "epochs"), ("eval", "num_prompts"))
        },
        "calibration_seconds": calibration.get("seconds"),
        "stages": {
            r["stage"]: {"planned_s": r["planned_seconds"], "measured_s": r["measured_seconds"], "ratio": r["ratio"]}
            for r in rows
        },
        "within_25_percent": all(r["ratio"] is not None and 0.75 <= r["ratio"] <= 1.25 for r in rows),
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(line))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main_bench()
