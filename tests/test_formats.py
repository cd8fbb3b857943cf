"""Both export formats, written and read back, give the drafter that was trained, bit for bit."""

import copy
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdraft.drafters import vocab
from specdraft.methods import eagle3 as eagle3_method
from specdraft.methods.eagle3 import formats, sglang_serve_command
from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter
from specdraft.methods.eagle3.formats import read_drafter, write_sglang, write_vllm
from specdraft.run import write_json
from specdraft.stages import export as export_stage
from specdraft.stages.export import resolve_formats

VOCAB, DRAFT_VOCAB, T = 50, 20, 7


def tiny_drafter(seed=0, target_hidden_size=32, **overrides) -> Eagle3Drafter:
    """A random drafter with a real draft vocabulary (20 of 50 ids) and bf16-exact embeddings, as a
    bf16 target's are."""
    torch.manual_seed(seed)
    fields = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=target_hidden_size,
        aux_layer_ids=[1, 5, 9],
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
    )
    d = Eagle3Drafter(DrafterConfig(**{**fields, **overrides}))
    torch.nn.init.normal_(d.embed_tokens.weight)
    d.embed_tokens.weight.data = d.embed_tokens.weight.data.to(torch.bfloat16).float()
    for norm in (d.layers[0].input_layernorm, d.layers[0].hidden_norm, d.layers[0].post_attention_layernorm, d.norm):
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)  # non-trivial norms catch a swapped norm
    d2t, t2d = vocab.build(torch.randint(0, 100, (VOCAB,)), DRAFT_VOCAB)
    assert d2t.max() > 0 and (d2t > 0).float().mean() > 0.5  # offsets, mostly non-zero
    d.d2t.copy_(d2t)
    d.t2d.copy_(t2d)
    return d.eval()


def export(fmt, drafter, out, include_embed=False):
    if fmt == "vllm":
        return write_vllm(
            drafter,
            out,
            verifier="tiny-target",
            verifier_architectures=["LlamaForCausalLM"],
            speculative_tokens=3,
            include_embed=include_embed,
            provenance={"run": "test"},
        )
    return write_sglang(drafter, out, include_embed=include_embed, provenance={"run": "test"})


def outputs(d, seed=1):
    """Logits and next-step hidden state of a first step, then a second step fed the first's output."""
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, 3 * d.config.target_hidden_size, generator=g)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    with torch.no_grad():
        logits, h, base = d(d.project(aux), ids, torch.arange(T)[None])
        logits2, h2, _ = d(h[:, -1:], ids[:, -1:], torch.tensor([[T]]), base=base, diag=[], q_offset=T - 1)
    return logits, h, logits2, h2


def assert_same_drafter(trained, served):
    reference = copy.deepcopy(trained).to(torch.bfloat16).float()  # bf16 storage: compare the rounded drafter
    assert served.config == trained.config
    for a, b in zip(outputs(reference), outputs(served)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(served.d2t, trained.d2t) and served.d2t.dtype == torch.long
    assert torch.equal(served.t2d, trained.t2d) and served.t2d.dtype == torch.bool


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
@pytest.mark.parametrize("target_hidden_size", [32, 48])
def test_round_trip_gives_identical_logits(fmt, target_hidden_size, tmp_path):
    reader = read_drafter
    d = tiny_drafter(target_hidden_size=target_hidden_size)
    out = export(fmt, d, tmp_path / fmt)
    names = set(load_file(str(out / "model.safetensors")))
    if target_hidden_size == 32:
        # Same width as the target: the engines share the target's embedding, so none is written.
        assert "embed_tokens.weight" not in names
        with pytest.raises(ValueError, match="embed_tokens"):
            reader(out)
        served = reader(out, d.embed_tokens.weight.detach().to(torch.bfloat16))
    else:
        # Another width: the embedding cannot be the target's, so it is always in the folder.
        assert "embed_tokens.weight" in names
        served = reader(out)
    assert_same_drafter(d, served)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_included_embedding_round_trips(fmt, tmp_path):
    d = tiny_drafter(target_hidden_size=48)
    assert_same_drafter(d, read_drafter(export(fmt, d, tmp_path / fmt, include_embed=True)))


def test_sglang_tensor_names_are_the_flat_ones(tmp_path):
    d = tiny_drafter()
    out = export("sglang", d, tmp_path / "sglang")
    tensors = load_file(str(out / "model.safetensors"))
    layer = [
        "input_layernorm",
        "hidden_norm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    assert set(tensors) == (
        {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {f"midlayer.{n}.weight" for n in layer}
    )
    assert set(formats.SGLANG_KEYS.values()) == set(tensors)
    for ours, t in d.state_dict().items():  # each tensor under its own name, none swapped
        theirs = ours.replace("layers.0.", "midlayer.")
        if theirs in tensors:
            assert torch.equal(tensors[theirs], t.to(torch.bfloat16) if t.is_floating_point() else t), theirs
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # q/k/v read [embeds, hidden]: 2H


def test_flat_config_writes_every_flag_explicitly(tmp_path):
    d = tiny_drafter(target_hidden_size=48)
    config = json.loads((export("sglang", d, tmp_path / "sglang") / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert "speculators_model_type" not in config
    # Read as False when absent on this path and True on the speculators path: never left out.
    assert "norm_before_residual" in config and config["norm_before_residual"] is False
    assert config["num_aux_hidden_states"] == 3
    assert config["draft_vocab_size"] == DRAFT_VOCAB and config["vocab_size"] == VOCAB
    assert config["target_hidden_size"] == 48
    # vLLM reads the top-level list (id k = residual after k layers), SGLang only eagle_config's, to
    # which it adds 1: the two lists name the same hidden states.
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 5, 9]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 4, 8], "use_aux_hidden_state": True}
    # Fields where a missing value would fall to a default that differs from the drafter (or between engines).
    explicit = {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
    }
    assert {k: config.get(k) for k in explicit} == explicit
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}


