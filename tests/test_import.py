"""`specdraft import`: published drafter folders (ours, and SpecForge's layout written by hand) into
specdraft checkpoints with identical logits, checked against the real target."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdraft.cli import main
from specdraft.drafters import vocab
from specdraft.methods import load_checkpoint
from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter
from specdraft.methods.eagle3.formats import write_sglang, write_vllm

pytestmark = pytest.mark.slow  # reads the real target's config and embedding

DRAFT_VOCAB, T = 256, 9


@pytest.fixture(scope="module")
def drafter(target) -> Eagle3Drafter:
    """A random drafter of the bundled target's shapes, with a real draft vocab and non-trivial norms."""
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_target(target, DRAFT_VOCAB))
    d.embed_tokens.weight.data.copy_(target.embed_weight().float())
    for norm in (d.layers[0].input_layernorm, d.layers[0].hidden_norm, d.layers[0].post_attention_layernorm, d.norm):
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    counts = torch.randint(0, 100, (target.vocab_size,))
    d2t, t2d = vocab.build(counts, DRAFT_VOCAB)
    d.d2t.copy_(d2t)
    d.t2d.copy_(t2d)
    return d.eval()


def outputs(d, seed=1):
    """Logits and output states of a first drafting step and of a second step fed the first's output."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, len(d.config.aux_layer_ids) * d.config.target_hidden_size, generator=g)
    ids = torch.randint(0, d.config.vocab_size, (1, T), generator=g)
    with torch.no_grad():
        logits, h, base = d(d.project(aux), ids, torch.arange(T)[None])
        logits2, h2, _ = d(h[:, -1:], ids[:, -1:], torch.tensor([[T]]), base=base, diag=[], q_offset=T - 1)
    return logits, h, logits2, h2


def assert_identical(trained, imported):
    """Exported tensors are bf16, so the imported drafter equals the bf16-rounded trained one, exactly."""
    reference = copy.deepcopy(trained).to(torch.bfloat16).float()
    reference.d2t, reference.t2d = trained.d2t, trained.t2d
    assert imported.config == trained.config
    for a, b in zip(outputs(reference), outputs(imported)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(imported.d2t, trained.d2t) and torch.equal(imported.t2d, trained.t2d)


def export(fmt, d, out):
    if fmt == "vllm":
        return write_vllm(
            d,
            out,
            verifier="smollm2",
            verifier_architectures=["LlamaForCausalLM"],
            speculative_tokens=3,
            include_embed=False,
            provenance={"run": "test"},
        )
    return write_sglang(d, out, include_embed=False, provenance={"run": "test"})


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_export_import_gives_identical_logits(fmt, drafter, target, tmp_path, capsys):
    folder = export(fmt, drafter, tmp_path / fmt)
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 0
    imported, meta = load_checkpoint(tmp_path / "ckpt", target.embed_weight())
    assert_identical(drafter, imported)
    assert meta["aux_layer_ids"] == [2, 15, 27]
    layout = (
        "speculators (Eagle3Speculator, layers.0.*)" if fmt == "vllm" else "flat (LlamaForCausalLMEagle3, midlayer.*)"
    )
    assert meta["imported_from"]["layout"] == layout
    out = capsys.readouterr().out
    assert layout in out and "d2t: present" in out and "embed_tokens: not in the folder" in out


def test_import_into_a_run_is_what_eval_and_export_load(drafter, target, tmp_path, capsys):
    from specdraft.methods import load_trained
    from specdraft.run import RunFolder

    folder = export("sglang", drafter, tmp_path / "sglang")
    run = RunFolder(tmp_path / "run")
    assert main(["import", str(folder), "--run", str(run.path)]) == 0
    assert run.stage("import")["layout"] == "flat (LlamaForCausalLMEagle3, midlayer.*)"
    assert run.recipe().target.aux_layer_ids == [2, 15, 27]
    loaded, loaded_target, _ = load_trained(run.recipe(), run)
    assert loaded_target.aux_layer_ids == [2, 15, 27]
    assert_identical(drafter, loaded)
    # The run's hidden states now hold other layers: importing again names the disagreement.
    (run.path / "hidden").mkdir()
    (run.path / "hidden" / "index.json").write_text(json.dumps({"aux_layer_ids": [3, 15, 27]}))
    capsys.readouterr()
    assert main(["import", str(folder), "--run", str(run.path)]) == 2
    err = capsys.readouterr().err
    assert "aux layer ids: drafter [2, 15, 27], the run's hidden states [3, 15, 27]" in err and err.count("\n") == 1


# --- where --out may write -------------------------------------------------------------------------


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes: what must come through a refused import unchanged."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, out: Path) -> str:
    """The one `specdraft: error:` line, naming `out`, that a refused import wrote (no traceback)."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdraft: error: import: ") and str(out) in err, err
    return err


