"""bench/ablate.py's table: every factor of issue 10 has a variant, and the report bolds the best of each
factor against the base and says when rows are partial."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ablate():
    spec = importlib.util.spec_from_file_location("ablate", REPO / "bench" / "ablate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["ablate"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_variants_cover_the_issue_factors():
    variants = ablate().variants(3000)
    names = [v.name for v in variants]
    assert len(names) == len(set(names))
    factors = {v.factor for v in variants}
    for factor in ("draft vocab", "TTT steps", "data size", "answers", "EAGLE-3.1 norms", "loss", "hidden storage"):
        assert factor in factors, factor
    assert [v.name for v in variants if v.is_run] == ["data-all"]


def row(name, factor, tau3, state="done", step=100):
    return {"name": name, "factor": factor, "label": name, "state": state, "step": step, "tau_3": tau3,
            "tau_7": tau3 + 0.1, "cond_accept": [0.5, 0.5, 0.5], "acc0": 0.5, "train_acc0": 0.6, "samples": 3000,
            "steps": step, "train_seconds": 10.0, "trainable_params": 1e6}


def test_report_bolds_the_best_and_marks_partial_rows(tmp_path):
    lines = [row("base", "base", 2.0), row("ttt-3", "TTT steps", 2.2), row("ttt-1", "TTT steps", 1.7),
             row("kl", "loss", 1.9, state="partial", step=50),
             {"name": "lk", "factor": "loss", "label": "lk", "state": "not started"}]
    md = tmp_path / "ablations.md"
    ablate().report(lines, md, "test machine", 2)
    text = md.read_text()
    assert "| TTT steps | ttt-3 | **2.200** |" in text and "**1.700**" not in text
    # Below the base, the loss group's best is the base itself: nothing in it is bold.
    assert "| loss | kl (partial, step 50) | 1.900 |" in text and "-0.100" in text
    assert "| loss | lk | not trained (not started) |" in text
    assert "Partial: 2 of 5 variants" in text
    json.dumps(lines)  # the rows stay JSON lines