def _rename(folder, rename):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    save_file({rename(k): v for k, v in tensors.items()}, str(path))


@pytest.mark.parametrize(
    "rename",
    [
        lambda k: k.replace("midlayer.", "layers.0."),  # vLLM-style names
        lambda k: "model." + k,
    ],
)  # as some checkpoints prefix them
def test_flat_folder_with_other_layer_names_reads(rename, tmp_path):
    d = tiny_drafter(target_hidden_size=48)
    out = export("sglang", d, tmp_path / "sglang")
    _rename(out, rename)
    assert_same_drafter(d, read_drafter(out))


@pytest.mark.parametrize(
    "fmt,name",
    [
        ("vllm", "layers.0.self_attn.k_proj.weight"),
        ("vllm", "lm_head.weight"),
        ("sglang", "midlayer.self_attn.k_proj.weight"),
        ("sglang", "fc.weight"),
    ],
)
def test_missing_tensor_is_named(fmt, name, tmp_path):
    out = export(fmt, tiny_drafter(target_hidden_size=48), tmp_path / fmt)
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    del tensors[name]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=re.escape(f"missing tensor(s) ['{name}']")):
        read_drafter(out)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_missing_d2t_reads_as_the_engines_keep_it_and_is_said(fmt, tmp_path):
    """vLLM keeps a missing d2t at zeros (draft id i -> target id i); the reader does the same, and says so."""
    out = export(fmt, tiny_drafter(target_hidden_size=48), tmp_path / fmt)
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["d2t"], tensors["t2d"]
    save_file(tensors, str(path))
    published = formats.read_published(out)
    d = published.build(None)
    assert not d.d2t.any() and torch.equal(d.t2d, torch.arange(VOCAB) < DRAFT_VOCAB)
    assert any(n.startswith("d2t: ABSENT") for n in published.notes), published.notes


@pytest.mark.parametrize("flag,tensor", [("norm_before_fc", "input_norm.weight"), ("fc_norm", "fc_norm.0.weight")])
def test_eagle31_norm_on_without_its_tensor_is_named(flag, tensor, tmp_path):
    out = export("vllm", tiny_drafter(target_hidden_size=48), tmp_path / "vllm")
    _edit_config(out, lambda c: c.update({flag: True}))
    with pytest.raises(ValueError, match=re.escape(tensor)):
        read_drafter(out)


def test_tensors_that_do_not_fit_the_config_are_all_named(tmp_path):
    out = export("sglang", tiny_drafter(target_hidden_size=48), tmp_path / "sglang")
    _edit_config(out, lambda c: c.update(intermediate_size=80, target_hidden_size=40))
    with pytest.raises(ValueError) as e:
        read_drafter(out)
    message = str(e.value)
    assert "fc.weight: [32, 144] given, config.json needs [32, 120]" in message
    for name in ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"):
        assert name in message


