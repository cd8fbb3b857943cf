"""bench/ablate.py's table: every factor the ablation studies has a variant, and the report bolds the best of each
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


def test_variants_cover_the_studied_factors():
    variants = ablate().variants(3000)
    names = [v.name for v in variants]
    assert len(names) == len(set(names))
    factors = {v.factor for v in variants}
    for factor in ("draft vocab", "TTT steps", "data size", "answers", "EAGLE-3.1 norms", "loss", "hidden storage"):
        assert factor in factors, factor
    assert [v.name for v in variants if v.is_run] == ["data-all"]


def test_each_variant_changes_what_the_recipe_sets(target):
    """A variant equal to the recipe's own default would train the base again under another name; the
    full-vocabulary one (0) is the target's whole vocabulary."""
    from specdraft.config import load_recipe
    from specdraft.methods.eagle3.drafter import DrafterConfig

    recipe = load_recipe("smollm2-h200")
    for v in ablate().variants(3000):
        for key, value in v.overrides.items():
            section, field = key.split(".")
            if field != "max_samples":
                assert getattr(getattr(recipe, section), field) != value, (v.name, key)
    assert DrafterConfig.from_target(target, 0).draft_vocab_size == target.vocab_size


def row(name, factor, tau3, state="done", step=100):
    return {
        "name": name,
        "factor": factor,
        "label": name,
        "state": state,
        "step": step,
        "tau_3": tau3,
        "tau_7": tau3 + 0.1,
        "cond_accept": [0.5, 0.5, 0.5],
        "acc0": 0.5,
        "train_acc0": 0.6,
        "samples": 3000,
        "steps": step,
        "train_seconds": 10.0,
        "trainable_params": 1e6,
    }


def test_report_bolds_the_best_and_marks_partial_rows(tmp_path):
    lines = [
        row("base", "base", 2.0),
        row("ttt-3", "TTT steps", 2.2),
        row("ttt-1", "TTT steps", 1.7),
        row("kl", "loss", 1.9, state="partial", step=50),
        {"name": "lk", "factor": "loss", "label": "lk", "state": "not started"},
    ]
    md = tmp_path / "ablations.md"
    ablate().report(lines, md, "test machine", 2)
    text = md.read_text()
    assert "| TTT steps | ttt-3 | **2.200** |" in text and "**1.700**" not in text
    # Below the base, the loss group's best is the base itself: nothing in it is bold.
    assert "| loss | kl (partial, step 50) | 1.900 |" in text and "-0.100" in text
    assert "| loss | lk | not trained (not started) |" in text
    assert "Partial: 2 of 5 variants" in text
    json.dumps(lines)  # the rows stay JSON lines


def test_report_keeps_the_readings_and_names_the_common_settings(tmp_path):
    md = tmp_path / "ablations.md"
    lines = [dict(row("base", "base", 2.0), sets=["train.epochs=5"]), row("ttt-3", "TTT steps", 2.2)]
    ablate().report(lines, md, "test machine", 2)
    assert "also had `train.epochs=5`" in md.read_text()
    md.write_text(md.read_text() + "\n## Readings\n\nTTT 3 wins.\n")
    lines[1]["tau_3"] = 1.5
    ablate().report(lines, md, "test machine", 2)
    text = md.read_text()
    assert "| TTT steps | ttt-3 | 1.500 |" in text and text.count("## Readings") == 1 and "TTT 3 wins." in text


