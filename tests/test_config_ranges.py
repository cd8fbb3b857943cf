"""Every numeric field of a recipe declares its range where it is declared (config.Range), and no value
outside it reaches a stage: a recipe, a run's recorded recipe, a `--set` or a stage flag is refused with
one line naming the field, its value and the range, before anything is written. Cheap: no model runs
(plan reads the bundled target's config only)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdraft.cli import main
from specdraft.config import (
    ConfigError,
    Recipe,
    apply_sets,
    check_recipe,
    field_range,
    load_recipe,
    recipe_from_dict,
    to_dict,
)

SECTIONS = {name: tp for name, tp in typing.get_type_hints(Recipe).items() if dataclasses.is_dataclass(tp)}


def _numeric(tp) -> type | None:
    """int or float for a numeric field (or a list of them), else None."""
    item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
    return item if item in (int, float) else None


def numeric_fields() -> list[tuple[str, type, str, type, bool]]:
    """(section, its class, field, int or float, is a list) of every numeric field; section "" is the
    recipe's own top level."""
    out = []
    for section, cls in [("", Recipe), *SECTIONS.items()]:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _numeric(hints[f.name])
            if kind is not None:
                out.append((section, cls, f.name, kind, typing.get_origin(hints[f.name]) is list))
    return out


FIELDS = numeric_fields()
R = " is outside its range: "  # the error line's words between the value and its range
DOTTED = re.compile(r"\b(?:target|data|gen|render|extract|train|export|eval)\.[a-z_]+")


def test_every_numeric_field_declares_its_range():
    """A field added without a Range fails here, not in a user's run."""
    missing = [f"{s}.{name}" for s, cls, name, _, _ in FIELDS if field_range(cls, name) is None]
    assert not missing, f"numeric fields without a Range: {missing}"
    # every section but export (its formats only; K is eval.draft_tokens) has numbers
    assert len(FIELDS) >= 60 and {s for s, *_ in FIELDS} == set(SECTIONS) - {"export"}


def test_the_shipped_recipes_and_the_defaults_are_in_range():
    from specdraft.config import RECIPES_DIR
    from specdraft.methods import named

    for path in sorted(RECIPES_DIR.glob("*.toml")):
        recipe = load_recipe(str(path))
        named(recipe.train.method).check(recipe)  # its method's own ranges too
    recipe = check_recipe(Recipe())
    for section, cls, name, _, _ in FIELDS:
        value = getattr(getattr(recipe, section) if section else recipe, name)
        for item in value if isinstance(value, list) else [value]:
            assert field_range(cls, name).contains(item), (section, name, item)


def test_the_user_docs_list_every_range_as_declared():
    """docs/configuration.md's table is the declared ranges, field by field: it cannot drift from them."""
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    for section, cls, name, _, _ in FIELDS:
        row = f"| `{section}.{name}` | {field_range(cls, name).describe()} |"
        assert row in docs, f"docs/configuration.md lacks: {row}"


# --- the property: load exactly, or one line naming the field ----------------------------------------

SPECIAL = [
    0,
    1,
    -1,
    2,
    7,
    10**30,
    -(10**30),
    2**63,
    2**64 + 1,
    0.0,
    -0.0,
    0.5,
    2.5,
    3.0,
    -1.5,
    1e-320,
    1e300,
    -1e300,
    math.inf,
    -math.inf,
    math.nan,
    True,
    False,
]
TEXTS = ["1e3", " 7 ", "0x10", "1_000", "+5", "-0", "3.0", "nan", "inf", "-inf", "1e400", "", "abc", "1,2"]


def _bounds(rng, kind) -> list:
    """Each finite bound, and the numbers just past and just inside it."""
    out = []
    for b in (rng.low, rng.high):
        if b is not None:
            step = [1] if kind is int else [math.nextafter(b, math.inf) - b, 1e-9]
            out += [b, *(b + s for s in step), *(b - s for s in step)]
    return [kind(v) if kind is int else float(v) for v in out]


