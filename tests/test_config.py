import pytest

from specdraft.config import ConfigError, apply_override, load_recipe, recipe_from_dict


def test_bundled_recipe_fills_dataclasses():
    r = load_recipe("smollm2-cpu")
    assert r.target.model == "smollm2"
    assert r.eval.draft_tokens == 3
    assert r.export.formats == ["vllm"]


def test_unknown_key_is_an_error_not_ignored():
    with pytest.raises(ConfigError, match="unknown key"):
        recipe_from_dict({"train": {"epochz": 3}})


def test_k_is_declared_once_and_the_old_name_still_loads():
    """export.speculative_tokens was a second K: a recipe or a recorded run naming it loads, as eval.draft_tokens."""
    from specdraft.config import ExportConfig, Recipe, apply_sets

    assert not hasattr(ExportConfig(), "speculative_tokens")
    assert recipe_from_dict({"export": {"speculative_tokens": 2}}).eval.draft_tokens == 2
    same = {"export": {"speculative_tokens": 4, "formats": ["vllm"]}, "eval": {"draft_tokens": 4}}
    assert recipe_from_dict(same, "m.json").eval.draft_tokens == 4 and same["export"]["speculative_tokens"] == 4
    with pytest.raises(ConfigError, match=r"^m.json: export.speculative_tokens = 2 and eval.draft_tokens = 3: "):
        recipe_from_dict({"export": {"speculative_tokens": 2}, "eval": {"draft_tokens": 3}}, "m.json")
    assert apply_sets(Recipe(), ["export.speculative_tokens=5"]).eval.draft_tokens == 5


def test_overrides_are_typed():
    r = load_recipe("smollm2-cpu")
    apply_override(r, "train.epochs", "3")
    apply_override(r, "target.aux_layer_ids", "3,10,20")
    assert r.train.epochs == 3 and r.target.aux_layer_ids == [3, 10, 20]
    with pytest.raises(ConfigError, match="expected int"):
        apply_override(r, "train.epochs", "three")
    with pytest.raises(ConfigError, match="no field"):
        apply_override(r, "train.nope", "1")


def test_missing_recipe_names_the_choices():
    with pytest.raises(ConfigError, match="smollm2-cpu"):
        load_recipe("no-such-recipe")


def test_a_value_outside_a_field_s_choices_names_the_field_and_the_choices(tmp_path):
    path = tmp_path / "recipe.toml"
    path.write_text('[train]\nschedule = "cosin"\n')
    with pytest.raises(ConfigError) as e:
        load_recipe(str(path))
    assert str(e.value) == f"{path}: train.schedule: 'cosin' is not one of 'cosine', 'linear'"


def test_a_valid_choice_loads_as_a_plain_str(tmp_path):
    path = tmp_path / "recipe.toml"
    path.write_text('[train]\nschedule = "linear"\nloss = "kl"\n[extract]\nstore_dtype = "fp8_e4m3"\n')
    r = load_recipe(str(path))
    assert (r.train.schedule, r.train.loss, r.extract.store_dtype) == ("linear", "kl", "fp8_e4m3")
    assert type(r.train.schedule) is str
    apply_override(r, "train.loss", "lk")
    assert r.train.loss == "lk"
