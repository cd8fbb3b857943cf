"""dtype "auto": bfloat16 on a GPU and on a CPU with bf16 instructions, float32 on a CPU without them
(where torch emulates bf16 several times slower than float32). CI machines differ in exactly this."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdraft.cli import main
from specdraft.run import RunFolder
from specdraft.targets import cpu_has_bf16, resolve_dtype


def _kernel_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo to compare with")
def test_the_probe_agrees_with_the_kernels_cpu_flags(monkeypatch):
    monkeypatch.delenv("SPECDRAFT_CPU_BF16", raising=False)
    assert cpu_has_bf16() == bool(_kernel_flags() & {"avx512_bf16", "amx_bf16"})


def test_auto_follows_the_device_and_the_override(monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CPU_BF16", "0")
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"  # a name is taken as given
    monkeypatch.setenv("SPECDRAFT_CPU_BF16", "1")
    assert resolve_dtype("auto", "cpu") == "bfloat16"
    assert resolve_dtype("float16", "cuda") == "float16"


@pytest.mark.parametrize("bf16", ["0", "1"])
def test_gen_extract_and_train_record_the_dtype_they_ran_in(bf16, tmp_path, tiny_recipe, monkeypatch):
    """The stages resolve "auto" where they run and record what they used, not "auto"."""
    monkeypatch.setenv("SPECDRAFT_CPU_BF16", bf16)
    want = "bfloat16" if bf16 == "1" else "float32"
    run = tmp_path / "run"
    common = ["--recipe", str(tiny_recipe), "--run", str(run)]
    assert main(["gen", *common, "--set", "gen.num_samples=2", "--set", "gen.max_new_tokens=4"]) == 0
    records = [json.loads(line) for line in (RunFolder(run).conversations).read_text().splitlines()]
    assert {r["generator"]["sampling"]["dtype"] for r in records} == {want}
    assert main(["render", "--run", str(run)]) == 0
    assert main(["extract", "--run", str(run)]) == 0
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    assert stages["extract"]["config"]["dtype"] == want
    assert main(["train", "--run", str(run), "--set", "train.epochs=1"]) == 0
    meta = json.loads((run / "checkpoints" / "final" / "config.json").read_text())
    assert meta["autocast"] == want and meta["train"]["autocast_dtype"] == "auto"


FAULTS_SCRIPT = """
import resource, torch
from specdraft import environment
from specdraft.methods.eagle3.drafter import attend, document_mask
applied = environment.reuse_freed_memory()
torch.set_num_threads(1)
T = 1536  # SmolLM2's drafter heads over one document of T tokens: scores of 9 x T x T float32 = 85 MB a step
mask = document_mask(torch.zeros(1, T, dtype=torch.long))  # one document: its scores span the whole row
q = torch.randn(1, 9, T, 64, requires_grad=True)
k, v = (torch.randn(1, 3, T, 64, requires_grad=True) for _ in range(2))
attend(q, (k, v), [], mask).sum().backward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    attend(q, (k, v), [], mask).sum().backward()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="glibc's malloc is the one tuned")
def test_the_cpu_trainers_freed_scores_are_reused_not_faulted_in_again():
    """The drafter's attention forward and backward on the CPU, as the trainer runs it: with malloc
    left alone every step maps its large tensors afresh and the kernel faults each page in again."""
    import os
    import subprocess
    import sys

    def faults(malloc: str) -> tuple[str, int]:
        env = {**os.environ, "SPECDRAFT_MALLOC": malloc}
        out = subprocess.run(
            [sys.executable, "-c", FAULTS_SCRIPT], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        return out[0], int(out[1])

    (applied_default, default), (applied, reused) = faults("default"), faults("reuse")
    assert applied_default == "False" and applied == "True"
    # Three steps of 85 MB score tensors and their gradients: far over 3 x 85 MB of 4 KiB pages unless reused.
    assert default > 3 * 85 * 2**20 // 4096 and reused < default / 2, (default, reused)