def test_import_leaves_a_folder_it_did_not_write_alone(drafter, tmp_path, capsys):
    folder = export("sglang", drafter, tmp_path / "sglang")
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = files_of(out)
    assert main(["import", str(folder), "--out", str(out), "--target", "smollm2"]) == 2
    assert "give --out a new or empty folder" in refused(capsys, out)
    assert files_of(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "sglang"]  # no scratch folder left


@pytest.mark.parametrize("where", ["the source", "inside it", "holding it", "its scratch name"])
def test_import_never_writes_over_the_folder_it_reads(where, drafter, tmp_path, capsys):
    """save_checkpoint replaces `out` whole and clears `.<out>.tmp`: none of them may touch the source."""
    source = {
        "the source": tmp_path / "drafter",
        "inside it": tmp_path / "drafter",
        "holding it": tmp_path / "outer" / "drafter",
        "its scratch name": tmp_path / ".ckpt.tmp",
    }[where]
    out = {
        "the source": source,
        "inside it": source / "ckpt",
        "holding it": source.parent,
        "its scratch name": tmp_path / "ckpt",
    }[where]
    folder = export("sglang", drafter, source)
    before = files_of(folder)
    assert main(["import", str(folder), "--out", str(out), "--target", "smollm2"]) == 2
    refused(capsys, out)
    assert files_of(folder) == before


def test_import_replaces_its_own_earlier_output_and_nothing_else(drafter, target, tmp_path, capsys):
    folder = export("sglang", drafter, tmp_path / "sglang")
    out = tmp_path / "ckpt"
    out.mkdir()  # an empty folder is taken as a new one
    for _ in range(2):  # the second import replaces the first's checkpoint
        assert main(["import", str(folder), "--out", str(out), "--target", "smollm2"]) == 0
        assert_identical(drafter, load_checkpoint(out, target.embed_weight())[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "sglang"]  # the old one swapped out, gone
    (out / "notes.txt").write_text("mine")  # a file of the user's makes it theirs
    before = files_of(out)
    assert main(["import", str(folder), "--out", str(out), "--target", "smollm2"]) == 2
    refused(capsys, out)
    assert files_of(out) == before


# SpecForge's LlamaForCausalLMEagle3 module names (specforge/modeling/draft/llama3_eagle.py), written out
# by hand rather than through our key map, so that a mistake in the map cannot hide here.
SPECFORGE_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.hidden_norm.weight": "layers.0.hidden_norm.weight",
    "midlayer.input_layernorm.weight": "layers.0.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight": "layers.0.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight": "layers.0.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "t2d": "t2d",
    "d2t": "d2t",
}


