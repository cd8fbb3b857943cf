"""doctor passes a sound drafter and names each deliberately broken one."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.drafter import vocab
from specdraft.drafter.model import DrafterConfig, Eagle3Drafter
from specdraft.export.doctor import diagnose
from specdraft.export.formats import provenance, write_sglang, write_vllm

pytestmark = pytest.mark.slow  # reads the real target's embedding


@pytest.fixture(scope="module")
def sound(tmp_path_factory, target):
    """A (random-weight) drafter with the target's shapes, a real draft vocab, in both formats."""
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(target, 64))
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    counts[1000:1064] = 5
    d2t, t2d = vocab.build(counts, 64)
    d.d2t.copy_(d2t)
    d.t2d.copy_(t2d)
    d.embed_tokens.weight.data.copy_(target.embed_weight().float())
    root = tmp_path_factory.mktemp("doctor")
    write_vllm(d, root / "vllm", verifier=str(target.path), verifier_architectures=["LlamaForCausalLM"],
               speculative_tokens=3, include_embed=False, provenance=provenance("t"))
    write_sglang(d, root / "sglang", include_embed=False, provenance=provenance("t"))
    return root


def failed(checks):
    return {c.name for c in checks if not c.ok}


def edit_config(src, dst, change):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    change(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def edit_tensor(src, dst, name, value):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors[name] = value(tensors[name])
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_sound_drafter_passes(sound, target, fmt):
    checks = diagnose(sound / fmt, target, measured=False)
    assert failed(checks) == set(), [c.line() for c in checks]


def test_missing_aux_ids(sound, target, tmp_path):
    bad = edit_config(sound / "vllm", tmp_path / "bad", lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    assert "aux layer ids written" in failed(diagnose(bad, target, measured=False))


def test_missing_norm_flag(sound, target, tmp_path):
    bad = edit_config(sound / "vllm", tmp_path / "bad", lambda c: c.pop("norm_before_residual"))
    assert failed(diagnose(bad, target, measured=False)) == {"norm_before_residual written"}


def test_aux_ids_out_of_range_and_unsorted(sound, target, tmp_path):
    bad = edit_config(sound / "vllm", tmp_path / "a", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 15, 40]))
    assert "aux layer ids in range" in failed(diagnose(bad, target, measured=False))
    bad = edit_config(sound / "vllm", tmp_path / "b", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[15, 2, 27]))
    assert "aux layer ids ascending" in failed(diagnose(bad, target, measured=False))


def test_identity_d2t(sound, target, tmp_path):
    bad = edit_tensor(sound / "vllm", tmp_path / "bad", "d2t", torch.zeros_like)
    # t2d no longer matches the zero mapping either; drop it as vLLM does (it skips t2d).
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(bad / "model.safetensors"))
    tensors.pop("t2d")
    save_file(tensors, str(bad / "model.safetensors"))
    assert failed(diagnose(bad, target, measured=False)) == {"d2t is a real mapping"}


def test_absolute_d2t(sound, target, tmp_path):
    bad = edit_tensor(sound / "vllm", tmp_path / "bad", "d2t", lambda d: d + torch.arange(d.numel()))
    checks = diagnose(bad, target, measured=False)
    assert "drafter loads" in failed(checks)
    # Absolute ids read as offsets point at other tokens, which t2d (or the vocab range) exposes.
    assert "d2t" in next(c.detail for c in checks if c.name == "drafter loads")


def test_other_targets_hidden_size(sound, target, tmp_path):
    bad = edit_config(sound / "vllm", tmp_path / "bad", lambda c: c.update(target_hidden_size=512))
    assert "drafter loads" in failed(diagnose(bad, target, measured=False))


def test_run_disagreements(sound, target, tmp_path):
    """Layers extracted other than the drafter's, and training data rendered with another template."""
    from safetensors.torch import save_file

    run = tmp_path / "run"
    (run / "hidden").mkdir(parents=True)
    (run / "hidden" / "index.json").write_text(json.dumps({"aux_layer_ids": [3, 15, 27]}))
    (run / "tokens").mkdir()
    save_file({"input_ids": torch.tensor([5, 6, 7], dtype=torch.int32),
               "loss_mask": torch.tensor([0, 1, 1], dtype=torch.uint8),
               "offsets": torch.tensor([0, 3])}, str(run / "tokens" / "tokens.safetensors"))
    (run / "tokens" / "index.json").write_text(json.dumps({"chat_template_sha256": "0" * 16}))
    assert failed(diagnose(sound / "vllm", target, run, measured=False)) == {
        "aux layer ids = extracted ones", "chat template = training data's", "draft vocab covers the training answers"}
