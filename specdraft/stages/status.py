"""status: STATUS.md, the state of a run for a person picking it up cold, from the run's own records.

Goal, machine, the target as its config describes it, every figure measured, each stage done /
in progress / not started with its counts, what is known to be wrong, the files, the exact next
command and the time left by the plan. It states what the manifest holds (and, for a stage cut off
before it could record itself, what its own progress files on disk hold: conversations.jsonl,
hidden/index.json, checkpoints/latest) and nothing else: each figure carries the manifest path it
came from, and the Markdown is rendered from that JSON alone.

Written by `specdraft status <run>` and after every stage.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from specdraft.billing import human_bytes, human_seconds, make_plan, record
from specdraft.files import size_of
from specdraft.methods import DEFAULT, METHODS
from specdraft.run import PIPELINE, STAGES, RunFolder, write_text

STAGE_ORDER = [s.name for s in PIPELINE]
# The plan's time table names phases; render and export are too quick to plan.
PHASE_OF_STAGE = {"gen": "gen", "extract": "extract", "train": "train", "eval": "eval"}
ICONS = {"done": "✅", "in progress": "🔄", "not started": "⏳", "failed": "❌", "not needed": "➖"}
# Units of the figures stages record (by metric name; other names get one from their suffix).
UNITS = {
    "tokens_per_s": "tok/s",
    "autoregressive_tokens_per_s": "tok/s",
    "speculative_tokens_per_s": "tok/s",
    "bytes_per_token": "bytes/token",
    "tau": "tokens/round (mean accepted + 1)",
    "per_position_acceptance": "fraction accepted, per draft position",
    "speedup": "x (speculative / plain tok/s)",
    "draft_to_target_cost": "ratio (draft step / target step time)",
    "vocab_coverage": "fraction of answer tokens",
    "final_step_accuracy": "fraction, per TTT step",
    "mfu": "fraction of peak FLOPs",
}
SUFFIX_UNITS = {"_per_s": "/s", "_bytes": "bytes", "_seconds": "s", "_rate": "fraction", "_fraction": "fraction"}


def _unit(name: str) -> str:
    if name in UNITS:
        return UNITS[name]
    return next((u for suffix, u in SUFFIX_UNITS.items() if name.endswith(suffix)), "")


def _where(entry: dict) -> str:
    env = entry.get("environment") or {}
    if env.get("gpus"):
        hw = f"{len(env['gpus'])}x {env['gpus'][0]['name']}"
    else:
        hw = f"{env.get('cpu', '?')} ({env.get('cpu_count', '?')} cores), CPU only"
    return f"{hw} on {env.get('host', '?')}, {entry.get('finished', '?')}"


# --- the status ----------------------------------------------------------------------------------


def _stages(folder: RunFolder, manifest: dict, recipe: dict) -> list[dict]:
    rows = []
    for stage in STAGE_ORDER:
        entry = manifest.get("stages", {}).get(stage)
        row = {"stage": stage, "source": f"stages.{stage}"}
        if entry and entry["state"] == "done":
            row.update(
                state="done",
                counts=entry.get("counts") or {},
                seconds=entry.get("seconds"),
                finished=entry.get("finished"),
            )
            if entry.get("attempt"):
                # A later run that did not succeed, recorded beside the good one, which stays in use.
                attempt = entry["attempt"]
                row["attempt"] = {
                    k: attempt[k]
                    for k in ("state", "finished", "error", "recipe_not_recorded")
                    if attempt.get(k) is not None
                }
                row["attempt"]["source"] = f"stages.{stage}.attempt"
        else:
            progress = STAGES[stage].progress(folder, recipe) if STAGES[stage].progress else None
            if entry and entry.get("counts"):
                row["counts"] = entry["counts"]
            if entry and entry["state"] == "failed":
                row["error"] = entry.get("error")
            if entry and entry["state"] == "partial":
                row["state"] = "in progress"
            elif progress and (progress.get("fraction", 1) != 0):
                # Cut off (killed, interrupted, failed) with work on disk that a rerun resumes from.
                row["state"] = "in progress"
            elif entry and entry["state"] == "failed":
                row["state"] = "failed"
            elif stage == "extract" and (recipe.get("train") or {}).get("hidden") in ("online", "served"):
                row["state"] = "not needed"  # the trainer gets its states from the target itself
            else:
                row["state"] = "not started"
            if progress:
                row["progress"] = progress
        row["icon"] = ICONS[row["state"]]
        rows.append(row)
    return rows


def _measured(manifest: dict) -> list[dict]:
    rows = []
    for stage in STAGE_ORDER:
        entry = manifest.get("stages", {}).get(stage)
        if not entry:
            continue
        metrics = dict(entry.get("metrics") or {})
        # The served source's figures (requests, retries, restarts, its rate, the scratch used), one row each.
        for name, value in (metrics.pop("served", None) or {}).items():
            metrics[f"served.{name}"] = value
        for name, value in metrics.items():
            if value is None:
                continue
            rows.append(
                {
                    "stage": stage,
                    "name": name,
                    "value": value,
                    "unit": _unit(name),
                    "where": _where(entry),
                    "source": f"stages.{stage}.metrics.{name}",
                }
            )
        if entry.get("seconds") is not None:
            rows.append(
                {
                    "stage": stage,
                    "name": "wall time",
                    "value": entry["seconds"],
                    "unit": "s",
                    "where": _where(entry),
                    "source": f"stages.{stage}.seconds",
                }
            )
    return rows


def _environment(manifest: dict) -> dict | None:
    recorded = [
        (e.get("finished", ""), s, e["environment"])
        for s, e in manifest.get("stages", {}).items()
        if e.get("environment")
    ]
    if not recorded:
        return None
    _, stage, env = max(recorded, key=lambda r: r[0])
    hosts: dict[str, list[str]] = {}
    for _, s, e in sorted(recorded, key=lambda r: STAGE_ORDER.index(r[1]) if r[1] in STAGE_ORDER else 99):
        hosts.setdefault(e.get("host", "?"), []).append(s)
    disk = env.get("disk") or {}
    sizes = {
        "ram": env.get("ram_bytes"),
        "gpu_memory": (env.get("gpus") or [{}])[0].get("memory_bytes"),
        "disk_free": disk.get("free_bytes"),
        "disk_total": disk.get("total_bytes"),
    }
    return {
        "source": f"stages.{stage}.environment",
        "env": env,
        "hosts": hosts,
        "sizes": {k: human_bytes(v) for k, v in sizes.items() if v is not None},
    }


# Counts a stage records that say something went wrong, whichever stage records them: what to say.
PROBLEM_COUNTS = {
    "empty_reasoning": "answers came back with empty reasoning",
    "failed": "conversations failed after all retries",
    "skipped_too_long": "prompts skipped, longer than data.max_prompt_tokens",
    "skipped_no_answer": "conversations had no answer tokens",
    "ties": "eval prompts diverged from plain greedy at a numerical near-tie",
}


def _problems(manifest: dict, stages: list[dict]) -> list[dict]:
    out = []
    for row in stages:
        if row.get("error"):
            out.append({"text": f"{row['stage']} failed: {row['error']}", "source": f"stages.{row['stage']}.error"})
        if row.get("attempt"):
            out.append({"text": f"{row['stage']}: {_attempt_text(row['attempt'])}", "source": row["attempt"]["source"]})
    for stage, entry in manifest.get("stages", {}).items():
        for key in ("problems", "warnings"):
            for item in entry.get(key) or []:
                out.append({"text": f"{stage}: {item}", "source": f"stages.{stage}.{key}"})
        c = entry.get("counts") or {}
        for key, what in PROBLEM_COUNTS.items():
            if isinstance(c.get(key), int) and c[key] > 0:
                out.append({"text": f"{stage}: {c[key]} {what}", "source": f"stages.{stage}.counts.{key}"})
        if c.get("generated") and c.get("finished_with_eos") is not None and c["finished_with_eos"] < c["generated"]:
            capped = c["generated"] - c["finished_with_eos"]
            out.append(
                {
                    "text": f"{stage}: {capped} of {c['generated']} answers stopped at gen.max_new_tokens, "
                    f"not at EOS (cut off)",
                    "source": f"stages.{stage}.counts.generated - finished_with_eos",
                }
            )
    for check in (manifest.get("plan") or {}).get("checks", []):
        if not check["ok"]:
            out.append({"text": f"plan: {check['check']} does not fit: {check['text']}", "source": "plan.checks"})
    return out


def _next_command(folder: RunFolder, manifest: dict, stages: list[dict]) -> dict:
    for row in stages:
        if row["state"] not in ("done", "not needed"):
            cmd = f"specdraft {row['stage']} --run {folder.path}"
            why = {"in progress": "resumes from what is on disk", "failed": "reruns the failed stage"}.get(
                row["state"], "the next stage"
            )
            return {"command": cmd, "why": why}
    export = manifest["stages"]["export"]
    serve = export.get("serve_commands") or {"vllm": export.get("serve_command")}
    drafter = next(iter((export.get("folders") or {"vllm": {"path": "export/vllm"}}).values()))["path"]
    return {
        "command": f"specdraft doctor {folder.path / drafter}",
        "why": "every stage is done: check the exported drafter, then serve it",
        "serve": serve,
    }


def _remaining(manifest: dict, stages: list[dict]) -> dict | None:
    plan = manifest.get("plan")
    if not plan:
        return None
    state = {row["stage"]: row for row in stages}
    rows, total = [], 0.0
    for trow in plan["time"]:
        stage = next((s for s, p in PHASE_OF_STAGE.items() if p == trow["phase"]), None)
        row = state.get(stage)
        if row is None or row["state"] in ("done", "not needed"):
            continue
        # An unknown share done (gen of every conversation) bills the whole phase.
        done = ((row.get("progress") or {}).get("fraction") or 0.0) if row["state"] == "in progress" else 0.0
        left = trow["seconds"] * (1 - done)
        total += left
        rows.append(
            {
                "phase": trow["phase"],
                "planned_seconds": trow["seconds"],
                "done_fraction": round(done, 4),
                "seconds_left": round(left, 1),
                "text": human_seconds(left),
                "basis": trow["source"],
            }
        )
    return {
        "seconds": round(total, 1),
        "text": human_seconds(total),
        "rows": rows,
        "computed": plan.get("computed"),
        "source": "plan.time x the share not yet done",
    }


def _planned_vs_measured(manifest: dict) -> list[dict]:
    """Per planned stage: the last plan's seconds made before it ran (manifest `planned`) against the
    seconds it took, and their ratio (measured / planned: above 1, the plan was short)."""
    rows = []
    for stage, phase in PHASE_OF_STAGE.items():
        planned = (manifest.get("planned") or {}).get(phase)
        entry = manifest.get("stages", {}).get(stage) or {}
        measured = entry.get("seconds") if entry.get("state") == "done" else None
        if planned is None and measured is None:
            continue
        ratio = measured / planned["seconds"] if planned and measured is not None and planned["seconds"] else None
        rows.append(
            {
                "stage": stage,
                "planned_seconds": planned["seconds"] if planned else None,
                "measured_seconds": measured,
                "ratio": round(ratio, 3) if ratio is not None else None,
                "basis": planned["source"] if planned else None,
                "source": f"planned.{phase}.seconds, stages.{stage}.seconds",
            }
        )
    return rows


def collect(folder: RunFolder) -> dict:
    """The status as JSON: every figure with the manifest path it came from."""
    manifest = folder.manifest()
    if "recipe" not in manifest:
        raise FileNotFoundError(
            f"{folder.manifest_path}: no manifest; run a stage first (specdraft gen --run {folder.path})"
        )
    recipe = manifest["recipe"]
    stages = _stages(folder, manifest, recipe)
    sizes = {
        p: size_of(p) or 0 for p in sorted(folder.path.iterdir()) if not p.name.startswith(".") and p != folder.status
    }
    files = [
        {"path": p.name + ("/" if p.is_dir() else ""), "bytes": n, "text": human_bytes(n)} for p, n in sizes.items()
    ]
    plan = manifest.get("plan") or {}
    return {
        "run": str(folder.path),
        "name": manifest.get("name"),
        "created": manifest.get("created"),
        "goal": _goal(recipe),
        "environment": _environment(manifest),
        "target": {"source": "plan.target", **plan["target"]} if plan.get("target") else None,
        "aux_layer_ids": plan.get("aux_layer_ids")
        or (manifest.get("stages", {}).get("extract") or {}).get("aux_layer_ids"),
        "stages": stages,
        "measured": _measured(manifest),
        "problems": _problems(manifest, stages),
        "files": files,
        "next": _next_command(folder, manifest, stages),
        "remaining": _remaining(manifest, stages),
        "planned_vs_measured": _planned_vs_measured(manifest),
    }


def _goal(recipe: dict) -> dict:
    t, d, g, tr, ex, ev = (recipe[k] for k in ("target", "data", "gen", "train", "export", "eval"))
    hidden = {"online": "on the fly (online)", "served": "streamed from a vLLM server (served, none stored)"}.get(
        tr.get("hidden"), "extracted to disk"
    )
    answers = (
        "with the source's own answers"
        if g.get("answers") == "source"
        else f"whose answers the target writes itself (up to {g['max_new_tokens']} tokens each)"
    )
    vocab = f"a {tr['draft_vocab_size']}-token draft vocabulary" if tr["draft_vocab_size"] else "the whole vocabulary"
    drafter, k = METHODS.get(tr.get("method"), METHODS[DEFAULT]).goal(tr, ex, ev, vocab)
    text = (
        f"{recipe.get('description') or 'A speculative-decoding drafter'}. Target: {t['model']}. Data: "
        f"{d['num_train'] or 'all train-split'} {d['source']} conversations {answers}, rendered with the "
        f"target's own chat template, hidden states {hidden}. Done means: a {drafter}, and measured by eval: "
        f"tau and per-position acceptance over {ev['num_prompts']} held-out prompts with K = {k} draft tokens."
    )
    return {"text": text, "source": "recipe"}


# --- Markdown ------------------------------------------------------------------------------------


def _fmt(v) -> str:
    if isinstance(v, list):
        return " / ".join(_fmt(x) for x in v)
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def _progress_text(p: dict) -> str:
    if "shards" in p:
        return (
            f"{p['shards']} of {p['shards_of']} shards, {p['samples']} of {p['samples_of']} samples, "
            f"{p['tokens']:,} of {p['tokens_of']:,} tokens (from {p['source']})"
        )
    if "records" in p:
        return f"{p['records']} of {p['of']} {p['unit']} (from {p['source']})"
    return f"checkpoint at step {p['latest_checkpoint_step']} (from {p['source']})"


def _attempt_text(a: dict) -> str:
    """A later run of a done stage that did not succeed, as STATUS.md says it."""
    what = {
        "failed": f"a later run failed ({a['finished']})" + (f": {a['error']}" if a.get("error") else ""),
        "partial": f"a later run is in progress or was cut off ({a['finished']}); the same command resumes it",
    }
    text = what.get(a["state"], f"a later run is {a['state']} ({a['finished']})")
    changes = a.get("recipe_not_recorded") or {}
    if changes:
        text += (
            "; its settings were not kept ("
            + ", ".join(f"{k} = {new!r}, the run keeps {old!r}" for k, (old, new) in changes.items())
            + ")"
        )
    return text + "; the last good run's record and files are kept and used"


def _md_stages(s: dict) -> list[str]:
    out = ["## Done / in progress / not started", "", "| | stage | state | counts | seconds |", "|---|---|---|---|---|"]
    for r in s["stages"]:
        counts = ", ".join(f"{k} {_fmt(v)}" for k, v in (r.get("counts") or {}).items())
        if r.get("progress") and r["state"] != "done":
            counts = _progress_text(r["progress"])
        if r.get("error"):
            counts = (counts + "; " if counts else "") + f"last error: {r['error']}"
        if r.get("attempt"):
            counts = (counts + "; " if counts else "") + _attempt_text(r["attempt"])
        seconds = _fmt(r["seconds"]) if r.get("seconds") is not None else ""
        out.append(f"| {r['icon']} | {r['stage']} | {r['state']} | {counts} | {seconds} |")
    nxt = s["next"]
    out += ["", f"**Next:** `{nxt['command']}` ({nxt['why']})"]
    out += [f"then serve with {engine}: `{cmd}`" for engine, cmd in (nxt.get("serve") or {}).items()]
    rem = s["remaining"]
    if rem:
        out += [
            "",
            f"**Remaining time (plan of {rem['computed']}):** {rem['text']}"
            + "".join(f"; {r['phase']} {r['text']}" for r in rem["rows"]),
        ]
    else:
        out += ["", f"**Remaining time:** no plan recorded; `specdraft plan {s['run']}` writes one."]
    return out


def _md_planned(s: dict) -> list[str]:
    out = ["## Planned against measured", ""]
    rows = s["planned_vs_measured"]
    if not rows:
        return out + ["- no plan recorded before a stage ran"]
    out += ["| stage | planned s | measured s | measured / planned | planned from |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [_fmt(r[k]) if r[k] is not None else "" for k in ("planned_seconds", "measured_seconds", "ratio")]
        out.append(f"| {r['stage']} | {' | '.join(cells)} | {r['basis'] or ''} |")
    return out


def _md_measured(s: dict) -> list[str]:
    out = ["## Known problems", ""]
    out += [f"- {p['text']}" for p in s["problems"]] or ["- none recorded"]
    out += ["", "## Measured", "", "| stage | figure | value | unit | where |", "|---|---|---|---|---|"]
    out += [f"| {m['stage']} | {m['name']} | {_fmt(m['value'])} | {m['unit']} | {m['where']} |" for m in s["measured"]]
    if not s["measured"]:
        out.append("| | nothing measured yet | | | |")
    return out


def _md_target(s: dict) -> list[str]:
    out = ["## Target as discovered", ""]
    t = s["target"]
    if not t:
        out.append("- not described yet: `specdraft plan` records the target's config in the manifest")
        return out + [f"- aux layer ids: {s['aux_layer_ids']}"]
    moe, mla, q = t.get("moe"), t.get("mla"), t.get("quantization")
    return out + [
        (
            f"- architecture: {', '.join(t.get('architectures') or [])} (model_type {t['model_type']}, "
            f"language model {t['text_model_type']}); config `{t['config']}`"
        ),
        (
            f"- layers {t['num_layers']}, hidden {t['hidden_size']}, intermediate {t['intermediate_size']}, heads "
            f"{t['num_attention_heads']} (KV {t['num_key_value_heads']}, head dim {t['head_dim']}), vocab "
            f"{t['vocab_size']:,}, tied embeddings {t['tie_word_embeddings']}"
        ),
        f"- parameters {t['parameters']['total']:,} ({t['parameters']['active']:,} active per token)",
        "- MoE: "
        + (
            f"{moe['routed_experts']} routed experts, {moe['shared_experts']} shared, top-{moe['top_k']}, "
            f"expert intermediate {moe['expert_intermediate_size']}"
            if moe
            else "none (dense)"
        ),
        "- MLA: " + (", ".join(f"{k} {v}" for k, v in mla.items()) if mla else "none"),
        f"- MTP layers: {t['mtp_layers'] or 'none'}",
        "- quantization: " + (f"{q['kind']} ({q['method']})" if q else "none"),
        f"- chat template sha256 {t['chat_template_sha256']}; thinking markers: "
        + (", ".join(f"{a} ... {b}" for a, b in t["thinking_markers"]) or "none in the template"),
        f"- aux layer ids: {s['aux_layer_ids']}",
    ]


def _md_environment(s: dict) -> list[str]:
    out = ["## Environment", ""]
    e = s["environment"]
    if not e:
        return out + ["- no stage recorded yet"]
    env = e["env"]
    gpus, topo, engines = env.get("gpus") or [], env.get("gpu_topology") or {}, env.get("engines") or {}
    links = f", linked by {topo['links']} ({', '.join(topo['link_kinds'])})" if topo.get("links") else ""
    out += [
        f"- host {env.get('host')} ({env.get('platform')}); recorded by {e['source']}",
        f"- CPU {env.get('cpu')}, {env.get('cpu_count')} cores; RAM {e['sizes']['ram']}"
        if env.get("ram_bytes")
        else f"- CPU {env.get('cpu')}",
        "- GPUs: " + (f"{len(gpus)}x {gpus[0]['name']}, {e['sizes']['gpu_memory']} each{links}" if gpus else "none"),
    ]
    if env.get("numa_nodes"):
        out.append(
            "- NUMA: "
            + "; ".join(f"{n} CPUs {c}" for n, c in env["numa_nodes"].items())
            + (
                "; GPU NUMA affinity " + ", ".join(f"{g} node {n}" for g, n in topo["numa_affinity"].items())
                if topo.get("numa_affinity")
                else ""
            )
        )
    if env.get("disk"):
        d = env["disk"]
        out.append(f"- disk at {d['path']}: {e['sizes']['disk_free']} free of {e['sizes']['disk_total']}")
    v = env.get("versions") or {}
    out.append(
        f"- Python {env.get('python')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"CUDA {env.get('cuda') or 'none'}, driver {env.get('driver') or 'none'}"
        + "".join(", " + (f"{k} {x['version']} ({x['where']})" if x else f"{k} not found") for k, x in engines.items())
    )
    if len(e["hosts"]) > 1:
        out.append(
            "- stages ran on more than one host: " + "; ".join(f"{h}: {', '.join(st)}" for h, st in e["hosts"].items())
        )
    return out


def render_markdown(s: dict) -> str:
    out = [f"# STATUS: {s['name']}", "", f"Run folder `{s['run']}`, created {s['created']}.", ""]
    out += ["## Goal", "", s["goal"]["text"], ""]
    for section in (_md_stages, _md_planned, _md_measured, _md_target, _md_environment):
        out += section(s) + [""]
    out += ["## Files", "", "| path | size |", "|---|---|"]
    out += [f"| {f['path']} | {f['text']} |" for f in s["files"]]
    return "\n".join(out) + "\n"


def write(folder: RunFolder) -> dict:
    status = collect(folder)
    write_text(folder.status, render_markdown(status))
    return status


def after_stage(stage: str, recipe, folder: RunFolder) -> None:
    """After every stage: refresh the run's plan with what a finished stage measured, then rewrite
    STATUS.md (a failed stage's too: it says what failed and what to run). A failure here is reported
    and never fails (or hides the error of) the stage itself."""

    try:
        entry = folder.stage(stage) or {}
        if entry.get("state") == "done" and "attempt" not in entry:  # this run succeeded
            record(folder, make_plan(recipe, folder, calibration="cached"))
        write(folder)
    except Exception as e:  # noqa: BLE001 - the stage's own result matters more than its summary
        print(f"specdraft: warning: {folder.status} not updated: {type(e).__name__}: {e}", file=sys.stderr)


def run_status(path: str, json_out: bool = False) -> int:
    folder = RunFolder(Path(path))
    status = write(folder)
    if json_out:
        print(json.dumps(status, indent=2))
    else:
        print((folder.status).read_text())
        print(f"next: {status['next']['command']}")
    return 0