def values(cls, name: str, kind) -> st.SearchStrategy:
    """In range, at and past its bounds, negative, zero, huge, inf, nan, a float for an int, a bool."""
    rng = field_range(cls, name)
    if kind is int:
        inside = st.integers(min_value=rng.low, max_value=rng.high)
        anything = st.integers()
    else:
        inside = st.floats(
            min_value=rng.low,
            max_value=rng.high,
            exclude_min=rng.low_open,
            exclude_max=rng.high_open,
            allow_nan=False,
            allow_infinity=False,
        )
        anything = st.floats()
    return st.one_of(st.sampled_from(SPECIAL + _bounds(rng, kind)), inside, anything)


def meant(kind, value):
    """The number `value` means for a field of `kind` (a flag's text as int() / float() read it), or
    None where it is no such number: a bool, a float with a fraction for an int, text that is no number."""
    if isinstance(value, bool):
        return None
    try:
        if isinstance(value, str):
            return kind(value.strip())
        if isinstance(value, int):
            return kind(value)
        if kind is int:
            return int(value) if float(value).is_integer() else None
        return float(value)
    except (ValueError, OverflowError):
        return None


def check_outcome(load, section: str, name: str, kind, is_list: bool, value) -> None:
    """`load()` gives a recipe holding exactly the number `value` means, in its range; or raises one
    ConfigError line naming the field (and, where the number is in range, the other field it disagrees
    with). Any other exception fails the test as it is."""
    cls = SECTIONS[section]
    dotted = f"{section}.{name}"
    number = meant(kind, value)
    valid = number is not None and field_range(cls, name).contains(number)
    try:
        recipe = load()
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message and dotted in message, message
        if valid:  # refused only by a check across fields: the line names the other field too
            assert len(set(DOTTED.findall(message))) >= 2, message
        return
    got = getattr(getattr(recipe, section), name)
    got = got[0] if is_list else got
    assert valid, f"{dotted} = {value!r} was accepted as {got!r}"
    assert type(got) is kind and got == number, f"{dotted} = {value!r} became {got!r}"


NUMERIC = [(s, n, k, lst) for s, _, n, k, lst in FIELDS if s]
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("section, name, kind, is_list", NUMERIC, ids=[f"{s}.{n}" for s, n, _, _ in NUMERIC])
@PROPERTY
@given(data=st.data())
def test_a_drawn_number_loads_exactly_or_is_one_line_naming_its_field(section, name, kind, is_list, data):
    cls = SECTIONS[section]
    value = data.draw(st.one_of(values(cls, name, kind), st.sampled_from(TEXTS)), label="recipe value")
    check_outcome(
        lambda: recipe_from_dict({section: {name: [value] if is_list else value}}, "r.toml"),
        section,
        name,
        kind,
        is_list,
        value,
    )
    # The same number as a flag gives it: text, through --set (a list field takes one item).
    text = data.draw(st.one_of(values(cls, name, kind).map(repr), st.sampled_from(TEXTS)), label="--set text")
    if not (is_list and ("," in text or not text.strip())):  # "" is the empty list, "1,2" two items
        check_outcome(lambda: apply_sets(Recipe(), [f"{section}.{name}={text}"]), section, name, kind, is_list, text)


# --- across fields, and the fields the target sets ---------------------------------------------------


@pytest.mark.parametrize(
    "sets, named",
    [
        (["gen.backoff_s=100"], f"gen.backoff_s: 100.0{R}<= gen.backoff_max_s = 60.0"),
        (
            ["render.max_length=256", "data.max_prompt_tokens=256"],
            f"data.max_prompt_tokens: 256{R}< render.max_length = 256",
        ),
        (["gen.max_new_tokens=100000000"], f"gen.max_new_tokens: 100000000{R}<= render.max_length = 2048"),
        (["eval.tree_topk=1", "eval.tree_depth=2"], f"eval.tree_tokens: 16{R}<= 2"),
    ],
)
def test_fields_that_disagree_are_refused_once_every_flag_is_in(sets, named):
    with pytest.raises(ConfigError) as e:
        apply_sets(Recipe(), sets)
    assert named in str(e.value)


