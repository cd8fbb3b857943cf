"""Bad input ends with one clear error line, exit code != 0, no traceback, nothing half-written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def specdraft(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdraft.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "TQDM_DISABLE": "1", "HOME": str(Path.home())},
    )


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("specdraft: error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def leftovers(run: Path) -> list[str]:
    """Files a failed stage left behind beyond the run's records, manifest.json and STATUS.md (temporary
    names included)."""
    return sorted(
        str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and p.name not in ("manifest.json", "STATUS.md")
    )


def test_missing_model_path(tmp_path):
    proc = specdraft("gen", "--run", "r", "--set", "target.model=/no/such/model", cwd=tmp_path)
    assert_one_line_error(proc, "/no/such/model", "no such file")
    assert leftovers(tmp_path / "r") == []
    m = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert m["stages"]["gen"]["state"] == "failed"


@pytest.mark.slow
def test_empty_dataset(tmp_path, target):
    (tmp_path / "empty.jsonl").write_text("")
    proc = specdraft("gen", "--run", "r", "--set", f"data.source={tmp_path / 'empty.jsonl'}", cwd=tmp_path)
    assert_one_line_error(proc, "empty.jsonl", "no usable train conversations")
    assert leftovers(tmp_path / "r") == []


@pytest.mark.slow
def test_malformed_jsonl_line(tmp_path, target):
    good = json.dumps({"messages": [{"role": "user", "content": "Hello"}]})
    (tmp_path / "bad.jsonl").write_text(good + "\n" + good + "\n" + '{"messages": [oops]}\n')
    proc = specdraft("gen", "--run", "r", "--set", f"data.source={tmp_path / 'bad.jsonl'}", cwd=tmp_path)
    assert_one_line_error(proc, "bad.jsonl:3", "not valid JSON")
    assert leftovers(tmp_path / "r") == []


def test_unknown_recipe_field(tmp_path):
    proc = specdraft("train", "--run", "r", "--set", "train.epochz=3", cwd=tmp_path)
    assert_one_line_error(proc, "epochz")


def test_stage_out_of_order(tmp_path):
    proc = specdraft("train", "--run", "r", cwd=tmp_path)
    assert_one_line_error(proc, "extract", "specdraft extract")


@pytest.mark.parametrize("flag", [["--set", "train.loss=foo"], ["--loss", "foo"]])
def test_a_value_outside_a_field_s_choices(tmp_path, capsys, flag):
    from specdraft.cli import main

    assert main(["train", "--run", str(tmp_path / "r"), *flag]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines() == ["specdraft: error: --set train.loss: 'foo' is not one of 'soft_ce', 'kl', 'lk'"]
    assert not (tmp_path / "r").exists()  # refused before the run folder is made
