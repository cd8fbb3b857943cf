"""Every file specdraft reads goes through one checked path (specdraft.files): a corrupt, truncated or
foreign safetensors / JSON / JSONL file is one `specdraft: error:` line naming the file (and line) and what
to do, exit 2, never a traceback; a full disk is one line naming the path and the bytes it needed, with no
temporary file left; token ids outside the vocabulary are refused by render with their file and line.

Each case corrupts a copy of a real file (the shared `extracted_run`, a drafter written by the real
writers, safetensors written by `save_file`) and runs the real reader or `specdraft.cli.main`. The full-disk
cases write into a real 256 KiB tmpfs where this process may mount one (root), and into /dev/full (the
kernel's ENOSPC on every write) otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from specdraft import files
from specdraft.cli import main
from specdraft.files import DiskFull, FileError

VOCAB = 49152  # SmolLM2's


def run_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    """specdraft.cli.main(argv) as a user runs it; (exit code, the stderr lines)."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


def assert_one_line(code: int, lines: list[str], *needles: str) -> str:
    """Exit 2 and one `specdraft: error:` line holding each needle; nothing else on stderr but progress
    bars (tqdm, enabled where it was imported before the tests disabled it)."""
    assert code == 2, lines
    errors = [line for line in lines if line.startswith("specdraft: error: ")]
    assert len(errors) == 1, lines
    assert all(re.search(r"\[\d\d:\d\d", line) for line in lines if line not in errors), lines
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path: Path) -> None:
    path.write_bytes(os.urandom(300))


def edit_manifest(run: Path, change) -> None:
    m = json.loads((run / "manifest.json").read_text())
    change(m)
    (run / "manifest.json").write_text(json.dumps(m))


@pytest.fixture
def run(extracted_run, tmp_path, monkeypatch) -> Path:
    """A copy of the shared run through extract, in a fresh working folder."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(extracted_run, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


# --- tokens.safetensors, render's output, read by extract (and train online, doctor) ------------------


def _foreign(path: Path) -> None:
    save_file({"x": torch.zeros(3)}, str(path))


def _token_id(value: int):
    def put(path: Path) -> None:
        t = load_file(str(path))
        t["input_ids"][5] = value
        save_file(t, str(path))

    return put


@pytest.mark.parametrize(
    "corrupt, problem",
    [
        (truncate, "not a whole safetensors file"),
        (garbage, "not a whole safetensors file"),
        (_foreign, "without the tensor(s) ['input_ids', 'loss_mask', 'offsets']"),
        (_token_id(-1), "token id -1 is outside the target's vocabulary"),
        (_token_id(VOCAB), f"token id {VOCAB} is outside the target's vocabulary"),
    ],
    ids=["truncated", "garbage", "foreign", "id-1", "id=vocab"],
)
def test_a_corrupt_tokens_file_stops_extract_in_one_line(run, capsys, corrupt, problem):
    corrupt(run / "tokens" / "tokens.safetensors")
    code, lines = run_cli(["extract", "--run", "run"], capsys)
    assert_one_line(code, lines, "run/tokens/tokens.safetensors: ", problem, "rerun `specdraft render`")


# --- hidden shards and index, extract's output, read by train ------------------------------------------


def _narrow(path: Path) -> None:
    """The shard rewritten whole, its states half as wide: another target's."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    t = load_file(str(path))
    t["aux"], t["last"] = t["aux"][:, : t["aux"].shape[1] // 2].contiguous(), t["last"][:, :32].contiguous()
    save_file(t, str(path), metadata=metadata)


@pytest.mark.parametrize(
    "corrupt, problem",
    [
        (truncate, "not a whole safetensors file"),
        (garbage, "not a whole safetensors file"),
        (_narrow, "states of shape"),
    ],
    ids=["truncated", "garbage", "another-target"],
)
def test_a_bad_shard_stops_train_in_one_line(run, capsys, corrupt, problem):
    corrupt(run / "hidden" / "shard-00000.safetensors")
    code, lines = run_cli(["train", "--run", "run"], capsys)
    assert_one_line(code, lines, "run/hidden/shard-00000.safetensors: ", problem, "rerun `specdraft extract`")


def test_extract_rewrites_the_torn_shard_it_names(run, capsys):
    """The fix the line gives works: extract rewrites the torn shard, and the store reads again."""
    from specdraft.hidden.store import HiddenStore

    shard = run / "hidden" / "shard-00000.safetensors"
    whole = load_file(str(shard))
    truncate(shard)
    with pytest.raises(FileError, match="rerun `specdraft extract`"):
        HiddenStore(run / "hidden")
    assert main(["extract", "--run", "run"]) == 0
    assert torch.equal(load_file(str(shard))["input_ids"], whole["input_ids"])
    assert len(HiddenStore(run / "hidden")[0]["input_ids"]) > 0


def test_an_index_that_is_a_list_is_one_line(run, capsys):
    (run / "hidden" / "index.json").write_text("[1, 2]")
    code, lines = run_cli(["train", "--run", "run"], capsys)
    assert_one_line(code, lines, "run/hidden/index.json: a JSON array where an object should be")


# --- the manifest ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["status", "run"], ["train", "--run", "run"], ["plan", "run", "--no-calibrate"], ["export", "--run", "run"]],
)
def test_a_manifest_stage_without_state_is_one_line(run, capsys, argv):
    edit_manifest(run, lambda m: m["stages"]["extract"].pop("state"))
    code, lines = run_cli(argv, capsys)
    assert_one_line(code, lines, "run/manifest.json: stage 'extract' has no 'state'")


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"stages": ', "run/manifest.json:1: not valid JSON"),
        ("[]", "run/manifest.json: a JSON array where an object should be"),
    ],
)
def test_a_manifest_that_is_not_one_is_one_line(run, capsys, text, problem):
    (run / "manifest.json").write_text(text)
    code, lines = run_cli(["status", "run"], capsys)
    assert_one_line(code, lines, problem)


