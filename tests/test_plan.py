"""plan: the bill of a run from the target's config alone, checked against published figures (bench/RESULTS.md,
the model cards) and against the drafter the trainer really builds."""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import pytest

from specdraft.billing import make_plan, read_target, train_memory
from specdraft.cli import main
from specdraft.config import load_recipe
from specdraft.targets import TargetError

CONFIGS = Path(__file__).parent / "data" / "configs"
TiB = 2**40


def _recipe(num_train=10_000, draft_vocab=32_000, **train):
    recipe = load_recipe("smollm2-cpu")
    recipe.data.num_train = num_train
    recipe.train.draft_vocab_size = draft_vocab
    for k, v in train.items():
        setattr(recipe.train, k, v)
    return recipe


def test_the_trainers_memory_question_is_plans_check():
    """train asks billing.train_memory, not the whole plan: the same check and the same fixes; over the
    device's whole memory is refused, within it but past the headroom only warned of."""
    recipe = _recipe(batch_tokens=8192)
    where = {"target": str(CONFIGS / "kimi-k2.5.json"), "tokens_per_sample": 4096, "gpus": 2, "gpu_memory_gib": 80}
    plan, memory = make_plan(recipe, **where), train_memory(recipe, **where)
    check = next(c for c in plan["checks"] if c["check"] == "train memory")
    assert (memory.need_bytes, memory.usable_bytes, memory.text) == (
        check["need_bytes"],
        check["usable_bytes"],
        check["text"],
    )
    assert memory.fixes == ("FSDP over 2 GPUs (torchrun)", "--batch-tokens 5120")
    assert set(memory.fixes) <= {r["do"] for r in plan["recommendations"]}  # with the disk's, on this machine
    assert not memory.fits and memory.beyond_device
    tight = train_memory(recipe, **{**where, "gpu_memory_gib": 105})  # 99.4 GiB: over 90 % of it, within it
    assert not tight.fits and not tight.beyond_device
    roomy = train_memory(recipe, **{**where, "gpu_memory_gib": 1000})
    assert roomy.fits and roomy.fixes == ()


def test_kimi_k25_reference_figures():
    """The Kimi-K2.5 reference run (bench/RESULTS.md): 4 bf16 states = 57,344 bytes/token, ~2.1 TiB for
    10 K x 4 K tokens, and a drafter of 1190.9 M trainable / 1403.8 M frozen (embedding + the teacher's
    draft-vocab lm_head)."""
    plan = make_plan(
        _recipe(), target=str(CONFIGS / "kimi-k2.5.json"), tokens_per_sample=4096, gpus=8, gpu_memory_gib=141
    )
    assert plan["aux_layer_ids"] == [2, 30, 58]
    assert plan["hidden"]["bytes_per_token"] == 57_344
    assert plan["tokens"]["tokens"] == 10_000 * 4096
    assert round(plan["tokens"]["tokens"] * plan["hidden"]["bytes_per_token"] / TiB, 1) == 2.1
    d = plan["drafter"]
    assert round(d["trainable"] / 1e6, 1) == 1190.9
    assert round(d["frozen"] / 1e6, 1) == 1403.8
    assert round(d["total"] / 1e6, 1) == 2594.7
    assert d["config"]["num_attention_heads"] == 64 and d["config"]["head_dim"] == 128
    t = plan["target"]
    assert t["model_type"] == "kimi_k25" and t["num_layers"] == 61 and t["hidden_size"] == 7168
    assert t["vocab_size"] == 163_840 and t["mtp_layers"] == 0
    assert t["moe"]["routed_experts"] == 384 and t["moe"]["top_k"] == 8 and t["moe"]["shared_experts"] == 1
    assert t["mla"]["kv_lora_rank"] == 512
    assert t["quantization"]["kind"] == "int4"
    # Kimi-K2: 1.04 T parameters, 32 B active (model card); INT4 experts make a ~594 GB checkpoint.
    assert 1.02e12 < t["parameters"]["total"] < 1.05e12
    assert 32e9 < t["parameters"]["active"] < 34e9
    assert 580e9 < read_target(str(CONFIGS / "kimi-k2.5.json")).weight_bytes() < 610e9


