"""calibrate and plan's CPU time table: a few timed steps of the stages' real work on this machine (real
SmolLM2, shrunk shapes), cached; plan's rows say they used it; STATUS.md sets planned against measured;
the demo's sizing shrinks the recipe for a smaller budget. No wall-clock asserts: rates are only
checked to be positive and finite."""

from __future__ import annotations

import math

import pytest

from specdraft import calibrate as cal_mod
from specdraft.billing import make_plan, read_target, record, size_to_budget
from specdraft.calibrate import Calibration
from specdraft.config import load_recipe
from specdraft.run import RunFolder
from specdraft.stages.status import collect, render_markdown


@pytest.fixture
def small_shapes(monkeypatch):
    """The calibration's shapes shrunk: the test checks what it measures, not how well."""
    for name, value in {
        "FORWARD_TOKENS": 64,
        "FORWARD_ROW": 32,
        "PROMPT_TOKENS": 8,
        "DECODE_STEPS": 2,
        "TRAIN_TOKENS": 64,
        "TRAIN_STEPS": 1,
        "TOP_TOKENS": 64,
        "REPEATS": 1,
    }.items():
        monkeypatch.setattr(cal_mod, name, value)


def _recipe(tiny_recipe):
    recipe = load_recipe(str(tiny_recipe))
    recipe.gen.batch_size = 2
    return recipe


def _calibration(**rates) -> Calibration:
    fields = {
        "machine": "test CPU",
        "target": "smollm2",
        "dtype": "float32",
        "eval_dtype": "float32",
        "train_dtype": "float32",
        "forward_tokens_per_s": 200.0,
        "decode_step_s": 0.5,
        "decode_batch": 32,
        "eval_step_s": 0.05,
        "verify_step_s": {"4": 0.06, "16": 0.1},
        "train_tokens_per_s": 250.0,
        "top_tokens_per_s": 1000.0,
        "seconds": 1.0,
    }
    return Calibration(**{**fields, **rates})


def test_calibration_rates_are_positive_and_cached(tiny_recipe, target, small_shapes, tmp_path, monkeypatch):
    recipe = _recipe(tiny_recipe)
    cache = tmp_path / "calibration.json"
    first = cal_mod.calibrate(recipe, target, cache)
    rates = [
        first.forward_tokens_per_s,
        first.decode_step_s,
        first.eval_step_s,
        first.train_tokens_per_s,
        first.top_tokens_per_s,
        *first.verify_step_s.values(),
    ]
    assert all(r > 0 and math.isfinite(r) for r in rates)
    assert set(first.verify_step_s) == {str(recipe.eval.draft_tokens + 1), str(recipe.eval.tree_tokens)}
    assert first.decode_batch == 2

    def no_work(*_):
        raise AssertionError("measured again")

    monkeypatch.setattr(cal_mod, "measure", no_work)
    assert cal_mod.calibrate(recipe, target, cache) == first
    # Another shape of the work is another calibration.
    recipe.train.ttt_steps += 1
    assert cal_mod.cached(recipe, target, cache) is None


def test_plan_uses_the_cached_calibration(tiny_recipe, target, tmp_path):
    recipe = _recipe(tiny_recipe)
    run = RunFolder(tmp_path / "run")
    run.init(recipe)
    cal = _calibration()
    run.calibration.write_text(__import__("json").dumps({cal_mod.key(recipe, target): cal.to_dict()}))
    plan = make_plan(recipe, run, calibration="cached")
    rows = {r["phase"]: r for r in plan["time"]}
    assert all(rows[p]["source"].startswith("calibrated: test CPU") for p in ("gen", "extract", "train", "eval"))
    assert plan["calibration"]["forward_tokens_per_s"] == 200.0
    # train bills the top-token pass before its steps; eval its three decodes of every prompt.
    assert "top tokens" in rows["train"]["source"]
    # Prefills of the source's real prompts through the chat template, not data.max_prompt_tokens each.
    prompt = float(rows["gen"]["source"].split("prefills of ")[1].split(" tokens")[0])
    assert 0 < prompt < recipe.data.max_prompt_tokens
    assert rows["eval"]["work"] == 3 * recipe.eval.num_prompts * recipe.eval.max_new_tokens
    tokens = plan["tokens"]["tokens"]
    assert rows["extract"]["seconds"] == pytest.approx(tokens / 200.0, abs=0.1)
    # Once train has measured a held-out tau, eval's speculative rounds yield that many tokens each.
    run.record("train", state="done", metrics={"best_tau": 2.0})
    trained = {r["phase"]: r for r in make_plan(recipe, run, calibration="cached")["time"]}
    assert trained["eval"]["seconds"] < rows["eval"]["seconds"] and "tau 2 (train's" in trained["eval"]["source"]
    # Without one, the FLOP-scaled reference, and the row says so.
    plain = make_plan(recipe, calibration="off")
    assert all(r["source"].startswith("default") for r in plain["time"])


def test_status_shows_planned_against_measured(tiny_recipe, tmp_path):
    recipe = _recipe(tiny_recipe)
    run = RunFolder(tmp_path / "run")
    run.init(recipe)
    plan = make_plan(recipe, run, calibration="off")
    record(run, plan)
    planned = {r["phase"]: r["seconds"] for r in plan["time"]}
    run.record("gen", state="done", seconds=planned["gen"] * 2, metrics={"tokens_per_s": 1.0})
    # The plan after gen bills gen at its measured rate; the estimate made before it stays the planned one.
    record(run, make_plan(recipe, run, calibration="off"))
    status = collect(run)
    gen = next(r for r in status["planned_vs_measured"] if r["stage"] == "gen")
    assert gen["planned_seconds"] == planned["gen"] and gen["measured_seconds"] == pytest.approx(planned["gen"] * 2)
    assert gen["ratio"] == pytest.approx(2.0, rel=1e-2)
    extract = next(r for r in status["planned_vs_measured"] if r["stage"] == "extract")
    assert extract["measured_seconds"] is None and extract["ratio"] is None
    assert "## Planned against measured" in render_markdown(status)


def test_demo_sizing_shrinks_for_a_smaller_budget():
    recipe = load_recipe("smollm2-cpu")
    spec = read_target(recipe.target.model)
    cal = _calibration()
    roomy, choice = size_to_budget(recipe, spec, cal, 10**9)
    assert roomy is recipe and choice["changed"] == {}
    half, choice_half = size_to_budget(recipe, spec, cal, choice["planned_seconds"] * 0.7)
    tight, choice_tight = size_to_budget(recipe, spec, cal, choice["planned_seconds"] * 0.5)
    assert choice_half["fits"] and choice_half["sized_seconds"] <= choice["planned_seconds"] * 0.7
    assert tight.data.num_train <= half.data.num_train < recipe.data.num_train
    assert tight.eval.num_prompts <= half.eval.num_prompts <= recipe.eval.num_prompts
    # Never below the floors that keep the drafter learning; a budget too small says it does not fit.
    tiny, choice_tiny = size_to_budget(recipe, spec, cal, 1.0)
    assert tiny.data.num_train == 224 and tiny.gen.max_new_tokens == 96 and not choice_tiny["fits"]
    assert tiny.train.epochs == recipe.train.epochs
