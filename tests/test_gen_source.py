"""gen.answers = "source" (the source's own answers to the prompts in-process gen would ask) and
data.num_train = 0 (every usable conversation). No model is loaded: these run in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdraft.cli import main
from specdraft.config import ConfigError, load_recipe
from specdraft.data.sources import DataError, read_sharegpt
from specdraft.data.tokens import load_tokens
from specdraft.run import RunFolder
from specdraft.stages import gen as generate
from specdraft.stages.gen import num_samples, select_prompts

LONG_PROMPT_WORDS = 200  # far over the small-source recipe's max_prompt_tokens


def _lines(run_dir: Path) -> list[str]:
    return (RunFolder(run_dir).conversations).read_text(encoding="utf-8").splitlines(keepends=True)


def _answer_after(messages: list[dict], n: int) -> str | None:
    """The source's answer to the prompt of its first n messages: the assistant turn right after it."""
    following = messages[n : n + 1]
    if following and following[0]["role"] == "assistant" and following[0]["content"].strip():
        return following[0]["content"]
    return None


def _gen_counts(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())["stages"]["gen"]["counts"]


@pytest.fixture
def source_run(tmp_path, tiny_recipe) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    assert main(["gen", "--recipe", str(tiny_recipe), "--run", str(run_dir), "--answers", "source"]) == 0
    return tiny_recipe, run_dir


def test_source_answers_for_the_prompts_in_process_gen_asks_then_render(source_run, target):
    recipe_path, run_dir = source_run
    recipe = load_recipe(str(recipe_path))
    chosen, too_long = select_prompts(recipe, target, "train", num_samples(recipe))
    records = [json.loads(line) for line in _lines(run_dir)]
    originals = {c["id"]: c["messages"] for c in read_sharegpt() if c["id"] in {p["id"] for p in chosen}}

    # The same prompts, ids and order as in-process gen; those without an answer after the prompt skipped.
    answered = [p for p in chosen if _answer_after(originals[p["id"]], len(p["messages"]))]
    assert [r["id"] for r in records] == [p["id"] for p in answered]
    counts = _gen_counts(run_dir)
    assert counts["skipped_no_answer"] == len(chosen) - len(answered)
    assert counts["skipped_too_long"] == too_long and counts["records"] == len(records) > 0
    for r, p in zip(records, answered):
        assert r["messages"][:-1] == p["messages"]
        assert r["messages"][-1] == {
            "role": "assistant",
            "content": _answer_after(originals[p["id"]], len(p["messages"])),
        }
        assert r["generator"] == {"kind": "source", "source": "sharegpt"}
        assert "token_ids" not in r["messages"][-1]

    # render takes them as they are: the trained tokens are the original answer through the template.
    assert main(["render", "--run", str(run_dir)]) == 0
    index, samples = load_tokens(RunFolder(run_dir).tokens)
    assert index["ids"] == [r["id"] for r in records]
    tok = target.tokenizer
    max_length = recipe.render.max_length
    for r, p, (ids, mask) in zip(records, answered, samples):
        prompt_text = tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
        full_text = tok.apply_chat_template(r["messages"], tokenize=False)
        assert full_text.startswith(prompt_text)
        # The turn ends at the end-of-turn token; the template's newline after it is not trained.
        answer_text = full_text[len(prompt_text) :].removesuffix("\n")
        expected = tok.encode(answer_text, add_special_tokens=False)
        assert expected[-1] == target.eos_token_id
        assert ids[: len(p["prompt_ids"])] == p["prompt_ids"]
        trained = [t for t, m in zip(ids, mask) if m]
        assert trained == expected[: max_length - len(p["prompt_ids"])]