# --- checkpoints -------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(target, tmp_path) -> Path:
    """A (random-weight) drafter of the target's shapes, saved by the real checkpoint writer."""
    from specdraft.drafters.checkpoint import save_checkpoint
    from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter

    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(target, 64))
    path = tmp_path / "ckpt"
    save_checkpoint(drafter, path, {"aux_layer_ids": target.aux_layer_ids, "target": target.describe()})
    return path


@pytest.mark.parametrize(
    "corrupt, problem",
    [
        (lambda c: truncate(c / "model.safetensors"), "model.safetensors: not a whole safetensors file"),
        (lambda c: (c / "config.json").write_text("nope"), "config.json:1: not valid JSON"),
        (
            lambda c: (c / "config.json").write_text('{"drafter": {"hidden_sizes": 3}, "aux_layer_ids": [1, 2]}'),
            "config.json: its drafter config does not fit this specdraft",
        ),
    ],
    ids=["weights-truncated", "config-garbage", "config-foreign"],
)
def test_a_corrupt_checkpoint_stops_export_in_one_line(run, checkpoint, capsys, corrupt, problem):
    shutil.copytree(checkpoint, run / "checkpoints" / "final")
    edit_manifest(run, lambda m: m["stages"].__setitem__("train", {"state": "done", "checkpoint": "checkpoints/final"}))
    corrupt(run / "checkpoints" / "final")
    code, lines = run_cli(["export", "--run", "run"], capsys)
    assert_one_line(code, lines, "run/checkpoints/final/", problem, "rerun `specdraft train`")


def test_a_garbage_trainer_state_names_the_fix_that_works(checkpoint):
    from specdraft.drafters.checkpoint import load_trainer_state

    (checkpoint / "trainer.json").write_text('{"format": "specdraft trainer state", "version": 1, "state": {}}')
    garbage(checkpoint / "trainer.safetensors")
    with pytest.raises(FileError, match=r"trainer.safetensors: not a whole safetensors file.*train.resume=false"):
        load_trainer_state(checkpoint)


# --- drafter folders, read by doctor and import ---------------------------------------------------------


@pytest.fixture
def drafter_folder(target, tmp_path, monkeypatch) -> Path:
    from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter
    from specdraft.methods.eagle3.formats import write_vllm

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(target, 64))
    return write_vllm(
        d,
        tmp_path / "drafter",
        verifier="smollm2",
        verifier_architectures=["LlamaForCausalLM"],
        speculative_tokens=3,
        include_embed=False,
        provenance={"by": "test"},
    )