def test_share_data_links_the_stages_through_one(tmp_path):
    """A run on another run's data: its manifest keeps the stages up to `through`, its data are links,
    and a folder that already has a manifest is left alone (a resumed variant keeps its own record)."""
    from specdraft.run import RunFolder

    source = tmp_path / "source"
    (source / "tokens").mkdir(parents=True)
    (source / "hidden").mkdir()
    (source / "conversations.jsonl").write_text("{}\n")
    stages = {name: {"state": "done"} for name in ("gen", "render", "extract", "train")}
    (source / "manifest.json").write_text(json.dumps({"name": "s", "stages": stages}))
    fp8 = RunFolder(tmp_path / "fp8")
    fp8.share_data(source, through="render")
    assert list(fp8.manifest()["stages"]) == ["gen", "render"]
    assert (fp8.path / "tokens").resolve() == (source / "tokens").resolve()
    assert (fp8.path / "conversations.jsonl").is_symlink() and not (fp8.path / "hidden").exists()
    variant = RunFolder(tmp_path / "variant")
    variant.share_data(source, through="extract")
    assert list(variant.manifest()["stages"]) == ["gen", "render", "extract"]
    assert (variant.path / "hidden").resolve() == (source / "hidden").resolve()
    variant.record("train", state="partial")
    variant.share_data(source, through="extract")
    assert variant.stage("train")["state"] == "partial"


def test_each_training_gets_its_share_of_loader_workers(tmp_path):
    """One DataLoader worker each left the ablations waiting on the loader; the cores are shared out,
    and RUN's own drafter keeps its recipe's settings."""
    import os

    module = ablate()
    v = next(v for v in module.variants(3000) if v.name == "base")
    cmd = module.train_command(v, tmp_path, 3000, [], module.loader_workers(2))
    assert f"train.loader_workers={max(1, (os.cpu_count() or 2) // 2 - 1)}" in cmd
    assert all(module.loader_workers(p) >= 1 for p in (1, 2, 64, 1024))
    run_variant = next(v for v in module.variants(3000) if v.is_run)
    assert "--set" not in module.train_command(run_variant, tmp_path, 0, [], 8)


def test_report_shows_the_decoded_tau_where_a_row_has_it(tmp_path):
    decoded = {
        **row("base", "base", 2.0),
        "decoded_tau_chain": 1.9,
        "decoded_tau_tree": 3.1,
        "decode_prompts": 16,
        "decode_new_tokens": 128,
        "decode_tree": [10, 8, 64],
    }
    md = tmp_path / "ablations.md"
    ablate().report([decoded, row("ttt-1", "TTT steps", 1.7)], md, "test machine", 2)
    text = md.read_text()
    assert "| 1.900 / 3.100 |" in text and "16 held-out prompts × 128 tokens" in text
    assert "the recipe's tree (top-10, depth 8, 64 tokens)" in text
    assert text.count("decoded τ chain / tree") == 1
    # rows from calls that ran different counts side by side say so; every row has the header's columns
    lines = [
        dict(decoded, parallel=3),
        dict(row("ttt-1", "TTT steps", 1.7), parallel=5),
        {"name": "lk", "factor": "loss", "label": "lk", "state": "not started"},
    ]
    ablate().report(lines, md, "test machine", 2)
    table = [x for x in md.read_text().splitlines() if x.startswith("|")]
    assert "3 to 5 trainings side by side" in md.read_text()
    assert len({x.count("|") for x in table}) == 1, table


def test_a_score_is_reused_only_for_the_checkpoint_it_scored(tmp_path):
    """Rows scored in an earlier device call are kept beside the checkpoint; a newer checkpoint (a cut
    variant that trained on) or another decode setting is scored again."""
    from specdraft.run import RunFolder, write_json
    from specdraft.stages.train import COMPLETE

    module = ablate()
    folder = tmp_path / "variant"
    RunFolder(folder).save_manifest({"stages": {"train": {"state": "partial"}}})
    best = RunFolder(folder).checkpoint("best")
    best.mkdir(parents=True)
    (best / COMPLETE).write_text("")
    write_json(best / "config.json", {"step": 150})
    key = module.score_key(folder, 16)
    assert key == {"state": "partial", "checkpoint": "best", "step": 150, "decode_prompts": 16}
    assert module.cached_score(folder, key) is None
    write_json(folder / module.SCORE_FILE, {"key": key, "row": {"tau_3": 2.0}})
    assert module.cached_score(folder, module.score_key(folder, 16)) == {"tau_3": 2.0}
    assert module.cached_score(folder, module.score_key(folder, 0)) is None
    write_json(best / "config.json", {"step": 300})
    assert module.cached_score(folder, module.score_key(folder, 16)) is None
