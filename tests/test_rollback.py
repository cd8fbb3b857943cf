"""Nothing lost, nothing silently changed: a failed stage leaves the run as it was (its --set
values unrecorded, the last good record and report kept), specdraft writes into no folder it did not
make, the temporaries a kill leaves are removed when their stage starts again, SIGTERM and SIGINT stop
the servers specdraft started, and bench refuses a dead endpoint or a malformed --compare in one line.

The failures are made where they are cheap: before any model work where that shows the rule, one eval
on the memorised drafter where only a finished run can.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_RECIPE
from test_bad_input import assert_one_error_line as one_error_line
from test_bad_input import run_main

from specdraft.cli import main
from specdraft.config import load_recipe
from specdraft.run import PIPELINE, RunFolder, remove_stale_temporaries, staged_files, staged_folders

REPO = Path(__file__).resolve().parents[1]


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def dead_pid() -> int:
    """The id of a process that has ended (a temporary named after it was left by a killed writer)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------------------------------------------
# A failed stage leaves the run as it was


@pytest.fixture
def all_done(tmp_path) -> Path:
    """A run of the tiny recipe whose manifest says every stage is done, with none of their files: each
    stage started on it fails at its first read, before any model work."""
    recipe_path = tmp_path / "tiny.toml"
    recipe_path.write_text(TINY_RECIPE)
    run = RunFolder(tmp_path / "run")
    run.init(load_recipe(str(recipe_path)))
    for stage in PIPELINE:
        run.record(stage.name, state="done", counts={"good": 1}, extra={"kept": stage.name})
    return run.path


# Each stage's failing command: a --set any stage takes (eval.draft_tokens) and what makes it fail early.
FAILING = {"gen": ["--set", "data.source=/no/such/prompts.jsonl"]}


@pytest.mark.parametrize("stage", [s.name for s in PIPELINE])
def test_a_failed_stage_keeps_its_good_record_and_the_runs_recipe(stage, all_done):
    folder = RunFolder(all_done)
    before = folder.manifest()
    code, err = run_main([stage, "--run", all_done, "--set", "eval.draft_tokens=2", *FAILING.get(stage, [])])
    one_error_line(code, err)
    assert "not updated" not in err, err  # STATUS.md written
    after = folder.manifest()
    assert after["recipe"] == before["recipe"]  # the --set values were not recorded
    good = dict(after["stages"][stage])
    attempt = good.pop("attempt")
    assert good == before["stages"][stage]  # the good record, as it was
    assert attempt["state"] == "failed" and attempt["error"]
    assert attempt["recipe_not_recorded"]["eval.draft_tokens"] == [before["recipe"]["eval"]["draft_tokens"], 2]
    assert {k: v for k, v in after["stages"].items() if k != stage} == {
        k: v for k, v in before["stages"].items() if k != stage
    }
    folder.require(stage)  # later stages still take it
    status = (all_done / "STATUS.md").read_text()
    assert "a later run failed" in status and "eval.draft_tokens = 2, the run keeps 3" in status


def test_a_new_run_records_its_recipe_when_it_is_created(tmp_path):
    """A stage run alone reads the run's recipe, so a new run keeps the one it was created with (a rerun
    of its failed first stage resumes with it); the failure is its only record."""
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(TINY_RECIPE)
    code, err = run_main(["export", "--recipe", recipe, "--run", tmp_path / "new", "--set", "eval.draft_tokens=2"])
    one_error_line(code, err)
    m = RunFolder(tmp_path / "new").manifest()
    assert m["recipe"]["eval"]["draft_tokens"] == 2 and m["stages"]["export"]["state"] == "failed"
    assert "recipe_not_recorded" not in m["stages"]["export"]


