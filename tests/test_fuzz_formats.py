"""Property-based: whatever a drafter folder's config.json holds, `import` either accepts it or stops
with one `specdraft: error:` line naming the file, exit 2. Never a traceback. (The data readers have
theirs in tests/test_data_formats.py.)

Hypothesis starts from real folders (a drafter specdraft writes, in both formats) and changes one field
at a time to values of the wrong kind, out of range, null or missing: the mistakes hand-edited and
foreign files have.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdraft.cli import main
from specdraft.drafters import vocab
from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter
from specdraft.methods.eagle3.formats import write_sglang, write_vllm

pytestmark = pytest.mark.slow  # reads the real target's config and embedding

ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(-5, 40), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def folders(target, tmp_path_factory) -> dict[str, Path]:
    """A random drafter of the bundled target's shapes, written as vLLM and SGLang folders."""
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(target, 256))
    d2t, t2d = vocab.build(torch.randint(0, 100, (target.vocab_size,)), 256)
    d.d2t.copy_(d2t)
    d.t2d.copy_(t2d)
    root = tmp_path_factory.mktemp("fuzz")
    return {
        "vllm": write_vllm(
            d,
            root / "vllm",
            verifier="smollm2",
            verifier_architectures=["LlamaForCausalLM"],
            speculative_tokens=3,
            include_embed=False,
            provenance={},
        ),
        "sglang": write_sglang(d, root / "sglang", include_embed=False, provenance={}),
    }


def paths(config: dict, prefix=()) -> list[tuple]:
    """Every key path of a config, nested dicts included."""
    out = []
    for key, value in config.items():
        out.append((*prefix, key))
        if isinstance(value, dict):
            out += paths(value, (*prefix, key))
    return out


def mutate(config: dict, path: tuple, value, delete: bool) -> dict:
    config = json.loads(json.dumps(config))
    node = config
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return config


def run_cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)  # an exception escaping here is the traceback a user would see
    return code, err.getvalue()


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_import_reads_any_config_or_says_what_is_wrong(fmt, folders, tmp_path):
    original = json.loads((folders[fmt] / "config.json").read_text())
    keys = paths(original)

    @SETTINGS
    @given(index=st.integers(0, len(keys) - 1), value=ODD_VALUES, delete=st.booleans())
    def check(index, value, delete):
        folder = tmp_path / "drafter"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(folders[fmt], folder)
        (folder / "config.json").write_text(json.dumps(mutate(original, keys[index], value, delete)))
        out = tmp_path / "out"
        shutil.rmtree(out, ignore_errors=True)
        code, stderr = run_cli(["import", str(folder), "--out", str(out), "--target", "smollm2"])
        assert code in (0, 2), stderr
        if code == 2:
            lines = [line for line in stderr.splitlines() if line.startswith("specdraft: error:")]
            assert len(lines) == 1 and "Traceback" not in stderr, stderr
            assert not out.exists() or not any(out.iterdir()), "a refused import wrote a checkpoint"

    check()
