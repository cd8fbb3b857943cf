"""export: the drafter folders the engines load (export/vllm, export/sglang), every field written
explicitly, and the command that serves each. An EAGLE-3 drafter: vLLM's speculators format and the
flat SGLang one, with (after eval) the number of speculative tokens of the best expected speedup from
the measured acceptance. A DFlash drafter: vLLM's `method: dflash` folder (drafters/dflash_format.py),
served with num_speculative_tokens = block_size - 1, the block it was trained on.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import torch

from specdraft.drafters.checkpoint import load_trained
from specdraft.drafters.dflash_format import serve_spec, write_dflash
from specdraft.drafters.formats import FLAT_ARCHITECTURE, write_sglang, write_vllm
from specdraft.files import FileError, read_json
from specdraft.run import staged_folders


def provenance(run_name: str) -> dict:
    return {"run": run_name, "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def serve_command(target_path: str, drafter_dir: Path, speculative_tokens: int) -> str:
    spec = json.dumps({"method": "eagle3", "model": str(Path(drafter_dir).resolve()),
                       "num_speculative_tokens": speculative_tokens})
    return f"vllm serve {target_path} --speculative-config '{spec}'"


def sglang_serve_command(target_path: str, drafter_dir: Path, speculative_tokens: int) -> str:
    """A chain of K drafted tokens: K steps of top-1, verified as K + 1 tokens."""
    k = speculative_tokens
    return (f"python -m sglang.launch_server --model-path {shlex.quote(str(target_path))} "
            f"--speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {shlex.quote(str(Path(drafter_dir).resolve()))} "
            f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1} "
            f"--dtype bfloat16")


FORMATS = ("vllm", "sglang")


def resolve_formats(requested: list[str]) -> list[str]:
    """The export formats asked for, in order, "both" meaning vllm and sglang."""
    out: list[str] = []
    for name in requested:
        names = list(FORMATS) if name == "both" else [name]
        for n in names:
            if n not in FORMATS:
                raise ValueError(f"export: unknown format {name!r}; known: {list(FORMATS) + ['both']}")
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError(f"export: no format given; known: {list(FORMATS) + ['both']}")
    return out


def expected_speedups(per_position: list[float], cost: float) -> dict[int, float]:
    """Expected speedup of a chain of K drafts, for each K the eval measured: tokens per target step
    1 + p_1 + ... + p_K (p_i: share of rounds whose draft i was accepted, which a chain of K shares
    with a longer one) over the cost of K drafting steps at `cost` target steps each plus one
    verification, taken as one target step (decoding is memory-bound on GPUs; on this CPU the
    4-token verification measured 1.4x a single step, so CPU figures are optimistic)."""
    return {k: (1 + sum(per_position[:k])) / (1 + k * cost) for k in range(1, len(per_position) + 1)}


def choose_speculative_tokens(folder, default: int) -> dict:
    """The number of speculative tokens to serve with: the K of the best expected speedup from the
    run's eval report when it measured this drafter (eval finished after train), else `default`."""
    report_path = folder.eval_report
    train, evaluated = folder.stage("train") or {}, folder.stage("eval") or {}
    if (evaluated.get("state") != "done" or not report_path.exists()
            or evaluated.get("finished", "") < train.get("finished", "")):
        return {"value": default, "source": "recipe (export.speculative_tokens); run eval, then export again, "
                                            "to choose it from measured acceptance"}
    fix = "rerun `specdraft eval` to write it again"
    report = read_json(report_path, fix=fix)
    acceptance, cost = report.get("per_position_acceptance"), report.get("draft_to_target_cost")
    if not (isinstance(acceptance, list) and acceptance and all(isinstance(a, (int, float)) for a in acceptance)
            and isinstance(cost, (int, float))):
        raise FileError(f"{report_path}: no per_position_acceptance list and draft_to_target_cost; {fix}")
    speedups = expected_speedups(acceptance, cost)
    best = max(speedups, key=speedups.get)
    return {"value": best, "source": "eval/report.json", "expected_speedup": {k: round(v, 3) for k, v in speedups.items()},
            "per_position_acceptance": report["per_position_acceptance"], "draft_to_target_cost": report["draft_to_target_cost"],
            "measured_up_to": len(speedups)}


def run(recipe, folder) -> dict:
    """The trained drafter's folders, by its method (WRITERS)."""
    t_start = time.time()
    formats = resolve_formats(recipe.export.formats)
    drafter, target, embed = load_trained(recipe, folder)
    return WRITERS[drafter.METHOD](recipe, folder, formats, drafter, target, embed, t_start)