def test_a_failed_eval_keeps_the_good_report_and_export_still_takes_k_from_it(memorised_run, tmp_path):
    """The case: a good eval, then an eval that fails with --set values, then export: the good
    report, record and recipe are what export reads."""
    run = tmp_path / "run"
    shutil.copytree(memorised_run, run, symlinks=True)
    folder = RunFolder(run)
    assert main(["eval", "--run", str(run), "--set", "eval.num_prompts=1", "--set", "eval.max_new_tokens=8"]) == 0
    good, report, recipe = folder.stage("eval"), files_of(folder.eval), folder.manifest()["recipe"]
    assert set(report) == {"report.json", "report.md", "accepted_lengths.png"}

    bad = tmp_path / "prompts.jsonl"
    bad.write_text("not json\n")
    code, err = run_main(["eval", "--run", run, "--set", "eval.draft_tokens=2", "--set", f"eval.prompts_file={bad}"])
    assert f"{bad}:1: not" in one_error_line(code, err)
    assert files_of(folder.eval) == report
    entry = dict(folder.stage("eval"))
    assert entry.pop("attempt")["state"] == "failed" and entry == good
    assert folder.manifest()["recipe"] == recipe

    assert main(["export", "--run", str(run), "--formats", "vllm", "--set", "eval.draft_tokens=1"]) == 0
    k = folder.stage("export")["speculative_tokens"]
    assert k["source"] == "eval/report.json"
    assert k["per_position_acceptance"] == json.loads(report["report.json"])["per_position_acceptance"]
    assert len(k["expected_speedup"]) == recipe["eval"]["draft_tokens"]  # the good eval's K, not 2
    assert folder.manifest()["recipe"]["eval"]["draft_tokens"] == 1  # a stage that succeeds records its set


def test_files_written_as_a_set_are_all_kept_or_all_replaced(tmp_path):
    """eval's report.json + plot + report.md and render's tokens + index go through staged_files: a
    failure after some of them are written replaces none."""
    names = ("report.json", "accepted_lengths.png", "report.md")
    for name in names:
        (tmp_path / name).write_text(f"good {name}")
    before = files_of(tmp_path)
    with pytest.raises(OSError), staged_files(*(tmp_path / n for n in names)) as (js, png, md):
        js.write_text("new")
        png.write_text("new")
        raise OSError(28, "No space left on device")  # writing report.md
    assert files_of(tmp_path) == before
    with staged_files(*(tmp_path / n for n in names)) as tmps:
        for tmp in tmps:
            tmp.write_text("new")
    assert set(files_of(tmp_path).values()) == {b"new"}


def test_an_export_refused_midway_leaves_the_last_good_folders(memorised_norms_run, tmp_path):
    """SGLang refuses EAGLE-3.1's norms after vLLM's folder is written: nothing of this export is kept."""
    run = tmp_path / "run"
    shutil.copytree(memorised_norms_run, run, symlinks=True)
    folder = RunFolder(run)
    before, good = files_of(folder.exports), folder.stage("export")
    code, err = run_main(["export", "--run", run, "--formats", "both"])
    assert "SGLang" in one_error_line(code, err)
    assert files_of(folder.exports) == before
    assert sorted(p.name for p in folder.exports.iterdir()) == ["vllm"]  # no staged folder left
    entry = dict(folder.stage("export"))
    assert entry.pop("attempt")["state"] == "failed" and entry == good