def test_resume_after_a_cut_ends_with_the_same_file_and_no_duplicates(source_run):
    recipe_path, run_dir = source_run
    whole = _lines(run_dir)
    kept = len(whole) // 2
    # `kept` whole lines and a torn one, as kill -9 mid-write leaves them.
    (RunFolder(run_dir).conversations).write_text("".join(whole[:kept]) + whole[kept][: len(whole[kept]) // 2])
    assert main(["gen", "--recipe", str(recipe_path), "--run", str(run_dir), "--answers", "source"]) == 0
    assert _lines(run_dir) == whole
    counts = _gen_counts(run_dir)
    assert counts["already_done"] == kept and counts["written"] == len(whole) - kept


def test_a_run_folder_keeps_one_kind_of_answers(source_run):
    recipe_path, run_dir = source_run
    recipe = load_recipe(str(recipe_path))  # gen.answers = "target"
    with pytest.raises(DataError, match="holds source answers"):
        generate.run(recipe, RunFolder(run_dir))
    recipe.gen.answers = "original"
    with pytest.raises(ConfigError, match="gen.answers"):
        generate.run(recipe, RunFolder(run_dir))


SMALL_RECIPE = """
name = "small-source"
[data]
source = "{source}"
num_train = 0
eval_fraction = 0.0
max_prompt_tokens = 64
"""


@pytest.fixture
def small_source(tmp_path) -> Path:
    """Five usable conversations (first turn the user's): two with an answer right after the prompt,
    one unanswered, one answered only after a second user turn, one too long; and one unusable."""
    user, answer = {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}
    convs = {
        "answered": [user, answer],
        "system": [{"role": "system", "content": "Be brief."}, user, answer],
        "unanswered": [user],
        "second-user": [user, {"role": "user", "content": "Another?"}, answer],
        "too-long": [{"role": "user", "content": "word " * LONG_PROMPT_WORDS}, answer],
        "assistant-first": [answer, user],
    }
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps({"id": k, "messages": v}) + "\n" for k, v in convs.items()))
    recipe = tmp_path / "small.toml"
    recipe.write_text(SMALL_RECIPE.format(source=source))
    return recipe


def test_num_train_0_selects_every_usable_conversation(small_source, target, tmp_path):
    recipe = load_recipe(str(small_source))
    assert num_samples(recipe) is None
    chosen, too_long = select_prompts(recipe, target, "train", num_samples(recipe))
    assert [p["id"] for p in chosen] == ["answered", "system", "unanswered", "second-user"] and too_long == 1

    run_dir = tmp_path / "run"
    assert main(["gen", "--recipe", str(small_source), "--run", str(run_dir), "--answers", "source"]) == 0
    assert [json.loads(line)["id"] for line in _lines(run_dir)] == ["answered", "system"]
    counts = _gen_counts(run_dir)
    assert (counts["prompts"], counts["skipped_no_answer"], counts["skipped_too_long"]) == (4, 2, 1)

    from specdraft.billing import expected_tokens

    # The plan counts without the tokenizer: the too-long prompt is in its upper bound.
    assert expected_tokens(recipe, None, 1)["samples"] == 5


def test_num_train_0_asks_the_servers_for_every_usable_conversation(small_source, tmp_path, monkeypatch):
    asked = {}

    async def ask_nobody(self, target_n, done, items=None):
        """What run_server asks ServerGen.run for, kept; nothing is sent or saved."""
        asked.update(target_n=target_n, ids=[it["id"] for it in items])
        self.counts.update(saved_this_run=0, requests=0)
        self.retries = {}

    monkeypatch.setattr(generate.ServerGen, "run", ask_nobody)
    recipe = load_recipe(str(small_source))
    recipe.gen.endpoints = ["http://127.0.0.1:9"]  # never reached: ServerGen.run is replaced
    run = RunFolder(tmp_path / "run")
    run.init(recipe)
    generate.run(recipe, run)
    assert asked == {"target_n": 4, "ids": ["answered", "system", "unanswered", "second-user"]}
    assert _gen_counts(run.path)["target"] == 4


def test_plan_and_status_of_every_conversation_with_source_answers(small_source, tmp_path):
    from specdraft.stages.status import collect, render_markdown

    recipe = load_recipe(str(small_source))
    recipe.gen.answers = "source"
    run = RunFolder(tmp_path / "run")
    run.init(recipe)
    # gen cut off after one record: how many make it done is known only to gen.
    (run.conversations).write_text(json.dumps({"id": "answered"}) + "\n")
    assert main(["plan", str(run.path), "--no-calibrate"]) == 0
    gen_time = next(r for r in run.manifest()["plan"]["time"] if r["phase"] == "gen")
    assert gen_time["seconds"] == 0.0  # nothing is generated
    status = collect(run)
    assert "all train-split" in status["goal"]["text"] and "the source's own answers" in status["goal"]["text"]
    gen = next(s for s in status["stages"] if s["stage"] == "gen")
    assert gen["state"] == "in progress" and gen["progress"]["of"] == "all" and gen["progress"]["fraction"] is None
    assert "1 of all conversations" in render_markdown(status)
