"""The memorised drafters' cache key (tests/memorised.py) follows what a trained run depends on: a change to
the trainer's code, or to what it imports, trains anew; a change to a stage that only reads a trained run,
or to a docstring or comment, keeps the cached run."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from conftest import MEMORISED_RECIPE
from memorised import PACKAGE, build_closure, cache_key, prune


@pytest.fixture
def package(tmp_path):
    copy = tmp_path / "specdraft"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def key(target, root, recipe=MEMORISED_RECIPE, dtype="float32"):
    return cache_key(recipe, target, dtype, root)


def append(path, text):
    path.write_text(path.read_text() + text)


def test_the_closure_holds_the_trainer_and_not_the_reading_stages():
    closure = build_closure()
    for name in (
        "specdraft.stages.train",
        "specdraft.stages.extract",
        "specdraft.methods.eagle3.drafter",
        "specdraft.hidden.store",
        "specdraft.targets",
        "specdraft.cli",
    ):
        assert name in closure, name
    for name in (
        "specdraft.stages.eval",
        "specdraft.stages.doctor",
        "specdraft.stages.export",
        "specdraft.stages.bench",
    ):
        assert name not in closure, name


def test_a_trainer_change_changes_the_key(target, package):
    before = key(target, package)
    append(package / "stages" / "train.py", "\nTRAINER_CHANGED = 1\n")
    assert key(target, package) != before


def test_a_change_to_what_the_trainer_imports_changes_the_key(target, package):
    before = key(target, package)
    append(package / "methods" / "eagle3" / "drafter.py", "\nDRAFTER_CHANGED = 1\n")
    assert key(target, package) != before


def test_a_reading_stage_or_a_docstring_keeps_the_key(target, package):
    before = key(target, package)
    append(package / "stages" / "doctor.py", "\nDOCTOR_CHANGED = 1\n")
    append(package / "stages" / "eval.py", "\n# a comment\n")
    train = package / "stages" / "train.py"
    source = train.read_text()
    assert source.startswith('"""')
    train.write_text('"""Another docstring.' + source[3:])
    assert key(target, package) == before


def test_the_recipe_and_the_dtype_change_the_key(target, package):
    before = key(target, package)
    assert key(target, package, recipe=MEMORISED_RECIPE.replace("epochs = 60", "epochs = 30")) != before
    assert key(target, package, dtype="bfloat16") != before


def test_prune_keeps_the_runs_used_last_and_any_used_within_the_hour(tmp_path):
    """Keys change with every trainer change, so without pruning the cache grows by a run per change (CI
    once filled its disk this way)."""
    now = time.time()
    ages = {"a": 10, "b": 1800, "c": 9000, "d": 60, "e": 99999, "f.tmp-123": 99999, "g.tmp-456": 5}
    for name, age in ages.items():
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (now - age, now - age))
    removed = prune(tmp_path, keep=2, keep_seconds=3600)
    assert sorted(p.name for p in removed) == ["c", "e", "f.tmp-123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "d", "g.tmp-456"]