def test_an_interrupted_retraining_keeps_the_trained_drafter_and_resumes(extracted_run, tmp_path, monkeypatch, capsys):
    """train starting over moves the good checkpoints aside (checkpoints.previous/, where its record then
    points: eval and export load them); a retraining stopped midway leaves them and resumes; its success
    removes them."""
    from specdraft.stages.train import Trainer

    run = tmp_path / "run"
    shutil.copytree(extracted_run, run, symlinks=True, ignore=shutil.ignore_patterns("checkpoints"))
    folder = RunFolder(run)
    fast = ["--set", "train.max_samples=2", "--set", "train.checkpoint_every=1"]
    assert main(["train", "--run", str(run), "--epochs", "1", *fast]) == 0
    chosen = folder.stage("train")["checkpoint"]
    weights = (run / chosen / "model.safetensors").read_bytes()
    step = Trainer.train_step

    def stop(self, micro):
        if self.state["step"] == 1:
            raise KeyboardInterrupt
        return step(self, micro)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", stop)
        assert main(["train", "--run", str(run), "--epochs", "2", *fast]) == 130
    entry = folder.stage("train")
    assert entry["state"] == "done" and entry["attempt"]["state"] == "failed"
    assert entry["checkpoint"] == chosen.replace("checkpoints/", "checkpoints.previous/")
    assert (run / entry["checkpoint"] / "model.safetensors").read_bytes() == weights
    assert folder.manifest()["recipe"]["train"]["epochs"] == 1
    capsys.readouterr()
    assert main(["train", "--run", str(run), "--epochs", "2", *fast]) == 0
    assert "resumed at step 1" in capsys.readouterr().out
    steps = [
        json.loads(line)["step"]
        for line in folder.train_log.read_text().splitlines()
        if json.loads(line)["kind"] == "train"
    ]
    assert steps == list(range(1, len(steps) + 1))  # each step once
    assert not folder.previous_checkpoints.exists() and "attempt" not in folder.stage("train")
    assert folder.manifest()["recipe"]["train"]["epochs"] == 2


# ---------------------------------------------------------------------------------------------------
# No folder of the user's is written into


def user_folder(tmp_path: Path, manifest: dict | None = None) -> Path:
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    (mine / "sub" / "data.bin").write_bytes(b"\x00\x01")
    if manifest is not None:
        (mine / "manifest.json").write_text(json.dumps(manifest))  # a web app's, say: not a run's
    return mine


@pytest.mark.parametrize(
    "argv",
    [[s.name] for s in PIPELINE]
    + [
        ["demo"],
        ["bench", "--endpoint", "http://127.0.0.1:9"],
        ["bench", "--compare", "none"],
        ["import", "/no/such/drafter"],
    ],
    ids=lambda a: "-".join(a[:2]),
)
@pytest.mark.parametrize("manifest", [None, {"name": "app", "icons": []}], ids=["no-manifest", "foreign-manifest"])
def test_run_refuses_a_folder_specdraft_did_not_make(argv, manifest, tmp_path):
    mine = user_folder(tmp_path, manifest)
    before = files_of(mine)
    code, err = run_main([*argv, "--run", mine])
    line = one_error_line(code, err)
    assert f"--run {mine} holds files specdraft did not write" in line
    assert files_of(mine) == before


def test_an_empty_folder_is_a_new_run(tmp_path):
    (tmp_path / "empty").mkdir()
    code, err = run_main(["export", "--run", tmp_path / "empty"])
    assert "stage 'train' is missing" in one_error_line(code, err)
    assert RunFolder(tmp_path / "empty").exists()


def test_bench_out_never_writes_among_files_it_did_not_write(tmp_path):
    mine = user_folder(tmp_path)
    before = files_of(mine)
    code, err = run_main(["bench", "--run", tmp_path / "run", "--endpoint", "http://127.0.0.1:9", "--out", mine])
    assert f"bench --out {mine} holds files specdraft did not write" in one_error_line(code, err)
    assert files_of(mine) == before and not (tmp_path / "run").exists()


def test_status_writes_nothing_into_a_folder_that_is_not_a_run(tmp_path):
    mine = user_folder(tmp_path)
    before = files_of(mine)
    one_error_line(*run_main(["status", mine]))
    assert files_of(mine) == before


# ---------------------------------------------------------------------------------------------------
# Temporaries