@pytest.mark.parametrize(
    "sets, named",
    [
        (["train.batch_tokens=1"], f"train.batch_tokens: 1{R}>= train.ttt_steps + 2 = "),
        (["train.method=dflash", "train.block_size=4096"], f"train.block_size: 4096{R}<= "),
    ],
)
def test_a_methods_own_ranges_are_refused_by_the_stages_that_train_it(sets, named, tmp_path, monkeypatch, capsys):
    """The drafter method's package checks its fields (Method.check): train before the run is written,
    plan before its bill; the stages that never train a drafter take the recipe."""
    from specdraft.methods import named as method_named

    recipe = apply_sets(Recipe(), sets)  # the recipe loads
    with pytest.raises(ConfigError, match=re.escape(named)):
        method_named(recipe.train.method).check(recipe)
    monkeypatch.chdir(tmp_path)
    for argv in (["train"], ["plan", "smollm2-cpu"]):
        assert main([*argv, *(a for s in sets for a in ("--set", s))]) == 2
        assert named in _one_error(capsys)
    assert list(tmp_path.iterdir()) == []


def test_only_the_end_state_of_the_flags_is_checked_across_fields(tmp_path, monkeypatch, capsys):
    """One at a time, flags may pass through a combination that is not meant; a recipe file holding one
    is named."""
    sets = ["gen.backoff_max_s=600", "gen.backoff_s=100", "gen.backoff_max_s=200"]
    assert apply_sets(Recipe(), sets).gen.backoff_s == 100
    with pytest.raises(ConfigError, match=r"^x.toml: gen.backoff_s: 9.0 "):
        recipe_from_dict({"gen": {"backoff_s": 9.0, "backoff_max_s": 1.0}}, "x.toml")
    # A stage's flags come after its --set items (run.open_run): the pair is checked once both are in.
    monkeypatch.chdir(tmp_path)
    argv = [
        "gen",
        "--run",
        "r",
        "--set",
        "render.max_length=64",
        "--max-new-tokens",
        "32",
        "--set",
        "data.max_prompt_tokens=16",
        "--set",
        "gen.model=x",
        "--endpoint",
        "http://127.0.0.1:9",
        "--set",
        "data.source=/no/such.jsonl",
    ]
    assert main(argv) == 2
    assert "/no/such.jsonl" in _one_error(capsys)  # past the ranges, to the stage itself


def test_the_target_sets_the_vocabulary_and_the_context():
    from specdraft.drafters.common import within_vocab
    from specdraft.methods import named as method_named
    from specdraft.targets import Target

    smollm2 = Target("smollm2")  # config only: no weights are read
    vocab = smollm2.vocab_size
    smollm2.check_fits(Recipe())
    for sets, named in (
        (["train.draft_vocab_size=100000"], f"train.draft_vocab_size: 100000{R}<= {vocab:,}"),
        (["render.max_length=100000"], f"render.max_length: 100000{R}<= 8,192"),
        (["eval.max_new_tokens=8000"], f"eval.max_new_tokens: 8000{R}<= 7,680"),
    ):
        with pytest.raises(ConfigError) as e:
            smollm2.check_fits(apply_sets(Recipe(), sets))
        assert named in str(e.value), e.value
    # A method's own fields, by its package, where train and plan read the target.
    mask = apply_sets(Recipe(), ["train.method=dflash", f"train.mask_token_id={vocab}"])
    with pytest.raises(ConfigError, match=f"train.mask_token_id: {vocab} is outside"):
        method_named(mask.train.method).check_target(mask, vocab, smollm2.name)
    method_named(mask.train.method).check_target(apply_sets(mask, [f"train.mask_token_id={vocab - 1}"]), vocab, "x")
    # No drafter is built past the vocabulary either: refused, not cut to it.
    assert within_vocab(0, vocab) == vocab and within_vocab(512, vocab) == 512
    with pytest.raises(ValueError, match="train.draft_vocab_size: 100000 is outside"):
        within_vocab(100000, vocab)