def test_an_fsdp_recipe_is_billed_sharded_and_not_told_to_shard():
    """train.parallel = "fsdp" over 8 GPUs: weights, grads and AdamW states are billed an eighth each
    (activations whole), and FSDP is not recommended to a recipe that already shards."""
    plans = [
        make_plan(
            _recipe(parallel=parallel, batch_tokens=16384),
            target=str(CONFIGS / "kimi-k2.5.json"),
            tokens_per_sample=4096,
            gpus=8,
            gpu_memory_gib=40,
        )
        for parallel in ("ddp", "fsdp")
    ]
    ddp, fsdp = plans
    whole, shard = ddp["train_memory"]["per_gpu"], fsdp["train_memory"]["per_gpu"]
    assert not ddp["train_memory"]["fsdp"] and fsdp["train_memory"]["fsdp"]
    for part in ("grads", "optimizer"):
        assert shard[part] == whole[part] // 8
    assert shard["activations"] == whole["activations"]
    assert any(r["do"].startswith("FSDP") for r in ddp["recommendations"])
    assert not any(r["do"].startswith("FSDP") for r in fsdp["recommendations"])
    # The batch that fits is found for the sharded bill: larger than for the whole one.
    fit = {
        p["train_memory"]["fsdp"]: int(
            next(r["do"] for r in p["recommendations"] if r["do"].startswith("--batch-tokens")).split()[1]
        )
        for p in plans
    }
    assert fit[True] > fit[False] > 0


def test_fp8_storage_halves_the_disk_with_a_scale_per_row():
    plan = make_plan(_recipe(), target=str(CONFIGS / "kimi-k2.5.json"), tokens_per_sample=4096)
    recipe = _recipe()
    recipe.extract.store_dtype = "fp8_e4m3"  # the field the extract stage's fp8 storage adds
    fp8 = make_plan(recipe, target=str(CONFIGS / "kimi-k2.5.json"), tokens_per_sample=4096)
    assert fp8["hidden"]["bytes_per_token"] == 4 * (7168 + 4)
    assert fp8["hidden"]["disk_bytes"] < 0.51 * plan["hidden"]["disk_bytes"]