def test_a_killed_shard_write_leaves_a_temporary_that_extract_removes_when_it_starts(all_done):
    """A real kill -9 during a safetensors write (what extract's shard writer runs), then extract started
    again: what the kill left is gone, and a temporary of a writer still running is not touched."""
    hidden = RunFolder(all_done).hidden
    hidden.mkdir()
    writer = (
        "import sys, torch; from safetensors.torch import save_file; from specdraft.run import atomic_path\n"
        "with atomic_path(__import__('pathlib').Path(sys.argv[1])) as tmp:\n"
        "    save_file({'x': torch.zeros(400_000_000, dtype=torch.uint8)}, str(tmp))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", writer, str(hidden / "shard-00000.safetensors")],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.time() + 120
    while not any(p.name.startswith(".") for p in hidden.iterdir()) and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    left = sorted(p.name for p in hidden.iterdir())
    assert left and all(name.startswith(".") for name in left), left  # cut off mid-write
    live = hidden / f".shard-00001.safetensors.tmp-{os.getpid()}"
    live.write_bytes(b"being written")
    one_error_line(*run_main(["extract", "--run", all_done]))
    assert sorted(p.name for p in hidden.iterdir()) == [live.name]


def test_each_stage_removes_the_temporaries_a_kill_left_in_its_own_outputs(all_done):
    folder, gone = RunFolder(all_done), dead_pid()
    planted = {
        "gen": [folder.path / f".conversations.jsonl.tmp-{gone}"],
        "render": [folder.tokens / f".index.json.tmp-{gone}", folder.tokens / ".tmpAb12Cd"],
        "train": [
            folder.checkpoints / ".best.tmp" / "model.safetensors",
            folder.checkpoints / f".train_log.jsonl.tmp-{gone}",
        ],
        "export": [folder.exports / ".vllm.tmp" / "config.json", folder.exports / ".sglang.old" / "config.json"],
        "eval": [folder.eval / f".report.json.tmp-{gone}", folder.eval / f".accepted_lengths.png.tmp-{gone}"],
    }
    for paths in planted.values():
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("left by a kill")
    (folder.exports / "vllm").mkdir()
    manifest_tmp = folder.path / f".manifest.json.tmp-{gone}"
    manifest_tmp.write_text("{")
    # Cut off between a checkpoint swap's two renames: `latest` moved aside, the new one not yet in place.
    (folder.checkpoints / ".latest.old").mkdir()
    (folder.checkpoints / ".latest.old" / "COMPLETE").write_text("")
    stages = list(planted)
    for i, stage in enumerate(stages):
        one_error_line(*run_main([stage, "--run", all_done, *FAILING.get(stage, [])]))
        assert not any(p.exists() for p in planted[stage]), stage
        assert all(p.exists() for later in stages[i + 1 :] for p in planted[later]), stage  # not theirs
        assert not manifest_tmp.exists()
    assert (folder.checkpoints / "latest" / "COMPLETE").exists()  # the old one put back
    assert sorted(p.name for p in folder.exports.iterdir()) == ["sglang", "vllm"]


def test_a_staged_folder_that_fails_is_removed_and_the_old_one_kept(tmp_path):
    """save_checkpoint and export write through staged_folders: a write that fails (a full disk, here a
    value json cannot write) leaves no `.NAME.tmp` behind and the folder as it was."""
    from specdraft.drafters.checkpoint import save_checkpoint
    from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter

    drafter = Eagle3Drafter(
        DrafterConfig(
            hidden_size=16,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            intermediate_size=32,
            vocab_size=64,
            draft_vocab_size=32,
            target_hidden_size=16,
            aux_layer_ids=[1, 2, 3],
        )
    )
    best = tmp_path / "checkpoints" / "best"
    save_checkpoint(drafter, best, {"step": 1})
    before = files_of(best)
    with pytest.raises(TypeError):
        save_checkpoint(drafter, best, {"step": object()})
    assert files_of(best) == before and sorted(p.name for p in best.parent.iterdir()) == ["best"]
    with pytest.raises(KeyboardInterrupt), staged_folders(best) as (tmp,):
        (tmp / "half").write_text("")
        raise KeyboardInterrupt
    assert files_of(best) == before and sorted(p.name for p in best.parent.iterdir()) == ["best"]
    assert remove_stale_temporaries([best]) == []


