"""Shared fixtures: the real bundled target (converted once per machine) and a tiny recipe."""

from __future__ import annotations

import os
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


class FixtureTimes:
    """Where SPECDRAFT_FIXTURE_TIMES names a file, each fixture set-up of 0.5 s or more is written there as
    a JSON line (its own time: the fixtures it requests are set up, and timed, before it). bench/ci_time.py
    reads it beside pytest's --durations report, which charges a shared fixture to the first test using
    it. Registered as a plugin of its own: a conftest hook would not see session-scoped set-ups."""

    def __init__(self, out: str):
        self.out, self.times = Path(out), []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        import time

        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        if seconds >= 0.5:
            self.times.append(
                {
                    "fixture": fixturedef.argname,
                    "scope": fixturedef.scope,
                    "seconds": round(seconds, 2),
                    "first_test": request.node.nodeid,
                }
            )

    def pytest_sessionfinish(self, session):
        import json

        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("".join(json.dumps(t) + "\n" for t in self.times))


def pytest_configure(config):
    if os.environ.get("SPECDRAFT_FIXTURE_TIMES"):
        config.pluginmanager.register(FixtureTimes(os.environ["SPECDRAFT_FIXTURE_TIMES"]), "fixture-times")


# vLLM servers start eager, but for the EAGLE-3 drafter served exactly as `export` prints it: on a 2-core
# CPU a compiled start took 110 s to ready and an eager one 41 s (bench/RESULTS.md, "CI time"), and every
# drafter variant compiles anew (its speculative config is in the compile cache's key). That one compiled
# server still serves the target's and the drafter's compiled path in every CI run.
VLLM_EAGER = ["--enforce-eager"]


def need_vllm() -> None:
    """Skip a test that needs the vLLM venv where there is none; where SPECDRAFT_REQUIRE_VLLM=1 (CI sets
    it) a missing venv fails the test instead, so a broken vLLM install cannot pass as a skip."""
    from specdraft.engines import VLLM_PYTHON

    if VLLM_PYTHON.exists():
        return
    why = f"no vLLM venv at {VLLM_PYTHON} (bash scripts/install_vllm.sh)"
    if os.environ.get("SPECDRAFT_REQUIRE_VLLM") == "1":
        pytest.fail(f"{why}, and SPECDRAFT_REQUIRE_VLLM=1", pytrace=False)
    pytest.skip(why)


def pytest_runtest_setup(item):
    if item.get_closest_marker("vllm"):
        need_vllm()


@pytest.fixture(scope="session")
def vllm_target(target, tmp_path_factory):
    """A real vLLM server (CPU build) serving the bundled SmolLM2, shared by every test of the session
    that needs a plain target endpoint (eager: ~40 s to start; stopped by PID at the end)."""
    from specdraft.engines import VllmServer

    need_vllm()
    with VllmServer(
        target.path, log_path=tmp_path_factory.mktemp("vllm-target") / "vllm.log", extra=VLLM_EAGER
    ) as server:
        yield server


@pytest.fixture(scope="session")
def extracted_run(target, tmp_path_factory) -> Path:
    """A run folder through gen, render and extract of the tiny recipe (real target, real ShareGPT),
    shared by the tests that train from it; copy it before writing into it."""
    from specdraft.cli import main

    root = tmp_path_factory.mktemp("extracted")
    recipe = root / "tiny.toml"
    recipe.write_text(TINY_RECIPE)
    run = root / "run"
    for stage in ("gen", "render", "extract"):
        assert main([stage, "--recipe", str(recipe), "--run", str(run)]) == 0
    return run


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


# The recipe's EAGLE-3.1 norms (one RMSNorm per aux layer before fc, the normed output fed forward):
# vLLM serves them, SGLang refuses them.
MEMORISED_NORMS_RECIPE = MEMORISED_RECIPE + "fc_norm = true\nnorm_output = true\n"


# The same 8 samples memorised by a DFlash drafter: one layer, blocks of 4 (K = 3, as the EAGLE-3 test
# serves), over the target's whole vocabulary with its lm_head shared and frozen (the folder vLLM serves
# by default: no lm_head, no d2t), all 8 trained on (vLLM is served those 8 prompts). Its lr is a tenth of
# the EAGLE-3 recipe's: through the target's tied lm_head, 3e-3 stalls at the unigram (~9 % top-1 after
# 60 steps), 3e-4 memorises (~0.9 at 120 steps; bench/RESULTS.md, "Why the first DFlash drafter learnt
# slowly").
MEMORISED_DFLASH_RECIPE = """
name = "overfit-dflash"
[data]
num_train = 8
max_prompt_tokens = 96
[gen]
batch_size = 8
max_new_tokens = 32
[train]
method = "dflash"
block_size = 4
draft_vocab_size = 0
epochs = 150
lr = 3e-4
warmup_steps = 5
batch_tokens = 4096
holdout = 0.0
"""


