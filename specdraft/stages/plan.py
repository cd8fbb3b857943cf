"""plan: print a recipe's or a run's bill (disk, parameters, memory, time) from the target's config
alone, checked against this machine or the one named; a run's plan is kept in its manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.billing import human_bytes, human_seconds, make_plan, record
from specdraft.config import apply_sets, load_recipe
from specdraft.run import PIPELINE, RunFolder


def render_text(plan: dict) -> str:
    t, h, d, tok = plan["target"], plan["hidden"], plan["drafter"], plan["tokens"]
    moe = t["moe"]
    lines = [
        f"plan for {plan['recipe']}: target {t['text_model_type']} ({t['config']})",
        (
            f"  {t['num_layers']} layers, hidden {t['hidden_size']}, vocab {t['vocab_size']:,}, "
            f"{t['parameters']['total'] / 1e9:,.2f} B parameters ({t['parameters']['active'] / 1e9:,.2f} B active)"
            + (f", {moe['routed_experts']} routed experts top-{moe['top_k']}" if moe else "")
        ),
        f"  aux layer ids {plan['aux_layer_ids']} ({plan['aux_layer_ids_source']})",
        "",
        (
            f"hidden states: {h['states_per_token']} states x {t['hidden_size']} in {h['store_dtype']} = "
            f"{h['bytes_per_token']:,} bytes/token (+{h['record_bytes_per_token']} for ids and mask)"
        ),
        f"  tokens: {tok['tokens']:,} = {tok['samples']:,} samples x {tok['tokens_per_sample']:,.0f} ({tok['source']})",
        f"  disk: {human_bytes(h['disk_bytes_if_disk'])}"
        + (f" (not written: train.hidden = {h['mode']})" if h["mode"] in ("online", "served") else ""),
        *_served_lines(plan.get("served")),
        "",
        (
            f"drafter ({d['method']}): {d['trainable'] / 1e6:,.1f} M trainable, {d['frozen'] / 1e6:,.1f} M frozen, "
            f"{d['total'] / 1e6:,.1f} M total"
        ),
    ]
    for part, n in d["parts"].items():
        lines.append(f"  {part:18s} trainable {n['trainable'] / 1e6:10,.1f} M   frozen {n['frozen'] / 1e6:10,.1f} M")
    mem = plan["train_memory"]["per_gpu"]
    lines += [
        "",
        f"training memory per {plan['train_memory']['device']}: {human_bytes(mem['total'])}"
        + (f" (FSDP over {plan['machine']['gpus']} GPUs)" if plan["train_memory"].get("fsdp") else ""),
    ]
    for k in ("weights", "grads", "optimizer", "activations", "target"):
        lines.append(f"  {k:12s} {human_bytes(mem[k])}")
    lines += ["", "time:"]
    for r in plan["time"]:
        lines.append(
            f"  {r['phase']:8s} {human_seconds(r['seconds']):>10s}   {r['work']:,} {r['unit']}"
            + (f" at {r['rate_per_s']:,.1f}/s" if r["rate_per_s"] else "")
            + f"  [{r['source']}]"
        )
    lines.append(f"  total    {human_seconds(plan['total_seconds']):>10s}")
    lines += ["", f"machine: {plan['machine']['hardware']}"]
    for c in plan["checks"]:
        # ok None: not checked (the memory of GPUs named by --gpus alone is unknown)
        lines.append(f"  {({True: 'OK  ', False: 'FAIL', None: 'SKIP'})[c['ok']]} {c['check']}: {c['text']}")
    if plan["recommendations"]:
        lines += ["", "recommended:"]
        lines += [f"  {r['do']}: {r['why']}" for r in plan["recommendations"]]
    return "\n".join(lines)


def _served_lines(sv: dict | None) -> list[str]:
    """The served source's bill: scratch, host memory, passes, and the GPU topology where GPUs are known."""
    if not sv:
        return []
    lines = [
        f"  served: scratch {human_bytes(sv['scratch_cap_bytes'])} on disk (train.served_scratch_bytes; one "
        f"sample's states {human_bytes(sv['sample_file_bytes'])}: "
        + ("fits" if sv["scratch_ok"] else "DOES NOT FIT, raise the cap")
        + f", {sv['in_flight_at_cap']} in flight), "
        f"{human_bytes(sv['host_memory_bytes'])} of the trainer's host memory, {sv['passes']:g} passes of the "
        f"server (cache: {sv['cache']})"
    ]
    if sv.get("topology"):
        lines.append(f"  topology: {sv['topology']['text']}")
    return lines


def run_plan(
    spec: str,
    *,
    overrides: list[str],
    json_out: bool,
    target: str | None,
    tokens_per_sample: int | None,
    gpus: int | None,
    gpu_memory_gib: float | None,
    calibration: str = "measure",
) -> int:
    """`specdraft plan <recipe or run>`: print the plan; a run's plan is also kept in its manifest.
    `calibration` as billing.make_plan's: "measure" times a few steps on this CPU where it has none cached."""

    folder = RunFolder(Path(spec)) if (Path(spec) / "manifest.json").exists() else None
    recipe = folder.recipe() if folder is not None else load_recipe(spec)
    apply_sets(recipe, overrides)
    plan = make_plan(
        recipe,
        folder,
        target=target,
        tokens_per_sample=tokens_per_sample,
        gpus=gpus,
        gpu_memory_gib=gpu_memory_gib,
        calibration=calibration,
    )
    if folder is not None:
        record(folder, plan)
    print(json.dumps(plan, indent=2) if json_out else render_text(plan))
    if not json_out:
        where = f"--run {folder.path}" if folder is not None else f"--recipe {spec}"
        where += "".join(f" --set {item}" for item in overrides)
        first = next(
            (s.name for s in PIPELINE if folder is None or (folder.stage(s.name) or {}).get("state") != "done"), None
        )
        print(f"\nnext: specdraft {first} {where}" if first else f"\nnext: specdraft status {folder.path}")
    return 0