def test_t2d_is_rebuilt_from_d2t_and_checked_against_it(tmp_path):
    d = tiny_drafter(target_hidden_size=48)
    out = export("sglang", d, tmp_path / "sglang")
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    t2d = tensors.pop("t2d")
    save_file(tensors, str(path))
    assert_same_drafter(d, read_drafter(out))  # engines skip t2d; d2t determines it
    t2d[torch.nonzero(~t2d)[0]] = True
    save_file({**tensors, "t2d": t2d}, str(path))
    with pytest.raises(ValueError, match="t2d does not mark"):
        read_drafter(out)
    save_file({**tensors, "d2t": tensors["d2t"] + torch.arange(DRAFT_VOCAB)}, str(path))  # absolute ids
    with pytest.raises(ValueError, match="offsets"):
        read_drafter(out)


def _edit_config(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_flat_aux_ids_from_either_engine_list_and_disagreement_refused(tmp_path):
    d = tiny_drafter(target_hidden_size=48)
    out = export("sglang", d, tmp_path / "sglang")
    _edit_config(out, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))  # SpecForge-style: eagle_config only
    assert read_drafter(out).config.aux_layer_ids == [1, 5, 9]
    _edit_config(out, lambda c: c.pop("eagle_config"))
    with pytest.raises(ValueError, match="no aux layer ids"):
        read_drafter(out)
    # The same list under both keys names different layers in the two engines.
    _edit_config(
        out,
        lambda c: c.update(
            eagle_aux_hidden_state_layer_ids=[1, 5, 9], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}
        ),
    )
    with pytest.raises(ValueError, match="different hidden states"):
        read_drafter(out)


def test_flat_norm_before_residual_defaults_to_false_when_absent(tmp_path):
    out = export("sglang", tiny_drafter(target_hidden_size=48), tmp_path / "sglang")
    _edit_config(out, lambda c: c.pop("norm_before_residual"))
    assert read_drafter(out).config.norm_before_residual is False
    v = export("vllm", tiny_drafter(target_hidden_size=48), tmp_path / "vllm")
    _edit_config(v, lambda c: c.pop("norm_before_residual"))
    assert read_drafter(v).config.norm_before_residual is True  # the speculators path's default


@pytest.mark.parametrize(
    "overrides,include_embed,match",
    [
        ({"aux_layer_ids": [3, 7]}, False, "exactly 3"),
        ({"norm_before_residual": True}, False, "norm_before_residual"),
        ({}, True, "replaces it"),
    ],
)
def test_sglang_refuses_what_it_would_serve_differently(overrides, include_embed, match, tmp_path):
    d = tiny_drafter(**overrides)
    with pytest.raises(ValueError, match=match):
        export("sglang", d, tmp_path / "sglang", include_embed=include_embed)
    assert not (tmp_path / "sglang").exists()


def test_unknown_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="neither a speculators config"):
        read_drafter(tmp_path)
    with pytest.raises(ValueError, match="not found"):
        read_drafter(tmp_path / "absent")


def test_formats_and_serve_command():
    assert resolve_formats(["vllm"]) == ["vllm"]
    assert resolve_formats(["sglang"]) == ["sglang"]
    assert resolve_formats(["both"]) == ["vllm", "sglang"]
    assert resolve_formats(["sglang", "both"]) == ["sglang", "vllm"]
    for bad in (["tensorrt"], []):
        with pytest.raises(ValueError, match="known"):
            resolve_formats(bad)
    command = sglang_serve_command("/models/target", "/runs/x/export/sglang", 3)
    assert command == (
        "python -m sglang.launch_server --model-path /models/target --speculative-algorithm EAGLE3 "
        "--speculative-draft-model-path /runs/x/export/sglang --speculative-num-steps 3 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --dtype bfloat16"
    )


