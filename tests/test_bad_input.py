"""Every subcommand, each kind of bad argument: one `specdraft: error:` line, exit code 2, no traceback,
and nothing written where nothing should be.

The matrix runs in-process (`main(argv)`), so an exception that escapes is the traceback a user would
see; the first case per kind also runs through `python -m specdraft.cli`, as a user runs it.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdraft.cli import main

# (subcommand, kind of bad input, argv). doctor's verdict on a folder it can read is its FAIL lines and
# exit code 1 (tests/test_doctor.py); here only what stops it from looking. "R" is replaced by an existing
# recipe file, "F" by a drafter folder that holds a config.json only, "J" by a file that is not JSON.
MATRIX = [
    ("gen", "malformed --set", ["gen", "--run", "r", "--set", "foo"]),
    ("gen", "malformed --set", ["gen", "--run", "r", "--set", "=3"]),
    ("gen", "unknown field", ["gen", "--run", "r", "--set", "nosuch.field=1"]),
    ("gen", "unknown field", ["gen", "--run", "r", "--set", "train.nosuch=1"]),
    ("gen", "wrong type", ["gen", "--run", "r", "--set", "train.lr=fast"]),
    ("gen", "wrong type", ["gen", "--run", "r", "--set", "data.num_train=1.5"]),
    ("gen", "unknown choice", ["gen", "--run", "r", "--set", "train.schedule=cosin"]),
    ("gen", "missing path", ["gen", "--recipe", "/no/such/recipe.toml", "--run", "r"]),
    ("gen", "wrong type", ["gen", "--run", "r", "--max-new-tokens", "many"]),
    ("gen", "out of range", ["gen", "--run", "r", "--set", "gen.top_p=5"]),
    ("gen", "out of range", ["gen", "--run", "r", "--set", "data.max_prompt_tokens=0"]),
    ("gen", "fields that disagree", ["gen", "--run", "r", "--max-new-tokens", "100000000"]),
    ("render", "out of range", ["render", "--run", "r", "--max-length", "0"]),
    ("extract", "out of range", ["extract", "--run", "r", "--set", "extract.disk_margin=nan"]),
    ("render", "out of order", ["render", "--run", "r"]),
    ("extract", "out of order", ["extract", "--run", "r"]),
    ("train", "out of order", ["train", "--run", "r"]),
    ("train", "wrong type", ["train", "--run", "r", "--epochs", "three"]),
    ("train", "out of range", ["train", "--run", "r", "--micro-batches", "0"]),
    ("train", "out of range", ["train", "--run", "r", "--set", "train.lr=inf"]),
    ("train", "fields that disagree", ["train", "--run", "r", "--batch-tokens", "1"]),
    ("export", "out of order", ["export", "--run", "r"]),
    ("export", "unknown choice", ["export", "--run", "r", "--formats", "onnx"]),
    ("export", "out of range", ["export", "--run", "r", "--speculative-tokens", "0"]),
    ("eval", "out of order", ["eval", "--run", "r"]),
    ("eval", "out of range", ["eval", "--run", "r", "--set", "eval.max_new_tokens=0"]),
    ("eval", "out of range", ["eval", "--run", "r", "--tree-depth", "-1"]),
    ("demo", "malformed --set", ["demo", "--run", "r", "--set", "foo"]),
    ("demo", "missing path", ["demo", "--recipe", "/no/such.toml", "--run", "r"]),
    ("demo", "out of range", ["demo", "--run", "r", "--set", "data.num_train=-5"]),
    ("doctor", "missing path", ["doctor", "/no/such/folder"]),
    ("doctor", "wrong type", ["doctor", "J"]),
    ("doctor", "missing path", ["doctor", "F", "--target", "/no/such/model"]),
    ("import", "missing path", ["import", "/no/such/folder", "--out", "out"]),
    ("import", "malformed --set", ["import", "F", "--out", "out", "--set", "foo"]),
    ("import", "flag needs another", ["import", "F", "--out", "out", "--run", "r"]),
    ("import", "out of range", ["import", "F", "--out", "out", "--set", "train.grad_clip=-1"]),
    ("import", "not JSON", ["import", "F", "--out", "out", "--target", "smollm2"]),
    ("plan", "missing path", ["plan", "/no/such/recipe.toml"]),
    ("plan", "malformed --set", ["plan", "R", "--set", "foo"]),
    ("plan", "unknown choice", ["plan", "R", "--set", "train.schedule=cosin"]),
    ("plan", "wrong type", ["plan", "R", "--gpus", "eight"]),
    ("plan", "wrong value", ["plan", "R", "--gpus", "0"]),
    ("plan", "out of range", ["plan", "R", "--set", "train.batch_tokens=0"]),
    ("plan", "fields that disagree", ["plan", "R", "--set", "gen.backoff_s=100"]),
    ("plan", "wrong value", ["plan", "R", "--tokens-per-sample", "-5"]),
    ("plan", "missing path", ["plan", "R", "--target", "/no/such/config.json"]),
    ("plan", "not JSON", ["plan", "R", "--target", "J"]),
    ("status", "missing path", ["status", "/no/such/run"]),
    ("bench", "flag needs another", ["bench", "--run", "r"]),
    ("bench", "flag needs another", ["bench", "--endpoint", "http://127.0.0.1:9", "--compare", "none"]),
    ("bench", "unknown choice", ["bench", "--run", "r", "--compare", "medusa:3"]),
    ("bench", "wrong value", ["bench", "--run", "r", "--endpoint", "not a url"]),
    ("bench", "wrong type", ["bench", "--run", "r", "--compare", "none", "--concurrency", "a,b"]),
    ("bench", "wrong value", ["bench", "--run", "r", "--compare", "none", "--requests", "0"]),
    ("bench", "wrong value", ["bench", "--run", "r", "--compare", "none", "--concurrency", "4,0"]),
    ("bench", "wrong value", ["bench", "--run", "r", "--endpoint", "http://127.0.0.1:9", "--max-tokens", "-1"]),
    ("(none)", "unknown choice", ["serve"]),
]


@pytest.fixture
def place(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.toml").write_text('name = "bad-input"\n')
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{not json")
    (tmp_path / "notes.txt").write_text("not a drafter and not JSON\n")
    return tmp_path


def _argv(argv: list[str], place: Path) -> list[str]:
    named = {"R": str(place / "recipe.toml"), "F": str(place / "drafter"), "J": str(place / "notes.txt")}
    return [named.get(a, a) for a in argv]


def _files(place: Path) -> set[str]:
    return {str(p.relative_to(place)) for p in place.rglob("*") if p.is_file()}


def run_main(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([str(a) for a in argv])  # paths too
        except SystemExit as e:  # argparse exits; anything else escaping is a traceback
            code = e.code
    return code, err.getvalue()


def assert_one_error_line(code: int, stderr: str) -> str:
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("specdraft: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("command, kind, argv", MATRIX, ids=[f"{c}-{k}-{i}" for i, (c, k, _) in enumerate(MATRIX)])
def test_bad_argument_is_one_line(place, command, kind, argv):
    before = _files(place)
    code, stderr = run_main(_argv(argv, place))
    assert_one_error_line(code, stderr)
    written = _files(place) - before
    # A stage refused on its run folder may record that it failed (manifest, STATUS.md), nothing more.
    assert written <= {"r/manifest.json", "r/STATUS.md"}, written
    if "r/manifest.json" in written:
        stages = json.loads((place / "r" / "manifest.json").read_text())["stages"]
        assert all(s["state"] == "failed" for s in stages.values()), stages


def test_the_matrix_covers_every_subcommand():
    from specdraft.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) <= {c for c, _, _ in MATRIX}


@pytest.mark.parametrize(
    "argv", [["gen", "--run", "r", "--set", "foo"], ["plan", "R", "--gpus", "eight"], ["doctor", "/no/such/folder"]]
)
def test_as_a_user_runs_it(place, argv):
    proc = subprocess.run(
        [sys.executable, "-m", "specdraft.cli", *_argv(argv, place)],
        cwd=place,
        capture_output=True,
        text=True,
        check=False,
    )
    assert_one_error_line(proc.returncode, proc.stderr)
