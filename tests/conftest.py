"""Shared fixtures: the real bundled target (converted once per machine) and a tiny recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY_RECIPE = """
name = "tiny"
[data]
num_train = 8
max_prompt_tokens = 128
[gen]
batch_size = 4
max_new_tokens = 24
[train]
draft_vocab_size = 512
ttt_steps = 3
epochs = 2
batch_tokens = 2048
[eval]
num_prompts = 3
max_new_tokens = 16
"""


@pytest.fixture(scope="session")
def target():
    from specdraft.targets import Target

    return Target("smollm2")


@pytest.fixture
def tiny_recipe(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_RECIPE)
    return path


@pytest.fixture(autouse=True)
def _quiet_tqdm(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    yield


@pytest.fixture(scope="session")
def vllm_target(target, tmp_path_factory):
    """A real vLLM server (CPU build) serving the bundled SmolLM2, shared by every test of the session
    that needs a plain target endpoint (~150 s to start; stopped by PID at the end)."""
    from specdraft.evaluate.server import VLLM_PYTHON, VllmServer, vllm_available

    if not vllm_available():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (bash scripts/install_vllm.sh)")
    with VllmServer(target.path, log_path=tmp_path_factory.mktemp("vllm-target") / "vllm.log") as server:
        yield server


MEMORISED_RECIPE = """
name = "overfit"
[data]
num_train = 8
max_prompt_tokens = 96
[gen]
batch_size = 8
max_new_tokens = 32
[train]
draft_vocab_size = 512
ttt_steps = 3
epochs = 60
lr = 3e-3
warmup_steps = 5
batch_tokens = 4096
"""


@pytest.fixture(scope="session")
def memorised_run(tmp_path_factory, target) -> Path:
    """A run whose drafter memorised the target's answers to 8 ShareGPT prompts, exported in both
    formats: a drafter that demonstrably drafts, shared by the doctor and vLLM serving tests."""
    from specdraft.cli import main

    root = tmp_path_factory.mktemp("memorised")
    (root / "overfit.toml").write_text(MEMORISED_RECIPE)
    run = root / "run"
    for stage in ("gen", "render", "extract", "train"):
        assert main([stage, "--recipe", str(root / "overfit.toml"), "--run", str(run)]) == 0
    assert main(["export", "--run", str(run), "--formats", "both"]) == 0
    return run