def specforge_folder(d: Eagle3Drafter, out, *, with_embed: bool, with_vocab_map: bool = True):
    """A folder as SpecForge saves an EAGLE-3 drafter: its configs/*-eagle3.json fields (no aux layer ids,
    no target_hidden_size, no norm flags: the engines' defaults apply) and `midlayer.*` tensors."""
    c = d.config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings,
        "model_type": "llama",
        "num_attention_heads": c.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": c.num_key_value_heads,
        "pad_token_id": 0,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.53.2",
        "use_cache": True,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
    }
    ours = d.state_dict()
    names = dict(SPECFORGE_NAMES)
    if with_embed:
        names["embed_tokens.weight"] = "embed_tokens.weight"
    if not with_vocab_map:
        del names["t2d"], names["d2t"]
    tensors = {
        theirs: ours[mine].to(torch.bfloat16) if ours[mine].is_floating_point() else ours[mine]
        for theirs, mine in names.items()
    }
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.mark.parametrize("with_embed", [False, True])
def test_specforge_folder_imports_with_identical_logits(with_embed, drafter, target, tmp_path, capsys):
    folder = specforge_folder(drafter, tmp_path / "specforge", with_embed=with_embed)
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 0
    imported, meta = load_checkpoint(tmp_path / "ckpt", target.embed_weight())
    assert_identical(drafter, imported)
    notes = "\n".join(meta["imported_from"]["notes"])
    # What the folder did not say, and what the engines (so the import) take instead.
    assert "aux layer ids: absent; the engines' default for this target, [2, 15, 27]" in notes
    assert "norm_before_residual: absent; read as False" in notes
    assert ("the drafter's own" if with_embed else "not in the folder") in notes
    assert meta["imported_from"]["layout"] == "flat (LlamaForCausalLMEagle3, midlayer.*)"


def test_folder_without_d2t_is_imported_as_the_engines_read_it_and_said_so(drafter, target, tmp_path, capsys):
    folder = specforge_folder(drafter, tmp_path / "specforge", with_embed=False, with_vocab_map=False)
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 0
    imported, _ = load_checkpoint(tmp_path / "ckpt", target.embed_weight())
    assert not imported.d2t.any()  # vLLM keeps a missing d2t at zeros: draft id i -> target id i
    out = capsys.readouterr().out
    assert "d2t: ABSENT" in out and "t2d: absent; rebuilt from d2t" in out


def test_misfits_against_the_target_are_all_named(target, tmp_path, capsys):
    torch.manual_seed(0)
    other = Eagle3Drafter(
        DrafterConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=1000,
            draft_vocab_size=100,
            target_hidden_size=96,
            aux_layer_ids=[2, 15, 40],
        )
    )
    other.d2t.copy_(vocab.build(torch.arange(1000), 100)[0])
    folder = write_vllm(
        other,
        tmp_path / "other",
        verifier="x",
        verifier_architectures=[],
        speculative_tokens=3,
        include_embed=True,
        provenance={},
    )
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert "does not fit the target" in err and err.count("\n") == 1, err  # one line, every misfit in it
    assert "vocab_size: drafter 1000, target 49152" in err
    assert "target_hidden_size: drafter 96, target hidden_size 576" in err
    assert "aux layer ids [40] outside 1..29" in err
    assert not (tmp_path / "ckpt").exists()


SPECULATORS = "speculators==0.9.0"
# What its import path needs beyond this interpreter's packages (its full dependency list would pull a
# CUDA torch, torchvision and torchaudio; saving a drafter uses none of them).
SPECULATORS_NEEDS = ["openai", "loguru", "hs-connectors==0.9.0"]


@pytest.fixture(scope="module")
def speculators_python() -> Path:
    """The python of a throwaway venv holding the speculators package from PyPI, over this interpreter's
    packages (kept in specdraft's cache between runs)."""
    import subprocess
    import sys

    from specdraft.targets import cache_dir

    venv = cache_dir() / f"{SPECULATORS.replace('==', '-')}-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", SPECULATORS], check=True, capture_output=True)
    subprocess.run([*pip, *SPECULATORS_NEEDS], check=True, capture_output=True)
    return python