def export_dflash(recipe, folder, formats: list[str], drafter, target, embed, t_start: float) -> dict:
    """vLLM's DFlash folder and its serve command; refused before anything is written where vLLM would
    not load it or would serve it as another network (dflash_format.problems)."""
    if formats != ["vllm"]:
        raise ValueError(f"export: a DFlash drafter has vLLM's folder format only, not {formats}; "
                         "use --formats vllm")
    out = folder.export("vllm")
    with staged_folders(out) as (staged,):  # the last good folder stays until this one is whole
        write_dflash(drafter, staged, target_num_layers=target.num_layers, provenance=provenance(recipe.name))
    spec = serve_spec(out.resolve(), drafter.config)
    command = f"vllm serve {target.path} --speculative-config '{json.dumps(spec)}'"
    print(f"export: vLLM DFlash drafter in {out} (block of {drafter.config.block_size}, mask token "
          f"{drafter.config.mask_token_id})\n  serve it with:\n  {command}\n\nnext: specdraft doctor {out}")
    k = {"value": spec["num_speculative_tokens"], "source": "block_size - 1 (the block the drafter was trained on)"}
    return folder.record("export", state="done", config=recipe.export, counts={"formats": 1},
                         seconds=time.time() - t_start,
                         extra={"method": "dflash", "serve_command": command, "serve_commands": {"vllm": command},
                                "folders": {"vllm": {"path": str(out.relative_to(folder.path)),
                                                     "format": "DFlash (DFlashDraftModel)"}},
                                "embed_included": False, "speculative_tokens": k})


def export_eagle3(recipe, folder, formats: list[str], drafter, target, embed, t_start: float) -> dict:
    """The speculators and flat folders, with the K of the best expected speedup once eval measured it."""
    cfg = recipe.export
    k = choose_speculative_tokens(folder, cfg.speculative_tokens)
    speculative_tokens = k["value"]
    if "expected_speedup" in k:
        table = ", ".join(f"K={n}: {v:.2f}x" for n, v in k["expected_speedup"].items())
        print(f"export: {speculative_tokens} speculative tokens, the best expected speedup from the eval report "
              f"({table}; draft/target cost {k['draft_to_target_cost']})")
    else:
        print(f"export: {speculative_tokens} speculative tokens from the {k['source']}")
    # The embedding is frozen at the target's during training, so the engine's shared copy is identical.
    include_embed = not torch.equal(drafter.embed_tokens.weight.detach(), embed.float())
    written, commands = {}, {}
    # Every format's folder written under a temporary name, all swapped in at the end: a format refused
    # or failing midway leaves the last good export's folders as they were.
    with staged_folders(*(folder.export(fmt) for fmt in formats)) as staged:
        for fmt, tmp in zip(formats, staged):
            out = folder.export(fmt)
            if fmt == "vllm":
                write_vllm(drafter, tmp, verifier=str(target.path),
                           verifier_architectures=list(target.config.architectures or []),
                           speculative_tokens=speculative_tokens, include_embed=include_embed,
                           provenance=provenance(recipe.name))
                written[fmt] = {"path": str(out.relative_to(folder.path)), "format": "speculators (Eagle3Speculator)"}
                commands[fmt] = serve_command(str(target.path), out, speculative_tokens)
            else:
                write_sglang(drafter, tmp, include_embed=include_embed, provenance=provenance(recipe.name))
                written[fmt] = {"path": str(out.relative_to(folder.path)), "format": f"flat ({FLAT_ARCHITECTURE})"}
                commands[fmt] = sglang_serve_command(str(target.path), out, speculative_tokens)
    engines = {"vllm": "vLLM", "sglang": "SGLang"}
    for fmt in formats:
        print(f"export: {engines[fmt]} drafter in {folder.export(fmt)}\n  serve it with:\n  {commands[fmt]}")
    print(f"\nnext: specdraft doctor {folder.export(formats[0])}")
    return folder.record("export", state="done", config=cfg, counts={"formats": len(written)},
                      seconds=time.time() - t_start,
                      extra={"method": "eagle3", "folders": written, "serve_command": commands[formats[0]],
                             "serve_commands": commands, "embed_included": include_embed,
                             "speculative_tokens": k})


WRITERS = {"eagle3": export_eagle3, "dflash": export_dflash}