@pytest.mark.parametrize(
    "corrupt, problem",
    [
        (lambda f: truncate(f / "model.safetensors"), "drafter/model.safetensors: not a whole safetensors file"),
        (lambda f: garbage(f / "model.safetensors"), "drafter/model.safetensors: not a whole safetensors file"),
        (lambda f: (f / "config.json").write_text("[1, 2]"), "drafter/config.json: a JSON array where an object"),
    ],
    ids=["weights-truncated", "weights-garbage", "config-list"],
)
def test_import_of_a_corrupt_drafter_is_one_line(drafter_folder, capsys, corrupt, problem):
    corrupt(drafter_folder)
    code, lines = run_cli(["import", "drafter", "--out", "out"], capsys)
    assert_one_line(code, lines, problem, "re-export it")
    assert not Path("out").exists()


@pytest.mark.parametrize(
    "corrupt, check, problem",
    [
        (lambda f: truncate(f / "model.safetensors"), "drafter loads", "drafter/model.safetensors: not a whole"),
        (
            lambda f: (f / "config.json").write_text("[1, 2]"),
            "config.json readable",
            "drafter/config.json: a JSON array where an object should be",
        ),
    ],
    ids=["weights-truncated", "config-list"],
)
def test_doctor_fails_a_corrupt_drafter_by_name(drafter_folder, capsys, corrupt, check, problem):
    """doctor's verdict on a folder is its FAIL lines (exit 1): the file and its problem, no traceback."""
    corrupt(drafter_folder)
    capsys.readouterr()
    assert main(["doctor", "drafter", "--target", "smollm2", "--no-measure"]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    failed = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1 and failed[0].startswith(f"FAIL  {check}: ") and problem in failed[0], out


# --- JSON Lines: conversations and data sources, by line ------------------------------------------------


def _conversations(run: Path, token_ids: list[int] | None = None, bad_byte: bool = False) -> None:
    """The run's conversations file replaced by four short ones; the third with `token_ids` for its answer,
    or a byte that is not UTF-8 in its prompt (on line 3)."""
    lines = []
    for i in range(4):
        answer = {"role": "assistant", "content": "Hi there"}
        if i == 2 and token_ids is not None:
            answer["token_ids"] = token_ids
        line = json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "Say hi"}, answer]}).encode()
        lines.append(line.replace(b"Say hi", b"Say \xff hi") if i == 2 and bad_byte else line)
    (run / "conversations.jsonl").write_bytes(b"\n".join(lines) + b"\n")


@pytest.mark.parametrize("bad", [-1, VOCAB], ids=["negative", "vocab"])
def test_render_refuses_token_ids_outside_the_vocabulary_by_line(run, capsys, bad):
    _conversations(run, token_ids=[9155, bad])
    code, lines = run_cli(["render", "--run", "run"], capsys)
    assert_one_line(
        code, lines, "run/conversations.jsonl:3: ", f"holds {bad}, outside the target's vocabulary [0, {VOCAB})"
    )


def test_a_non_utf8_byte_is_named_with_its_line(run, capsys):
    _conversations(run, bad_byte=True)
    code, lines = run_cli(["render", "--run", "run"], capsys)
    assert_one_line(code, lines, "run/conversations.jsonl:3: not UTF-8 text (byte 0xff at column ")


def test_a_pre_rendered_row_with_a_negative_id_is_named(tmp_path):
    from specdraft.config import DataConfig
    from specdraft.data.sources import DataError, read_rendered

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"input_ids": ids, "loss_mask": [0, 1, 1]}) + "\n" for ids in ([1, 2, 3], [1, 2, 3], [4, -1, 5])
        )
    )
    with pytest.raises(DataError, match=r"rows.jsonl:3: 'input_ids' holds -1 at position 1, which is no token id"):
        list(read_rendered(DataConfig(source=str(rows))))