def speculators_save(python: Path, kind: str, target, out: Path, *args) -> Path:
    """A `kind` drafter for `target` written by speculators' own `save_pretrained` to `out`, built as
    tests/data/speculators_save.py says from `args`."""
    import subprocess

    script = Path(__file__).parent / "data" / "speculators_save.py"
    proc = subprocess.run(
        [str(python), str(script), kind, str(target.path), str(out), *map(str, args)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def speculators_folder(speculators_python, target, tmp_path_factory) -> Path:
    """An EAGLE-3 folder for SmolLM2 written by the speculators package itself: its training CLI's layer
    config (sliding window 2048), vocabulary mapping, `from_training_args` and `save_pretrained`."""
    out = tmp_path_factory.mktemp("speculators") / "drafter"
    return speculators_save(speculators_python, "eagle3", target, out, 256)


def test_speculators_own_folder_imports_exactly_and_passes_doctor(speculators_folder, target, tmp_path, capsys):
    """speculators writes `target_hidden_size: null` (equal to the drafter's width), a sliding-window
    layer config and float32 tensors: import reads them as vLLM does, every tensor unchanged."""
    from safetensors.torch import load_file

    config = json.loads((speculators_folder / "config.json").read_text())
    assert config["target_hidden_size"] is None and config["speculators_version"] == "0.9.0"
    assert main(["import", str(speculators_folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 0
    out = capsys.readouterr().out
    assert "target_hidden_size: null; read as the drafter's hidden size 576" in out
    assert "sliding_attention with a window of 2048 tokens" in out
    imported, _ = load_checkpoint(tmp_path / "ckpt", target.embed_weight())
    theirs, ours = load_file(str(speculators_folder / "model.safetensors")), imported.state_dict()
    shared = [k for k in theirs if k in ours and k != "embed_tokens.weight"]
    assert len(shared) >= 12, sorted(theirs)
    for k in shared:
        assert torch.equal(ours[k].to(theirs[k].dtype), theirs[k]), k
    assert main(["doctor", str(speculators_folder), "--target", "smollm2", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "PASS  drafter loads" in out and "FAIL" not in out, out


def test_doctor_on_an_unreadable_foreign_folder_does_not_say_re_export(speculators_folder, tmp_path, capsys):
    import shutil

    folder = shutil.copytree(speculators_folder, tmp_path / "speculators")
    config = json.loads((folder / "config.json").read_text())
    del config["draft_vocab_size"]
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["doctor", str(folder), "--target", "smollm2", "--no-measure"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  drafter loads" in out and "specdraft export" not in out


def test_doctor_on_a_missing_folder_says_so(capsys):
    assert main(["doctor", "/no/such/folder", "--target", "smollm2"]) == 2
    assert "/no/such/folder is not a folder" in capsys.readouterr().err


# --- DFlash folders ---------------------------------------------------------------------------------


def dflash_drafter(target):
    """A random one-layer DFlash drafter of the bundled target's shapes (blocks of 4), over its whole
    vocabulary (the target's lm_head, as vLLM shares it), with non-trivial norms."""
    from specdraft.methods.dflash.drafter import DFlashConfig, DFlashDrafter

    torch.manual_seed(0)
    d = DFlashDrafter(DFlashConfig.from_target(target, mask_token_id=16, block_size=4))
    d.embed_tokens.weight.data.copy_(target.embed_weight().float())
    d.lm_head.weight.data.copy_(target.head_weight().float())
    for name, t in d.state_dict().items():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(t, 0.5, 1.5)
    return d.eval()


def block_logits(d, seed=1):
    """Two blocks (anchors 3 and 7) over a random context of 9 positions."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, len(d.config.aux_layer_ids) * d.config.target_hidden_size, generator=g)
    ids = torch.randint(0, d.config.vocab_size, (1, T), generator=g)
    bs = d.config.block_size
    anchors = torch.tensor([[3, 7]])
    positions = (anchors[..., None] + torch.arange(bs)).reshape(1, -1)
    visible = torch.arange(T)[None, None] < anchors.repeat_interleave(bs, dim=1)[..., None]
    with torch.no_grad():
        return d(d.block_inputs(ids[:, anchors[0]]), positions, d.context(aux, torch.arange(T)[None]), visible)


def dflash_folder(d, target, out: Path, edit=None) -> Path:
    from specdraft.methods.dflash.formats import write_dflash

    write_dflash(d, out, target_num_layers=target.num_layers, provenance={"run": "test"})
    if edit:
        config = json.loads((out / "config.json").read_text())
        edit(config)
        (out / "config.json").write_text(json.dumps(config))
    return out


def test_dflash_export_import_gives_identical_logits(target, tmp_path, capsys):
    d = dflash_drafter(target)
    folder = dflash_folder(d, target, tmp_path / "dflash")
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 0
    imported, meta = load_checkpoint(tmp_path / "ckpt", target.embed_weight(), target.head_weight())
    assert imported.METHOD == "dflash" and meta["imported_from"]["layout"] == "dflash"
    assert imported.config == d.config and meta["imported_from"]["notes"] == []  # every field explicit
    reference = copy.deepcopy(d).to(torch.bfloat16).float()  # the folder holds bf16
    reference.lm_head.weight.data = target.head_weight().float()  # not exported: the target's, as vLLM shares it
    torch.testing.assert_close(block_logits(imported), block_logits(reference), rtol=0, atol=0)
    assert "DFlash, 1 layer(s)" in capsys.readouterr().out


def test_dflash_fields_left_out_are_read_as_vllm_reads_them_and_reported(target, tmp_path, capsys):
    """A folder as a peer might write it: no rope theta, no block_size, the mask token at the top level.
    vLLM (through its Qwen3 config) reads theta 10,000, drafts the serve command's K and takes the top-level
    mask token; import does the same and says so."""

    def published_style(c):
        c.pop("rope_theta"), c.pop("rope_parameters"), c.pop("block_size")
        c["mask_token_id"] = c["dflash_config"].pop("mask_token_id")

    folder = dflash_folder(dflash_drafter(target), target, tmp_path / "dflash", published_style)
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 0
    imported, meta = load_checkpoint(tmp_path / "ckpt", target.embed_weight(), target.head_weight())
    assert imported.config.rope_theta == 10000.0 and imported.config.block_size == 16
    assert imported.config.mask_token_id == 16
    out = capsys.readouterr().out
    for note in ("rope_theta: absent, read as 10000", "block_size: absent", "mask_token_id: read from the top level"):
        assert note in out and any(n.startswith(note) for n in meta["imported_from"]["notes"]), out


@pytest.mark.parametrize(
    "edit,named",
    [
        # vLLM reads a missing head_dim as 128 (its Qwen3 config default), not 576 / 9 = 64: the tensors misfit
        (lambda c: c.pop("head_dim"), "self_attn.q_proj.weight: [576, 576] given, config.json needs [1152, 576]"),
        (lambda c: c.update(head_dim=None), "null, which vLLM refuses"),
        (lambda c: c["dflash_config"].update(causal=True), "causal block attention"),
        (
            lambda c: c.update(
                eagle_aux_hidden_state_layer_ids=[2, 15, 30],
                dflash_config={**c["dflash_config"], "target_layer_ids": [1, 14, 29]},
            ),
            "target layers [30] outside 1..29",
        ),
    ],
)
def test_dflash_folders_that_do_not_fit_are_refused_with_the_reason(edit, named, target, tmp_path, capsys):
    folder = dflash_folder(dflash_drafter(target), target, tmp_path / "dflash", edit)
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


# --- DFlash folders written by the speculators package ----------------------------------------------

SPEC_AUX = [4, 16, 25]  # not the target's default layers, so a lost or shifted list shows


@pytest.fixture(scope="module")
def speculators_dflash(speculators_python, target, tmp_path_factory) -> Path:
    """A two-layer DFlash drafter for SmolLM2 with a draft vocabulary of 256 (lm_head, d2t, t2d), written
    by speculators' own `from_training_args` and `save_pretrained` (float32, `target_hidden_size: null`,
    no `is_neox_style`)."""
    from specdraft.methods.dflash.drafter import default_mask_token

    mask = default_mask_token(target.tokenizer, target.vocab_size)
    out = tmp_path_factory.mktemp("speculators-dflash") / "drafter"
    return speculators_save(speculators_python, "dflash", target, out, 256, mask, ",".join(map(str, SPEC_AUX)))


def edited_copy(folder: Path, tmp_path: Path, edit) -> Path:
    import shutil

    copy_ = shutil.copytree(folder, tmp_path / "edited")
    config = json.loads((copy_ / "config.json").read_text())
    edit(config)
    (copy_ / "config.json").write_text(json.dumps(config))
    return copy_


def test_speculators_dflash_folder_imports_exactly_and_passes_doctor(speculators_dflash, target, tmp_path, capsys):
    """Every tensor unchanged, the target layers as vLLM reads them (its target_layer_ids = ids - 1, the
    residual after k layers in our count: the ids as written), and each default vLLM takes reported."""
    from safetensors.torch import load_file

    config = json.loads((speculators_dflash / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["speculators_version"] == "0.9.0"
    assert config["target_hidden_size"] is None and config["aux_hidden_state_layer_ids"] == SPEC_AUX
    assert main(["import", str(speculators_dflash), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 0
    out = capsys.readouterr().out
    for note in (
        "aux_hidden_state_layer_ids [4, 16, 25]: vLLM's target_layer_ids [3, 15, 24]",
        "target_hidden_size: null; read as the drafter's hidden size 576",
        "is_neox_style: absent; read as true",
    ):
        assert note in out, out
    imported, meta = load_checkpoint(tmp_path / "ckpt", target.embed_weight(), target.head_weight())
    assert imported.METHOD == "dflash" and meta["imported_from"]["layout"] == "speculators (dflash)"
    cfg = imported.config
    assert (cfg.aux_layer_ids, cfg.num_layers, cfg.block_size, cfg.draft_vocab_size) == (SPEC_AUX, 2, 4, 256)
    assert cfg.mask_token_id == config["mask_token_id"] and cfg.rope_theta == 100000.0
    theirs, ours = load_file(str(speculators_dflash / "model.safetensors")), imported.state_dict()
    assert {"lm_head.weight", "d2t", "t2d", "layers.1.self_attn.k_norm.weight"} <= set(theirs) <= set(ours)
    for k in theirs:
        assert torch.equal(ours[k].to(theirs[k].dtype), theirs[k]), k
    assert main(["doctor", str(speculators_dflash), "--target", "smollm2", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "PASS  drafter loads" in out and "PASS  served K = block_size - 1" in out and "FAIL" not in out, out


def test_speculators_dflash_fields_left_out_take_vllms_defaults(speculators_dflash, target, tmp_path, capsys):
    """vLLM builds this config from transformer_layer_config alone (no Qwen3 config behind it): no theta
    means its DFlash default 1e6, no head_dim hidden / heads; no block_size means its K + 1."""

    def leave_out(c):
        for key in ("sample_from_anchor", "sliding_window_non_causal", "block_size"):
            c.pop(key)
        c["transformer_layer_config"].pop("head_dim"), c["transformer_layer_config"].pop("rope_parameters")

    folder = edited_copy(speculators_dflash, tmp_path, leave_out)
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 0
    out = capsys.readouterr().out
    for note in (
        "sample_from_anchor: absent; read as false",
        "sliding_window_non_causal: absent; read as true",
        "block_size: absent; read as speculative_tokens + 1 = 4",
        "head_dim: absent; read as hidden_size / num_attention_heads = 64",
        "rope_theta: absent; read as 1e+06",
    ):
        assert note in out, out
    imported, _ = load_checkpoint(tmp_path / "ckpt", target.embed_weight(), target.head_weight())
    assert (imported.config.block_size, imported.config.head_dim, imported.config.rope_theta) == (4, 64, 1e6)


def test_speculators_dflash_over_the_whole_vocabulary_shares_the_targets_lm_head(
    speculators_python, target, tmp_path, capsys
):
    """speculators leaves lm_head out of a full-vocabulary drafter (it is the target's, frozen), as vLLM
    expects: import gives the drafter the target's lm_head and no vocabulary mapping."""
    from safetensors.torch import load_file

    folder = speculators_save(
        speculators_python, "dflash", target, tmp_path / "full", target.vocab_size, 16, ",".join(map(str, SPEC_AUX))
    )
    assert not {"lm_head.weight", "d2t", "t2d"} & set(load_file(str(folder / "model.safetensors")))
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 0
    imported, _ = load_checkpoint(tmp_path / "ckpt", target.embed_weight(), target.head_weight())
    assert imported.config.shares_lm_head and not imported.d2t.any()
    assert torch.equal(imported.lm_head.weight, target.head_weight().float())
    assert main(["doctor", str(folder), "--target", "smollm2", "--no-measure"]) == 0
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "edit,named",
    [
        (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor true"),
        (lambda c: c.pop("mask_token_id"), "mask_token_id None; vLLM requires"),
        # vLLM: dflash_config.causal = not sliding_window_non_causal, for every layer
        (
            lambda c: c.update(sliding_window_non_causal=False),
            "sliding_window_non_causal false, which vLLM reads as causal",
        ),
        (
            lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention"] * 2, sliding_window=64),
            "sliding-window layers",
        ),
    ],
)
def test_speculators_dflash_folders_we_cannot_be_are_refused_in_one_line(
    edit, named, speculators_dflash, tmp_path, capsys
):
    folder = edited_copy(speculators_dflash, tmp_path, edit)
    assert main(["import", str(folder), "--out", str(tmp_path / "ckpt"), "--target", "smollm2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specdraft: error: {folder}/config.json: ") and err.count("\n") == 1, err
    assert named in err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "edit,failed,fix",
    [
        (lambda c: c.update(mask_token_id=2), "mask token id", "not bos / eos / pad / unk"),  # SmolLM2's eos
        (lambda c: c.update(aux_hidden_state_layer_ids=[4, 16, 30]), "target layer ids in range", "1 <= k < 30"),
    ],
)
def test_doctor_fails_a_broken_speculators_dflash_folder_with_the_fix(
    edit, failed, fix, speculators_dflash, tmp_path, capsys
):
    folder = edited_copy(speculators_dflash, tmp_path, edit)
    assert main(["doctor", str(folder), "--target", "smollm2", "--no-measure"]) == 1
    out = capsys.readouterr().out
    line = out[out.index(f"FAIL  {failed}:") :]
    assert line.splitlines()[1].strip().startswith("fix: ") and fix in line.splitlines()[1], out
    assert "PASS  drafter loads" in out


@pytest.mark.vllm
def test_vllms_own_reading_of_the_speculators_dflash_config_is_ours(speculators_dflash):
    """vLLM's own translation (its speculators `update_dflash`, run in its venv) against ours."""
    import subprocess

    from specdraft.engines import VLLM_PYTHON
    from specdraft.methods.dflash.formats import from_speculators

    code = (
        "import json, sys; from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig as S; "
        "print(json.dumps(S.extract_transformers_pre_trained_config(json.load(open(sys.argv[1])))))"
    )
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", code, str(speculators_dflash / "config.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllm = json.loads(proc.stdout.splitlines()[-1])
    written = json.loads((speculators_dflash / "config.json").read_text())
    ours = from_speculators(written, "config.json", [])
    assert (
        vllm["dflash_config"]
        == ours["dflash_config"]
        == {
            "mask_token_id": written["mask_token_id"],
            "target_layer_ids": [3, 15, 24],
            "sample_from_anchor": False,
            "causal": False,
        }
    )
    assert vllm["eagle_aux_hidden_state_layer_ids"] == ours["eagle_aux_hidden_state_layer_ids"] == SPEC_AUX
    assert vllm["architectures"] == ours["architectures"] and vllm["draft_vocab_size"] == ours["draft_vocab_size"]


@pytest.mark.vllm
def test_vllm_serves_the_speculators_dflash_folder_as_written(speculators_dflash, target, tmp_path):
    """The folder as speculators wrote it, served by the real vLLM (CPU build) for method dflash: it
    loads, answers and drafts blocks of its K. Untrained, it accepts next to nothing, so no more is asserted."""
    from test_vllm_serve import serve_and_measure

    from specdraft.methods.dflash.formats import speculators_k

    k = speculators_k(json.loads((speculators_dflash / "config.json").read_text()))
    spec = {"method": "dflash", "model": str(speculators_dflash), "num_speculative_tokens": k}
    messages = [[{"role": "user", "content": "Name three colours."}]]
    acc, answers = serve_and_measure(target, speculators_dflash, messages, tmp_path / "vllm.log", speculative=spec)
    print(f"vLLM, speculators DFlash folder: {acc}; answer {answers[0]!r}")
    assert answers[0].strip()
    assert acc["drafts"] > 0 and len(acc["per_position_acceptance"]) == k == 3, acc
