"""status: STATUS.md of a tiny real run (bundled SmolLM2, real ShareGPT prompts), written after every stage;
an extraction cut off mid-way shows 🔄 with the counts on disk and the command that resumes it; every
figure it states is traced back to the manifest."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from specdraft.cli import main
from specdraft.run import RunFolder
from specdraft.stages.status import collect

pytestmark = pytest.mark.slow

SHARDS_LOST = 3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, target):
    """gen -> render -> extract (one sample per shard) -> train through the CLI; STATUS.md after gen kept."""
    from conftest import TINY_RECIPE

    root = tmp_path_factory.mktemp("status")
    recipe = root / "tiny.toml"
    recipe.write_text(TINY_RECIPE)
    run = root / "run"
    assert main(["gen", "--recipe", str(recipe), "--run", str(run)]) == 0
    after_gen = (run / "STATUS.md").read_text()
    assert main(["render", "--run", str(run)]) == 0
    # A 1-byte shard budget puts each sample in its own shard: a cut-off leaves whole shards behind.
    assert main(["extract", "--run", str(run), "--shard-bytes", "1"]) == 0
    assert main(["train", "--run", str(run)]) == 0
    return run, after_gen


def _resolve(manifest: dict, source: str):
    obj = manifest
    for part in source.split("."):
        obj = obj[part]
    return obj


def test_status_is_written_after_every_stage(tiny_run):
    run, after_gen = tiny_run
    assert re.search(r"\| ✅ \| gen \| done \|", after_gen)
    assert re.search(r"\| ⏳ \| render \| not started \|", after_gen)
    assert f"`specdraft render --run {run}`" in after_gen
    now = (run / "STATUS.md").read_text()
    for stage in ("gen", "render", "extract", "train"):
        assert re.search(rf"\| ✅ \| {stage} \| done \|", now), stage
    assert re.search(r"\| ⏳ \| export \| not started \|", now)
    assert f"**Next:** `specdraft export --run {run}`" in now


def test_interrupted_extraction_shows_progress_and_resumes(tiny_run, tmp_path):
    """What a kill mid-extraction leaves: the shards renamed into place so far, index.json still partial,
    no extract record in the manifest. STATUS.md says 🔄 with those counts and the resume command; running
    it writes only the missing shards."""
    src, _ = tiny_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    hidden = run / "hidden"
    index = json.loads((hidden / "index.json").read_text())
    names = [s if isinstance(s, str) else s["name"] for s in index["shards"]]  # names, or {"name", ...}
    lost = names[-SHARDS_LOST:]
    for name in lost:
        (hidden / name).unlink()
    index["state"] = "partial"
    (hidden / "index.json").write_text(json.dumps(index))
    m = json.loads((run / "manifest.json").read_text())
    for stage in ("extract", "train"):
        del m["stages"][stage]
    (run / "manifest.json").write_text(json.dumps(m))
    shutil.rmtree(run / "checkpoints")  # a kill mid-extraction comes before any training

    assert main(["status", str(run)]) == 0
    text = (run / "STATUS.md").read_text()
    kept = [s for s in index["samples"] if s["shard"] not in lost]
    n = len(names)
    row = next(line for line in text.splitlines() if "| extract |" in line)
    assert row.startswith("| 🔄 | extract | in progress |")
    assert f"{n - SHARDS_LOST} of {n} shards" in row
    assert f"{len(kept)} of {len(index['samples'])} samples" in row
    assert f"{sum(s['tokens'] for s in kept):,} of {sum(s['tokens'] for s in index['samples']):,} tokens" in row
    assert f"**Next:** `specdraft extract --run {run}` (resumes from what is on disk)" in text
    assert re.search(r"\| ⏳ \| train \| not started \|", text)

    # Interrupted by Ctrl-C instead: the manifest says failed, the shards say how far it got.
    m["stages"]["extract"] = {"state": "failed", "error": "KeyboardInterrupt: "}
    (run / "manifest.json").write_text(json.dumps(m))
    status = collect(RunFolder(run))
    extract = next(r for r in status["stages"] if r["stage"] == "extract")
    assert extract["icon"] == "🔄" and extract["progress"]["shards"] == n - SHARDS_LOST
    assert extract["error"] == "KeyboardInterrupt: "

    # The resume command does what STATUS.md says: only the lost shards are written.
    assert main(["extract", "--run", str(run)]) == 0
    done = json.loads((run / "manifest.json").read_text())["stages"]["extract"]
    assert done["counts"]["shards_written"] == SHARDS_LOST and done["counts"]["shards"] == n
    text = (run / "STATUS.md").read_text()
    assert text.count("| ✅ | extract | done |") == 1
    assert f"**Next:** `specdraft train --run {run}`" in text


def test_every_figure_comes_from_the_manifest(tiny_run):
    run, _ = tiny_run
    assert main(["status", str(run), "--json"]) == 0
    status = collect(RunFolder(run))
    m = json.loads((run / "manifest.json").read_text())
    # Measured figures: each equals the manifest value it names, with a unit and the machine.
    names = set()
    for row in status["measured"]:
        assert row["value"] == _resolve(m, row["source"]), row
        assert m["stages"][row["stage"]]["finished"] in row["where"] and row["unit"] is not None
        names.add((row["stage"], row["name"]))
    for stage in ("gen", "extract", "train"):
        for name, value in m["stages"][stage]["metrics"].items():
            assert value is None or (stage, name) in names, (stage, name)
    assert ("extract", "bytes_per_token") in names and ("gen", "tokens_per_s") in names
    for row in status["stages"]:
        entry = m["stages"].get(row["stage"])
        assert row["counts" if entry else "state"] == (entry["counts"] if entry else "not started")
    assert {k: v for k, v in status["target"].items() if k != "source"} == m["plan"]["target"]
    assert status["environment"]["env"] == _resolve(m, status["environment"]["source"])
    for f in status["files"]:
        path = run / f["path"]
        size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        assert f["bytes"] == size, f
    # Nothing invented: every number in STATUS.md is one of the status JSON's (which the checks above tie
    # to the manifest), whatever its formatting (thousands separators, trailing zeros).
    text = (run / "STATUS.md").read_text()
    known = {float(x) for x in re.findall(r"\d+(?:\.\d+)?", json.dumps(status, ensure_ascii=False))}
    for token in re.findall(r"\d[\d,]*(?:\.\d+)?", text):
        assert float(token.replace(",", "")) in known, token


def test_plan_of_the_run_uses_its_measurements(tiny_run):
    """The plan kept in the manifest (refreshed after each stage) bills what the run measured: rendered
    tokens, extract's bytes/token, the trainer's parameter count, and the measured throughputs."""
    run, _ = tiny_run
    m = json.loads((run / "manifest.json").read_text())
    plan, stages = m["plan"], m["stages"]
    assert plan["tokens"]["tokens"] == stages["render"]["counts"]["tokens"]
    assert plan["tokens"]["source"].startswith("measured")
    # extract counts the states' bytes per token, or those plus each token's id and mask (5 bytes).
    h = plan["hidden"]
    assert stages["extract"]["metrics"]["bytes_per_token"] in (
        h["bytes_per_token"],
        h["bytes_per_token"] + h["record_bytes_per_token"],
    )
    assert plan["drafter"]["trainable"] == stages["train"]["counts"]["trainable_params"]
    rows = {r["phase"]: r for r in plan["time"]}
    for phase in ("gen", "extract", "train"):
        assert rows[phase]["source"].startswith(f"measured: stages.{phase}.metrics.tokens_per_s"), rows[phase]
        assert rows[phase]["rate_per_s"] == pytest.approx(stages[phase]["metrics"]["tokens_per_s"])
    assert rows["eval"]["source"].startswith("default:")
    status = collect(RunFolder(run))
    assert status["remaining"]["rows"][-1]["phase"] == "eval"
    assert status["remaining"]["seconds"] == pytest.approx(rows["eval"]["seconds"], abs=0.1)


def test_interrupted_training_shows_its_latest_checkpoint(tiny_run, tmp_path):
    """Training cut off before it recorded itself: STATUS.md shows the step of checkpoints/latest and the
    command that resumes from it."""
    src, _ = tiny_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    m = json.loads((run / "manifest.json").read_text())
    for stage in ("train", "export", "eval"):
        m["stages"].pop(stage, None)
    (run / "manifest.json").write_text(json.dumps(m))
    step = json.loads((RunFolder(run).checkpoint("latest") / "config.json").read_text())["step"]
    assert main(["status", str(run)]) == 0
    text = (run / "STATUS.md").read_text()
    row = next(line for line in text.splitlines() if "| train |" in line)
    assert row.startswith("| 🔄 | train | in progress |")
    assert f"checkpoint at step {step}" in row
    assert f"**Next:** `specdraft train --run {run}` (resumes from what is on disk)" in text
