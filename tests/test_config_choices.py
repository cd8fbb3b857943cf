"""Fields with fixed choices (Literal[...] in config.py) take one of them and nothing else, when the recipe
loads and when a flag sets them, and the stages that read them agree on what the choices are."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from specdraft.config import (
    ConfigError,
    EvalConfig,
    ExportConfig,
    ExtractConfig,
    GenConfig,
    Recipe,
    TrainConfig,
    apply_override,
    apply_sets,
    field_choices,
    recipe_from_dict,
)

SECTIONS = (GenConfig, ExtractConfig, TrainConfig, ExportConfig, EvalConfig)


def test_the_typed_fields_and_their_choices():
    typed = {
        f"{cls.__name__}.{f.name}": field_choices(cls, f.name)
        for cls in SECTIONS
        for f in dataclasses.fields(cls)
        if field_choices(cls, f.name)
    }
    assert typed == {
        "GenConfig.dtype": ("auto", "bfloat16", "float16", "float32"),
        "GenConfig.answers": ("target", "source"),
        "GenConfig.expect_reasoning": ("auto", "true", "false"),
        "ExtractConfig.dtype": ("auto", "bfloat16", "float16", "float32"),
        "ExtractConfig.store_dtype": ("bfloat16", "fp8_e4m3"),
        "ExtractConfig.backend": ("transformers", "vllm"),
        "TrainConfig.method": ("eagle3", "dflash", "peagle"),
        "TrainConfig.optimizer": ("adamw", "muon"),
        "TrainConfig.autocast_dtype": ("auto", "bfloat16", "float32"),
        "TrainConfig.hidden": ("disk", "online", "served"),
        "TrainConfig.served_cache": ("none", "memory"),
        "TrainConfig.loss": ("soft_ce", "kl", "lk"),
        "TrainConfig.parallel": ("ddp", "fsdp"),
        "TrainConfig.schedule": ("cosine", "linear"),
        "TrainConfig.lm_head_init": ("random", "target", "target-frozen"),
        "ExportConfig.formats": ("vllm", "sglang", "both"),
        "EvalConfig.dtype": ("bfloat16", "float16", "float32"),
        "EvalConfig.engine": ("auto", "eager", "static", "cuda-graphs"),
    }


def test_defaults_are_among_the_choices_and_plain_str():
    recipe = Recipe()
    for cls in SECTIONS:
        section = next(f.name for f in dataclasses.fields(Recipe) if typing.get_type_hints(Recipe)[f.name] is cls)
        for f in dataclasses.fields(cls):
            allowed = field_choices(cls, f.name)
            value = getattr(getattr(recipe, section), f.name)
            for item in value if isinstance(value, list) else [value]:
                assert not allowed or (type(item) is str and item in allowed), (section, f.name, item)


def test_every_allowed_choice_is_declared_once():
    """A field's Literal is the one declaration of its choices: no module repeats a field's whole set of
    choices as a tuple, list or set of its own (a stage that needs them derives them, field_choices)."""
    import ast
    from pathlib import Path

    import specdraft
    from specdraft.methods import METHODS
    from specdraft.stages.export import FORMATS

    declared = {
        frozenset(field_choices(cls, f.name)): f"{cls.__name__}.{f.name}"
        for cls in SECTIONS
        for f in dataclasses.fields(cls)
        if field_choices(cls, f.name)
    }
    root = Path(specdraft.__file__).parent
    twins = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, (ast.Tuple, ast.List, ast.Set))
                and len(node.elts) > 1
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)
            ):
                field = declared.get(frozenset(e.value for e in node.elts))
                if field:
                    twins.append(f"{path.relative_to(root)}:{node.lineno} repeats {field}'s choices")
    assert not twins, twins
    assert field_choices(TrainConfig, "method") == tuple(METHODS)
    assert all(set(m.formats) <= set(FORMATS) for m in METHODS.values())


def test_dflash_fields_are_bounded_when_loaded_and_when_set():
    with pytest.raises(ConfigError, match=r"train.block_size: 1 is outside its range: >= 2"):
        recipe_from_dict({"train": {"method": "dflash", "block_size": 1}})
    with pytest.raises(ConfigError, match=r"--set train.mask_token_id: -2 is outside its range: >= -1"):
        apply_sets(Recipe(), ["train.mask_token_id=-2"])
    assert apply_sets(Recipe(), ["train.method=dflash", "train.block_size=2"]).train.block_size == 2


def test_a_list_of_choices_checks_each_item():
    r = recipe_from_dict({"export": {"formats": ["both"]}})
    assert r.export.formats == ["both"]
    apply_sets(r, ["export.formats=vllm,sglang"])
    assert r.export.formats == ["vllm", "sglang"]
    with pytest.raises(ConfigError, match=r"^recipe: export\.formats: 'sgl' is not one of 'vllm', 'sglang', 'both'$"):
        recipe_from_dict({"export": {"formats": ["vllm", "sgl"]}})


def test_choices_are_exact():
    for value in ("Linear", " linear", 1):
        with pytest.raises(ConfigError, match="train.schedule"):
            recipe_from_dict({"train": {"schedule": value}})
    with pytest.raises(ConfigError, match=r"'auto' is not one of 'bfloat16', 'float16', 'float32'"):
        recipe_from_dict({"eval": {"dtype": "auto"}})  # eval casts the drafter too: no "auto" there


def test_expect_reasoning_takes_a_bool_s_spellings():
    assert recipe_from_dict({"gen": {"expect_reasoning": True}}).gen.expect_reasoning == "true"
    assert recipe_from_dict({"gen": {"expect_reasoning": False}}).gen.expect_reasoning == "false"
    r = Recipe()
    for spelled, value in (
        ("yes", "true"),
        ("On", "true"),
        ("1", "true"),
        ("no", "false"),
        ("OFF", "false"),
        ("0", "false"),
        ("auto", "auto"),
        ("true", "true"),
    ):
        apply_override(r, "gen.expect_reasoning", spelled)
        assert r.gen.expect_reasoning == value, spelled
    with pytest.raises(ConfigError, match=r"'maybe' is not one of 'auto', 'true', 'false'"):
        apply_override(r, "gen.expect_reasoning", "maybe")


def test_free_strings_stay_free():
    r = recipe_from_dict(
        {"gen": {"device": "cuda:1", "reasoning_effort": "minimal"}, "extract": {"device": "cpu", "device_map": "auto"}}
    )
    assert (r.gen.device, r.gen.reasoning_effort, r.extract.device_map) == ("cuda:1", "minimal", "auto")


def test_flag_help_names_the_choices(capsys):
    from specdraft.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.lower().split())
    assert "--schedule {cosine,linear}" in out
    assert "--lm-head-init {random,target,target-frozen}" in out
    assert "--epochs int" in out  # the other flags as before