def test_jsonl_reader_names_line_and_skips_only_a_torn_tail(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\n{"a": 3')  # a last append cut off by a kill
    assert [n for n, _ in files.read_jsonl(path, fix="f", torn_tail=True)] == [1, 3]
    with pytest.raises(FileError, match=r"log.jsonl:4: not valid JSON .*; f$"):
        list(files.read_jsonl(path, fix="f"))
    path.write_bytes(b'{"a": 1}\n[1]\n')
    with pytest.raises(FileError, match=r"log.jsonl:2: a JSON array where an object should be; f$"):
        list(files.read_jsonl(path, fix="f"))


def test_a_damaged_training_log_is_named_by_line(tmp_path):
    from specdraft.training import keep_log_until

    log = tmp_path / "train_log.jsonl"
    log.write_text('{"kind": "train", "step": 1}\n{"kind": "train"}\n')
    with pytest.raises(FileError, match=r"train_log.jsonl:2: not a training log record"):
        keep_log_until(log, 5)


def test_a_damaged_calibration_cache_is_one_line(run, capsys):
    (run / "calibration.json").write_text("{garbage")
    code, lines = run_cli(["plan", "run", "--no-calibrate"], capsys)
    assert_one_line(code, lines, "run/calibration.json:1: not valid JSON", "remove it")


# --- a full disk ---------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs of 256 KiB mounted in tmp (needs the right to mount: root); skipped where there is none."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_full_disk_while_a_checkpoint_is_written_leaves_nothing(small_disk, target):
    from specdraft.drafters.checkpoint import save_checkpoint
    from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter

    drafter = Eagle3Drafter(DrafterConfig.from_target(target, 64))  # megabytes besides the embedding
    best = small_disk / "checkpoints" / "best"
    with pytest.raises(DiskFull) as e:
        save_checkpoint(drafter, best, {"aux_layer_ids": target.aux_layer_ids})
    line = str(e.value)
    assert line.startswith(f"{best}: the disk is full: writing it needed ") and "\n" not in line
    saved = {k: v for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    assert e.value.needed >= sum(t.numel() * t.element_size() for t in saved.values())
    assert [p.name for p in small_disk.rglob("*")] == ["checkpoints"]  # no .best.tmp


def test_a_full_disk_at_the_command_line_is_one_line(run, small_disk, capsys):
    """status writes STATUS.md and the manifest into a run on a disk with no room left."""
    moved = small_disk / "run"
    shutil.copytree(run, moved, ignore=shutil.ignore_patterns("*.safetensors"))
    with open(small_disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError):  # every block taken
        while True:
            f.write(b"\0" * 4096)
    code, lines = run_cli(["status", str(moved)], capsys)
    line = assert_one_line(code, lines, f"{moved}/", "the disk is full: writing it needed ")
    assert not [p for p in moved.rglob(".*tmp*")], line


def test_a_full_disk_in_an_atomic_write_is_one_line_and_no_temporary(tmp_path):
    """Where no tmpfs can be mounted: the write goes to /dev/full (the kernel's ENOSPC on every write)
    through the temporary name atomic_path uses."""
    from specdraft.run import write_json

    path = tmp_path / "report.json"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.symlink_to("/dev/full")
    with pytest.raises(DiskFull) as e:
        write_json(path, {"x": "y" * 1000})
    needed = len((json.dumps({"x": "y" * 1000}, indent=2) + "\n").encode())
    assert str(e.value).startswith(f"{path}: the disk is full: writing it needed {needed:,} bytes")
    assert sorted(os.listdir(tmp_path)) == []


# --- any byte of a small file corrupted ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_files(tmp_path_factory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("small")
    save_file(
        {
            "input_ids": torch.arange(7, dtype=torch.int32),
            "loss_mask": torch.ones(7, dtype=torch.uint8),
            "offsets": torch.tensor([0, 3, 7]),
        },
        str(root / "t.safetensors"),
        metadata={"plan": "p"},
    )
    return {
        "safetensors": (root / "t.safetensors").read_bytes(),
        "json": json.dumps({"state": "done", "samples": [{"shard": "s", "tokens": 3}]}).encode(),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["safetensors", "json"]),
    cut=st.none() | st.integers(0, 300),
    flips=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 255)), max_size=4),
)
def test_any_corruption_reads_whole_or_as_one_named_line(small_files, tmp_path, kind, cut, flips):
    data = bytearray(small_files[kind])
    for at, byte in flips:
        data[at % len(data)] = byte
    data = data[:cut] if cut is not None else data
    path = tmp_path / f"f.{kind}"
    path.write_bytes(bytes(data))
    try:
        if kind == "safetensors":
            files.load_safetensors(path, fix="rerun it", need=("input_ids", "loss_mask", "offsets"))
        else:
            files.read_json(path, fix="rerun it")
    except FileError as e:
        line = str(e)
        assert line.startswith(str(path)) and line.endswith("; rerun it") and "\n" not in line, line
