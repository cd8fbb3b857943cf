"""Measure a served engine: acceptance from its Prometheus `/metrics` counters.

vLLM exports `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total{position="i"}`; the figures
of a run are the deltas of these counters between two scrapes.
"""

from __future__ import annotations

import re

PREFIX = "vllm:spec_decode_"
_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$')


def spec_decode_counters(metrics_text: str) -> dict:
    """{"drafts", "draft_tokens", "accepted", "accepted_per_pos": [..]} summed over label sets."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "accepted_per_pos": {}}
    names = {f"{PREFIX}num_drafts_total": "drafts", f"{PREFIX}num_draft_tokens_total": "draft_tokens",
             f"{PREFIX}num_accepted_tokens_total": "accepted"}
    for line in metrics_text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        name, labels, value = m["name"], m["labels"] or "", float(m["value"])
        if name in names:
            out[names[name]] += value
        elif name == f"{PREFIX}num_accepted_tokens_per_pos_total":
            pos = int(re.search(r'position="(\d+)"', labels)[1])
            out["accepted_per_pos"][pos] = out["accepted_per_pos"].get(pos, 0.0) + value
    out["accepted_per_pos"] = [out["accepted_per_pos"][k] for k in sorted(out["accepted_per_pos"])]
    return out


def acceptance(before: dict, after: dict) -> dict:
    """Mean acceptance length (1 + accepted per draft, vLLM's definition) and per-position rates."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0.0)
               for i, a in enumerate(after["accepted_per_pos"])]
    return {
        "drafts": drafts,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [p / drafts for p in per_pos] if drafts else [],
    }
