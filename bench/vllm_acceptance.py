"""Serve a run's exported drafter with the real vLLM (CPU build) and measure its acceptance on the
run's held-out eval prompts, next to the reference decoder's tau from eval/report.json.

    python bench/vllm_acceptance.py runs/demo --format vllm|sglang [--vllm-python PATH]

Prints one JSON line. vLLM serves in bf16; the reference decoder's figure is fp32 (docs/engine-facts.md: bf16
verification passes do not keep greedy text identical, so compare acceptance, not text).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import httpx

from specdraft import environment
from specdraft.engines import VLLM_PYTHON, VllmServer
from specdraft.run import RunFolder
from specdraft.stages.bench import acceptance, spec_decode_counters
from specdraft.stages.gen import select_prompts
from specdraft.targets import Target


def speedup_line(path: Path, prompts: int, max_tokens: int) -> dict:
    """The chain figures of the last bench/speedup.py line in `path` measured on as many prompts and
    tokens as this run serves (a results file keeps every run's line)."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    fits = [x for x in lines if x.get("prompts") == prompts and x.get("max_new_tokens") == max_tokens]
    if not fits:
        have = sorted({(x.get("prompts"), x.get("max_new_tokens")) for x in lines})
        raise SystemExit(
            f"{path}: no line measured on {prompts} prompts x {max_tokens} tokens "
            f"(it has {have}); pass --prompts and --max-tokens to match one"
        )
    way = next(k[len("tau_") :] for k in fits[-1] if k.startswith("tau_"))  # the first way it drafted (chain, ...)
    return {"tau": fits[-1][f"tau_{way}"], "per_position_acceptance": fits[-1][f"per_position_acceptance_{way}"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--format", default="vllm", choices=["vllm", "sglang"])
    ap.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    ap.add_argument("--log", default=None, help="where the server's log goes (default: a temp file)")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts (default eval.num_prompts)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens each (default eval.max_new_tokens)")
    ap.add_argument(
        "--reference",
        default=None,
        help="a bench/speedup.py JSON line measured on the same prompts, instead of eval/report.json",
    )
    args = ap.parse_args()
    run = RunFolder(Path(args.run))
    recipe = run.recipe()
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)
    prompts, _ = select_prompts(recipe, target, "eval", args.prompts or recipe.eval.num_prompts)
    max_tokens = args.max_tokens or recipe.eval.max_new_tokens
    drafter = run.export(args.format).resolve()
    export = run.stage("export") or {}
    if not (drafter / "config.json").is_file():
        raise SystemExit(
            f"vllm_acceptance: no {args.format} drafter in {drafter}: run `specdraft export --run {run.path}`"
        )
    # Read before serving, so a missing reference fails in a second rather than after the run.
    reference = (
        speedup_line(Path(args.reference), len(prompts), max_tokens)
        if args.reference
        else json.loads(run.eval_report.read_text())
    )
    # Served as export printed it, whatever the method (a DFlash block of block_size - 1, P-EAGLE's
    # parallel_drafting); the vLLM format's line (a run exported in both formats prints one per format).
    printed = (export.get("serve_commands") or {}).get("vllm") or export["serve_command"]
    spec = json.loads(printed.split("--speculative-config ", 1)[1].strip("'"))
    spec["model"] = str(drafter)
    K = spec["num_speculative_tokens"]
    log_path = Path(args.log or f"/tmp/vllm-acceptance-{os.getpid()}.log")
    with VllmServer(target.path, speculative=spec, log_path=log_path, python=Path(args.vllm_python)) as server:
        ready_s = server.ready_seconds
        before = spec_decode_counters(server.metrics_text())
        tokens, t1 = 0, time.time()
        for p in prompts:
            resp = httpx.post(
                f"{server.url}/v1/chat/completions",
                timeout=600,
                json={"model": str(target.path), "messages": p["messages"], "temperature": 0, "max_tokens": max_tokens},
            ).json()
            tokens += resp["usage"]["completion_tokens"]
        seconds = time.time() - t1
        after = spec_decode_counters(server.metrics_text())
    acc = acceptance(before, after)
    print(
        json.dumps(
            {
                "bench": "vllm_acceptance",
                "run": str(run.path),
                "format": args.format,
                "prompts": len(prompts),
                "max_tokens": max_tokens,
                "method": spec["method"],
                "num_speculative_tokens": K,
                "vllm_mean_acceptance_length": round(acc["mean_acceptance_length"], 4),
                "vllm_per_position_acceptance": [round(a, 4) for a in acc["per_position_acceptance"]],
                "vllm_drafts": acc["drafts"],
                "vllm_single_stream_tokens_per_s": round(tokens / seconds, 2),
                "reference_tau_fp32": reference["tau"],
                "reference_per_position_acceptance": reference["per_position_acceptance"],
                "server_ready_s": round(ready_s, 1),
                "vllm_dtype": server.dtype,
                "hardware": environment.hardware_line(),
            }
        )
    )


if __name__ == "__main__":
    main()