# The same 8 samples memorised by a P-EAGLE drafter: EAGLE-3's recipe with train.method = "peagle", K = 3
# slots per block (one real, two mask slots), served with parallel_drafting: true and K = 3 as the EAGLE-3
# test serves its chain. Two decoder layers, so that vLLM serving it checks the later layers too (the
# first is EAGLE-3's, which the EAGLE-3 tests serve).
MEMORISED_PEAGLE_RECIPE = MEMORISED_RECIPE.replace("[train]\n", "[train]\nmethod = \"peagle\"\npeagle_layers = 2\n")


def _memorised(recipe: str, formats: str, tmp_path_factory, target) -> Path:
    """A copy of the trained run of `recipe` (trained once, cached outside the checkout: tests/memorised.py),
    exported fresh in `formats` by the current export code."""
    from memorised import trained_copy

    from specdraft.cli import main

    run = trained_copy(recipe, target, tmp_path_factory)
    assert main(["export", "--run", str(run), "--formats", formats]) == 0
    return run


@pytest.fixture(scope="session")
def memorised_run(tmp_path_factory, target) -> Path:
    """A run whose drafter memorised the target's answers to 8 ShareGPT prompts, exported in both
    formats: a drafter that demonstrably drafts, shared by the doctor and vLLM serving tests.

    Trained once per machine and kept outside the checkout under a key of what it depends on
    (tests/memorised.py); tests get a copy, exported fresh by the current export code."""
    return _memorised(MEMORISED_RECIPE, "both", tmp_path_factory, target)


@pytest.fixture(scope="session")
def memorised_norms_run(tmp_path_factory, target) -> Path:
    """The same, trained with EAGLE-3.1's norms (the smollm2-h200 recipe's), exported for vLLM only."""
    return _memorised(MEMORISED_NORMS_RECIPE, "vllm", tmp_path_factory, target)


@pytest.fixture(scope="session")
def memorised_dflash_run(tmp_path_factory, target) -> Path:
    """The 8 samples memorised by a DFlash drafter (MEMORISED_DFLASH_RECIPE), cached like
    memorised_run, exported fresh in vLLM's DFlash folder format."""
    return _memorised(MEMORISED_DFLASH_RECIPE, "vllm", tmp_path_factory, target)


@pytest.fixture(scope="session")
def memorised_peagle_run(tmp_path_factory, target) -> Path:
    """The 8 samples memorised by a P-EAGLE drafter (MEMORISED_PEAGLE_RECIPE), cached like memorised_run,
    exported fresh in vLLM's peagle folder format."""
    return _memorised(MEMORISED_PEAGLE_RECIPE, "vllm", tmp_path_factory, target)


# The same memorised drafter for the second real target, Qwen2.5-Coder-0.5B-Instruct (programming prompts
# first). 40 epochs, not 60: its training accuracy on the 8 answers is near 1 by then, and its steps cost
# more than SmolLM2's.
MEMORISED_QWEN_RECIPE = """
name = "overfit-qwen"
[target]
model = "qwen2.5-coder-0.5b"
[data]
num_train = 8
max_prompt_tokens = 96
prefer = "programming"
[gen]
batch_size = 8
max_new_tokens = 32
[train]
draft_vocab_size = 512
ttt_steps = 3
epochs = 40
lr = 3e-3
warmup_steps = 5
batch_tokens = 4096
"""


@pytest.fixture(scope="session")
def qwen():
    from specdraft.targets import Target

    return Target("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen_memorised_run(tmp_path_factory, qwen) -> Path:
    """A Qwen2.5-Coder drafter that memorised its answers to 8 programming prompts, exported for vLLM;
    cached like `memorised_run`."""
    return _memorised(MEMORISED_QWEN_RECIPE, "vllm", tmp_path_factory, qwen)


def training_conversations(run_path: Path, n: int = 8, answer_tokens: int = 48) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the run's own training samples, for doctor's measured checks: where a
    drafter that learnt anything must agree with the target (the held-out split tells whether it generalises)."""
    from specdraft.data.tokens import load_tokens

    _, samples = load_tokens(Path(run_path) / "tokens")
    out = []
    for ids, mask in samples[:n]:
        ids, mask = list(map(int, ids)), list(map(int, mask))
        start = mask.index(1)
        out.append((ids[:start], ids[start : start + answer_tokens]))
    return out