def test_a_device_this_machine_lacks_is_one_line_naming_the_field():
    import torch

    from specdraft.targets import TargetError, resolve_device

    with pytest.raises(TargetError, match=r"^eval.device: 'nonsense' is not a torch device"):
        resolve_device("nonsense", "eval.device")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(TargetError, match=r"^eval.device: 'cuda' but torch sees no CUDA device"):
        resolve_device("cuda", "eval.device")
    assert resolve_device("cpu", "eval.device") == "cpu"


# --- through the command line: exit 2, one line, nothing written -------------------------------------


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specdraft: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["train", "--set", "train.grad_clip=-1"], f"--set train.grad_clip: -1.0{R}> 0"),
        (["train", "--set", "train.lr=inf"], f"--set train.lr: inf{R}> 0 (finite numbers only)"),
        (["train", "--epochs", "0"], f"train.epochs: 0{R}>= 1"),
        (["eval", "--set", "eval.max_new_tokens=0"], f"--set eval.max_new_tokens: 0{R}>= 1"),
        (["gen", "--set", "gen.top_p=5"], f"--set gen.top_p: 5.0{R}> 0 and <= 1"),
        (["demo", "--set", "gen.backoff_s=100"], f"gen.backoff_s: 100.0{R}<= gen.backoff_max_s"),
        (["plan", "smollm2-cpu", "--set", "train.batch_tokens=0"], f"--set train.batch_tokens: 0{R}>= 1"),
        (
            ["plan", "smollm2-cpu", "--set", "train.draft_vocab_size=100000"],
            f"train.draft_vocab_size: 100000{R}<= 49,152",
        ),
        (["import", "drafter", "--out", "out", "--set", "train.holdout=2"], f"--set train.holdout: 2.0{R}>= 0 and < 1"),
    ],
)
def test_the_command_line_refuses_before_anything_is_written(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert says in _one_error(capsys)
    assert list(tmp_path.iterdir()) == []  # no runs/, no manifest, no out/


def test_plan_of_a_run_and_the_run_refuse_what_its_recorded_recipe_cannot_hold(tmp_path, monkeypatch, capsys):
    """`plan RUN --set` refuses like the stages and records nothing; a recorded recipe holding a value out
    of range (a run written before the ranges) is named with its manifest, not met as a traceback."""
    from specdraft.run import RunFolder

    monkeypatch.chdir(tmp_path)
    folder = RunFolder(tmp_path / "r")
    folder.init(load_recipe("smollm2-cpu"))
    manifest = folder.manifest_path.read_text()
    assert main(["plan", "r", "--set", "eval.num_prompts=0"]) == 2
    assert "--set eval.num_prompts: 0 is outside its range: >= 1" in _one_error(capsys)
    assert folder.manifest_path.read_text() == manifest  # no plan recorded
    recorded = json.loads(manifest)
    recorded["recipe"]["train"]["micro_batches"] = 0
    folder.manifest_path.write_text(json.dumps(recorded))
    for argv in (["plan", "r"], ["train", "--run", "r"]):
        assert main(argv) == 2
        line = _one_error(capsys)
        assert "r/manifest.json: train.micro_batches: 0 is outside its range: >= 1" in line, line


def test_a_recorded_recipe_round_trips():
    """What a run records (to_dict) loads back as the same recipe: the ranges refuse nothing it wrote."""
    recipe = load_recipe("smollm2-h200")
    assert recipe_from_dict(to_dict(recipe)) == recipe