@pytest.mark.parametrize(
    "name,total,active,layers,experts,top_k,mtp",
    [
        # Published sizes: DeepSeek-V3 671 B / 37 B active; Qwen3-30B-A3B 30.5 B / 3.3 B; gpt-oss-120b 116.8 B
        # (5.1 B active without the 0.58 B embedding, which a token only looks up).
        ("deepseek-v3", 671.0e9, 37.5e9, 61, 256, 8, 1),
        ("qwen3-moe", 30.5e9, 3.35e9, 48, 128, 8, 0),
        ("gpt-oss", 116.8e9, 5.7e9, 36, 128, 4, 0),
    ],
)
def test_big_target_configs(name, total, active, layers, experts, top_k, mtp):
    plan = make_plan(_recipe(), target=str(CONFIGS / f"{name}.json"), tokens_per_sample=4096)
    t = plan["target"]
    assert t["num_layers"] == layers and plan["aux_layer_ids"] == [2, layers // 2, layers - 3]
    assert t["moe"]["routed_experts"] == experts and t["moe"]["top_k"] == top_k and t["mtp_layers"] == mtp
    assert abs(t["parameters"]["total"] - total) / total < 0.01
    assert abs(t["parameters"]["active"] - active) / active < 0.02
    assert plan["hidden"]["bytes_per_token"] == 4 * t["hidden_size"] * 2
    # The drafter is the trainer's own: one Llama-style layer at the target's width, its vocab restricted.
    cfg = plan["drafter"]["config"]
    assert cfg["hidden_size"] == t["hidden_size"] and cfg["draft_vocab_size"] == 32_000
    parts = plan["drafter"]["parts"]
    assert parts["fc"]["trainable"] == 3 * t["hidden_size"] ** 2
    assert parts["embed_tokens"]["frozen"] == t["vocab_size"] * t["hidden_size"]
    assert parts["lm_head"]["trainable"] == parts["teacher_head"]["frozen"] == 32_000 * t["hidden_size"]


def test_published_checkpoint_sizes_from_quantization_configs():
    """Weights resident in online mode: DeepSeek-V3 FP8 ~ 0.67 TB (its 689 GB checkpoint holds the MTP layer
    too), gpt-oss-120b MXFP4 experts with bf16 attention ~ 65 GB (published 65.3 GB)."""
    assert 650e9 < read_target(str(CONFIGS / "deepseek-v3.json")).weight_bytes() < 690e9
    assert 62e9 < read_target(str(CONFIGS / "gpt-oss.json")).weight_bytes() < 67e9


def test_smollm2_plan_is_the_trainers_drafter(target):
    """The bundled target: 4 bf16 states x 576, aux (2, 15, 27), and the drafter's parameters equal those of
    the drafter the trainer instantiates for real."""
    from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter

    recipe = load_recipe("smollm2-cpu")
    plan = make_plan(recipe)
    assert plan["aux_layer_ids"] == target.aux_layer_ids == [2, 15, 27]
    assert plan["hidden"]["bytes_per_token"] == 4 * 576 * 2
    assert plan["tokens"]["tokens"] == recipe.data.num_train * min(
        recipe.render.max_length, recipe.data.max_prompt_tokens + recipe.gen.max_new_tokens
    )
    real = Eagle3Drafter(DrafterConfig.from_target(target, recipe.train.draft_vocab_size))
    assert plan["drafter"]["trainable"] == sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert plan["drafter"]["parts"]["embed_tokens"]["frozen"] == real.embed_tokens.weight.numel()
    assert plan["target"]["parameters"]["total"] == 134_515_008
    assert plan["target"]["chat_template_sha256"] is not None
    assert all(r["source"].startswith("default:") for r in plan["time"])


@pytest.mark.parametrize("draft_vocab_size", [0, 512])
def test_a_dflash_plan_bills_the_drafter_the_trainer_builds(target, draft_vocab_size):
    """train.method = dflash: the parameters of the drafter methods/dflash's build_dflash makes for real (the
    target's lm_head frozen when the vocabulary is the target's), and activations growing with the
    block slots trained per token."""
    import torch

    from specdraft.config import apply_sets
    from specdraft.methods import named

    recipe = apply_sets(
        load_recipe("smollm2-cpu"), ["train.method=dflash", f"train.draft_vocab_size={draft_vocab_size}"]
    )
    plan = make_plan(recipe)
    real = named("dflash").build(recipe.train, target, torch.ones(target.vocab_size))
    assert plan["drafter"]["method"] == "dflash"
    assert plan["drafter"]["trainable"] == sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert plan["drafter"]["frozen"] - plan["drafter"]["parts"]["teacher_head"]["frozen"] == sum(
        p.numel() for p in real.parameters() if not p.requires_grad
    )
    bigger = make_plan(apply_sets(recipe, [f"train.block_size={2 * recipe.train.block_size}"]))
    assert bigger["train_memory"]["per_gpu"]["activations"] > 1.5 * plan["train_memory"]["per_gpu"]["activations"]


def test_a_plan_that_does_not_fit_recommends_with_numbers(tmp_path):
    """Through the CLI with a config folder: more hidden states than the disk holds, and a drafter that
    needs more than one GPU's memory, give online / fp8 / fewer samples / FSDP, each with its figures."""
    folder = tmp_path / "kimi"
    folder.mkdir()
    shutil.copy(CONFIGS / "kimi-k2.5.json", folder / "config.json")
    free = shutil.disk_usage(tmp_path).free
    per_sample = 4096 * (57_344 + 5)
    num_train = 2 * free // per_sample + 1  # twice what the disk holds
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert (
            main(
                [
                    "plan",
                    "smollm2-cpu",
                    "--target",
                    str(folder),
                    "--tokens-per-sample",
                    "4096",
                    "--json",
                    "--set",
                    f"data.num_train={num_train}",
                    "--set",
                    "train.draft_vocab_size=32000",
                    "--gpus",
                    "8",
                    "--gpu-memory-gib",
                    "24",
                ]
            )
            == 0
        )
    plan = json.loads(buf.getvalue())
    disk = next(c for c in plan["checks"] if c["check"] == "disk")
    assert not disk["ok"] and disk["need_bytes"] > disk["usable_bytes"]
    dos = [r["do"] for r in plan["recommendations"]]
    assert "--set train.hidden=online" in dos and "--set extract.store_dtype=fp8_e4m3" in dos
    fewer = next(r for r in plan["recommendations"] if r["do"].startswith("--num-train"))
    n = int(fewer["do"].split()[1])
    assert n * per_sample <= disk["usable_bytes"] < (n + 1) * per_sample
    mem = next(c for c in plan["checks"] if c["check"] == "train memory")
    assert not mem["ok"]
    # FSDP over the 8 GPUs shards the fp32 weights, grads and AdamW states; activations stay per GPU.
    fsdp = next(r for r in plan["recommendations"] if r["do"] == "FSDP over 8 GPUs (torchrun)")
    d, per_gpu = plan["drafter"], plan["train_memory"]["per_gpu"]
    head = plan["target"]["parameters"]["head"]
    assert per_gpu["optimizer"] == d["trainable"] * 8 and per_gpu["grads"] == d["trainable"] * 4
    assert fsdp["per_gpu_bytes"] == (
        (d["trainable"] + d["frozen"]) * 4 // 8
        + head * 2
        + d["trainable"] * 4 // 8
        + d["trainable"] * 8 // 8
        + per_gpu["activations"]
    )
    assert fsdp["per_gpu_bytes"] < per_gpu["total"]


def test_rows_span_one_document_on_either_device_and_the_batch_that_fits_is_the_largest():
    """Each query's scores span its own document, on a GPU (FlexAttention) and on the CPU (one causal
    product per document), so both plan the same rows; a limit is met by the largest batch that fits it,
    and the next step up does not."""
    from dataclasses import replace

    from specdraft.billing import (
        BATCH_TOKENS_STEP,
        drafter_parameters,
        fitting_batch_tokens,
        training_memory,
    )
    from specdraft.methods.eagle3.drafter import DrafterConfig
    from specdraft.targets import Target

    recipe = load_recipe("smollm2-h200")
    gpu = make_plan(recipe, gpus=1, gpu_memory_gib=80)
    cpu = make_plan(recipe, gpus=0)
    per_sample = math.ceil(gpu["tokens"]["tokens_per_sample"])
    assert (
        gpu["train_memory"]["row_tokens"]
        == cpu["train_memory"]["row_tokens"]
        == min(recipe.train.batch_tokens, per_sample)
    )
    dcfg = DrafterConfig.from_target(Target("smollm2"), recipe.train.draft_vocab_size)
    params = drafter_parameters(dcfg, frozen_head=True)

    def need(bt):
        return training_memory(dcfg, params, replace(recipe.train, batch_tokens=bt), min(bt, per_sample), 1, False)[
            "total"
        ]

    limit = need(recipe.train.batch_tokens) // 3
    fit = fitting_batch_tokens(need, recipe.train.batch_tokens, limit)
    assert 0 < fit < recipe.train.batch_tokens and fit % BATCH_TOKENS_STEP == 0
    assert need(fit) <= limit < need(fit + BATCH_TOKENS_STEP)


def test_bad_config_names_the_file_and_line(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{\n  "model_type": "llama",\n  "hidden_size": ,\n}\n')
    for where in (bad, tmp_path):  # the file, or its folder
        with pytest.raises(TargetError, match=rf"{bad}:3"):
            read_target(str(where))
    with pytest.raises(TargetError, match="no such file or folder"):
        read_target(str(tmp_path / "missing"))


def test_gpus_without_their_memory_plan_without_the_memory_check(monkeypatch):
    """--gpus on a machine without GPUs and no --gpu-memory-gib: the plan is made (it was a TypeError), its
    memory check says the memory is unknown and how to give it, and nothing is recommended for memory."""
    from specdraft import environment

    describe = environment.describe
    monkeypatch.setattr(environment, "describe", lambda path: {**describe(path), "gpus": []})
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert (
            main(
                [
                    "plan",
                    str(Path(__file__).parents[1] / "recipes" / "kimi-k2.5-8gpu.toml"),
                    "--target",
                    str(CONFIGS / "kimi-k2.5.json"),
                    "--gpus",
                    "8",
                ]
            )
            == 0
        )
    line = next(x for x in buf.getvalue().splitlines() if "train memory" in x)
    assert line.split()[0] == "SKIP" and "unknown" in line and "--gpu-memory-gib" in line
    plan = make_plan(_recipe(), target=str(CONFIGS / "kimi-k2.5.json"), tokens_per_sample=4096, gpus=8)
    mem = next(c for c in plan["checks"] if c["check"] == "train memory")
    assert mem["ok"] is None and mem["usable_bytes"] is None and mem["need_bytes"] > 0
    assert not any(r["do"].startswith(("FSDP", "--batch-tokens")) for r in plan["recommendations"])


def test_plan_bills_the_target_the_stages_read(tmp_path, monkeypatch):
    """One model of the target: plan's aux ids are the family's rule, its drafter the trainer's
    (`DrafterConfig.from_target`), its bytes/token extract's (hidden/store.py), its thinking markers the
    targets table's (here a pair the template writes that plan's own table lacked)."""
    from dataclasses import replace

    from specdraft import targets
    from specdraft.hidden.store import TOKEN_BYTES, bytes_per_token
    from specdraft.methods.eagle3.drafter import DrafterConfig

    folder = tmp_path / "kimi"
    folder.mkdir()
    shutil.copy(CONFIGS / "kimi-k2.5.json", folder / "config.json")
    (folder / "chat_template.jinja").write_text("{{ '<thinking>' + m.reasoning + '</thinking>' }}")
    plan = make_plan(_recipe(), target=str(folder), tokens_per_sample=4096)
    kimi = targets.Target(str(folder))
    assert plan["target"]["thinking_markers"] == [["<thinking>", "</thinking>"]]
    assert plan["drafter"]["config"] == DrafterConfig.from_target(kimi, 32_000).to_dict()
    assert plan["hidden"]["bytes_per_token"] == bytes_per_token(4, 7168, "bfloat16")
    assert plan["hidden"]["record_bytes_per_token"] == TOKEN_BYTES
    # A config.json by another name is the same target.
    assert targets.Target(str(CONFIGS / "kimi-k2.5.json")).architecture() == kimi.architecture()

    # A family's own aux-layer rule is plan's too.
    kimi_family = replace(targets.FAMILIES["kimi_k25"], aux_layers=lambda n: [3, 20, n - 2])
    monkeypatch.setitem(targets.FAMILIES, "kimi_k25", kimi_family)
    assert make_plan(_recipe(), target=str(folder), tokens_per_sample=4096)["aux_layer_ids"] == [3, 20, 59]


def test_every_turn_raises_the_token_bound_to_the_render_cut():
    """gen.max_turns = 0 replays every user turn until render.max_length: the disk bill must say so."""
    from specdraft.billing import expected_tokens
    from specdraft.config import Recipe

    recipe = Recipe()
    recipe.data.num_train, recipe.data.max_prompt_tokens, recipe.gen.max_new_tokens = 100, 512, 256
    recipe.render.max_length = 2048
    assert expected_tokens(recipe, None, None)["tokens_per_sample"] == 768
    recipe.gen.max_turns = 2
    assert expected_tokens(recipe, None, None)["tokens_per_sample"] == 1536
    recipe.gen.max_turns = 0
    assert expected_tokens(recipe, None, None)["tokens"] == 100 * 2048
    recipe.gen.answers = "source"  # the source's own answers are first turns only
    assert expected_tokens(recipe, None, None)["tokens_per_sample"] == 768