def test_export_stage_writes_both_folders_and_serve_commands(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from specdraft.config import Recipe
    from specdraft.run import RunFolder

    d = tiny_drafter()
    target = SimpleNamespace(path=tmp_path / "target", config=SimpleNamespace(architectures=["LlamaForCausalLM"]))
    monkeypatch.setattr(
        export_stage, "load_trained", lambda recipe, run: (d, target, d.embed_tokens.weight.detach().to(torch.bfloat16))
    )
    recipe = Recipe()
    recipe.export.formats = ["both"]
    run = RunFolder(tmp_path / "run")
    entry = export_stage.run(recipe, run)
    assert entry["folders"] == {
        "vllm": {"path": "export/vllm", "format": "speculators (Eagle3Speculator)"},
        "sglang": {"path": "export/sglang", "format": "flat (LlamaForCausalLMEagle3)"},
    }
    assert entry["embed_included"] is False
    assert entry["serve_command"] == entry["serve_commands"]["vllm"]
    assert "--speculative-num-draft-tokens 4" in entry["serve_commands"]["sglang"]
    assert "sglang.launch_server" in capsys.readouterr().out
    embed = d.embed_tokens.weight.detach().to(torch.bfloat16)
    for fmt in ("vllm", "sglang"):
        assert_same_drafter(d, read_drafter(run.path / "export" / fmt, embed))
    recipe.export.formats = ["tensorrt"]
    with pytest.raises(ValueError, match="unknown format"):
        export_stage.run(recipe, run)


def test_expected_speedup_picks_the_best_chain_length():
    # The demo drafter's eval (stop 12): acceptance 0.292 / 0.091 / 0.028 at draft cost 0.040.
    speedups = eagle3_method.expected_speedups([0.292, 0.091, 0.028], 0.040)
    assert speedups == pytest.approx({1: 1.292 / 1.04, 2: 1.383 / 1.08, 3: 1.411 / 1.12})
    assert max(speedups, key=speedups.get) == 2
    # Drafting for free, every accepted token is profit: the longest chain measured wins.
    free = eagle3_method.expected_speedups([0.6, 0.4, 0.3], 0.0)
    assert max(free, key=free.get) == 3


def test_export_takes_k_from_an_eval_newer_than_the_drafter(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from specdraft.config import Recipe
    from specdraft.run import RunFolder

    d = tiny_drafter()
    target = SimpleNamespace(path=tmp_path / "target", config=SimpleNamespace(architectures=["LlamaForCausalLM"]))
    monkeypatch.setattr(
        export_stage, "load_trained", lambda recipe, run: (d, target, d.embed_tokens.weight.detach().to(torch.bfloat16))
    )
    recipe = Recipe()
    recipe.export.formats = ["both"]
    run = RunFolder(tmp_path / "run")
    run.record("train", state="done", extra={"finished": "2026-12-01T10:00:00+0000"})
    write_json(
        run.path / "eval" / "report.json",
        {"per_position_acceptance": [0.292, 0.091, 0.028], "draft_to_target_cost": 0.04},
    )
    run.record("eval", state="done", extra={"finished": "2026-12-01T11:00:00+0000"})
    entry = export_stage.run(recipe, run)
    assert entry["speculative_tokens"]["value"] == 2 and entry["speculative_tokens"]["source"] == "eval/report.json"
    assert '"num_speculative_tokens": 2' in entry["serve_commands"]["vllm"]
    assert "--speculative-num-steps 2" in entry["serve_commands"]["sglang"]
    config = json.loads((run.path / "export" / "vllm" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert "K=2: 1.28x" in capsys.readouterr().out
    # A drafter trained after the eval was not measured by it: the recipe's K, said so.
    run.record("train", state="done", extra={"finished": "2026-12-01T12:00:00+0000"})
    entry = export_stage.run(recipe, run)
    assert entry["speculative_tokens"]["value"] == recipe.eval.draft_tokens == 3
    assert entry["speculative_tokens"]["source"].startswith("recipe")


@pytest.mark.parametrize("flag", formats.EAGLE31_FLAGS)
def test_eagle31_norms_round_trip_through_vllm_and_are_refused_by_sglang(flag, tmp_path):
    d = tiny_drafter(target_hidden_size=48, **{flag: True})
    for name, t in d.state_dict().items():
        if name.startswith(("input_norm.", "fc_norm.")):
            torch.nn.init.uniform_(t, 0.5, 1.5)  # non-trivial, so a dropped norm changes the logits
    out = export("vllm", d, tmp_path / "vllm")
    config = json.loads((out / "config.json").read_text())
    assert config[flag] is True and all(config[f] is False for f in formats.EAGLE31_FLAGS if f != flag)
    names = set(load_file(str(out / "model.safetensors")))
    assert {
        "norm_before_fc": {"input_norm.weight"},
        "fc_norm": {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"},
        "norm_output": set(),
    }[flag] <= names
    assert_same_drafter(d, read_drafter(out))
    with pytest.raises(ValueError, match="EAGLE-3.1"):
        export("sglang", d, tmp_path / "sglang")