# ---------------------------------------------------------------------------------------------------
# Signals


def group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(stat.parent.name))
    return alive


def children(pid: int) -> list[tuple[int, str]]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append((int(stat.parent.name), (stat.parent / "cmdline").read_bytes().decode(errors="replace")))
    return out


def _default_sigint() -> None:
    # A shell without job control starts background commands with SIGINT ignored, and Python then keeps
    # it ignored: the command under test gets SIGINT's default, as it has when a user runs it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def specdraft(argv: list, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "specdraft.cli", *map(str, argv)],
        cwd=cwd,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"},
        preexec_fn=_default_sigint,
    )


def interrupted_line(proc: subprocess.Popen, code: int) -> None:
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("specdraft:")]
    assert len(lines) == 1 and lines[0].startswith("specdraft: interrupted"), err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_a_command_in_one_line(sig, tmp_path):
    """bench waiting on a server that accepts and never answers, signalled: one line, 128 + the signal."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(120)
        recipe = tmp_path / "tiny.toml"
        recipe.write_text(TINY_RECIPE)
        proc = specdraft(
            [
                "bench",
                "--recipe",
                recipe,
                "--run",
                tmp_path / "run",
                "--prompts",
                "1",
                "--endpoint",
                f"http://127.0.0.1:{silent.getsockname()[1]}",
            ],
            tmp_path,
        )
        conn, _ = silent.accept()  # bench is asking
        proc.send_signal(sig)
        interrupted_line(proc, 128 + sig)
        conn.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_sigterm_to_bench_compare_stops_the_vllm_server_it_started(tmp_path):
    """The server is in a session of its own (a Ctrl-C in the terminal does not reach it): specdraft must
    stop it. SIGTERM once vLLM has started its engine process (a start costs ~40 s; this one is stopped on
    its way up, where `with` alone would never stop it)."""
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(TINY_RECIPE)
    proc = specdraft(
        [
            "bench",
            "--recipe",
            recipe,
            "--run",
            tmp_path / "run",
            "--compare",
            "none",
            "--prompts",
            "1",
            "--concurrency",
            "1",
            "--requests",
            "1",
            "--max-tokens",
            "4",
        ],
        tmp_path,
    )
    deadline, server = time.time() + 180, None
    while time.time() < deadline and proc.poll() is None:
        server = server or next((pid for pid, cmd in children(proc.pid) if "vllm.entrypoints" in cmd), None)
        if server and len(group_alive(server)) >= 2:  # the API server and its engine core
            break
        time.sleep(0.5)
    assert server and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else "vLLM never started"
    proc.send_signal(signal.SIGTERM)
    interrupted_line(proc, 128 + signal.SIGTERM)
    deadline = time.time() + 30
    while group_alive(server) and time.time() < deadline:
        time.sleep(0.2)
    assert group_alive(server) == []


# ---------------------------------------------------------------------------------------------------
# bench


def test_bench_names_an_endpoint_where_nothing_answers(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: connection refused
        recipe = tmp_path / "tiny.toml"
        recipe.write_text(TINY_RECIPE)
        code, err = run_main(
            ["bench", "--recipe", recipe, "--run", tmp_path / "run", "--prompts", "1", "--endpoint", url]
        )
    line = one_error_line(code, err)
    assert url in line and "nothing answers" in line


@pytest.mark.parametrize(
    "spec",
    [
        "eagle3:0",
        "ngram:0",
        "ngram:-1",
        "eagle3:x",
        "none:2",
        "ngram:3,ngram:3",
        "none,,ngram",
        "medusa:2",
        "eagle3:1.5",
    ],
)
def test_a_malformed_compare_is_refused_before_anything_starts(spec, tmp_path):
    code, err = run_main(["bench", "--run", tmp_path / "run", "--compare", spec, "--drafter", tmp_path])
    assert repr(spec) in one_error_line(code, err)
    assert not (tmp_path / "run").exists()  # refused before the run, a server or a prompt
