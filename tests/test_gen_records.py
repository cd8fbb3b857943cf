"""gen without a server: the record file's checks, reasoning splitting, config and flags."""

from __future__ import annotations

import json

import pytest

from specdraft.cli import build_parser
from specdraft.config import ConfigError, GenConfig, Recipe, apply_override
from specdraft.data.sources import DataError
from specdraft.stages.gen import expects_reasoning, finished_ids, split_reasoning


def test_a_malformed_record_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "conversations.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": []}) + "\n" + "{not json}\n" + json.dumps({"id": "b"}) + "\n")
    with pytest.raises(DataError, match=rf"{path}:2: not valid JSON"):
        finished_ids(path)
    path.write_text(json.dumps({"id": "a"}) + "\n" + json.dumps(["no", "id"]) + "\n")
    with pytest.raises(DataError, match=rf"{path}:2:"):
        finished_ids(path)


def test_a_torn_last_line_is_dropped_and_whole_lines_kept(tmp_path):
    path = tmp_path / "conversations.jsonl"
    whole = json.dumps({"id": "a"}) + "\n" + json.dumps({"id": "b"}) + "\n"
    path.write_text(whole + '{"id": "c", "mess')
    assert finished_ids(path) == {"a", "b"}
    assert path.read_text() == whole


THINK = ("<think>", "</think>")


@pytest.mark.parametrize(
    "message, expected",
    [
        ({"content": "A", "reasoning": "R"}, ("A", "R", "reasoning")),
        ({"content": "A", "reasoning": None, "reasoning_content": "R"}, ("A", "R", "reasoning_content")),
        ({"content": "<think>\nR\n</think>\n\nA"}, ("A", "R", "inline")),
        # The template opened the marker in the generation prompt: only the end marker is in the answer.
        ({"content": "R\n</think>\n\nA"}, ("A", "R", "inline")),
        # A marker quoted in the middle of an answer is not reasoning.
        ({"content": "Use <think>x</think> tags."}, ("Use <think>x</think> tags.", "", "none")),
        ({"content": "A", "reasoning": ""}, ("A", "", "none")),
        ({"content": None}, ("", "", "none")),
    ],
)
def test_reasoning_is_found_whatever_the_field(message, expected):
    assert split_reasoning(message, THINK) == expected


def test_inline_markers_come_from_the_target_not_a_constant():
    assert split_reasoning({"content": "<think>R</think>A"}, None) == ("<think>R</think>A", "", "none")
    assert split_reasoning({"content": "<reason>R</reason>A"}, ("<reason>", "</reason>")) == ("A", "R", "inline")


def test_expect_reasoning_auto_follows_the_target_and_the_template_switch():
    cfg = GenConfig()
    assert expects_reasoning(cfg, THINK) and not expects_reasoning(cfg, None)
    cfg.chat_template_kwargs = {"enable_thinking": False}
    assert not expects_reasoning(cfg, THINK)
    cfg.expect_reasoning = "true"
    assert expects_reasoning(cfg, None)
    cfg.expect_reasoning = "maybe"
    with pytest.raises(ConfigError, match="expect_reasoning"):
        expects_reasoning(cfg, None)


def test_chat_template_kwargs_from_a_flag_is_a_json_object():
    recipe = Recipe()
    apply_override(recipe, "gen.chat_template_kwargs", '{"enable_thinking": true}')
    assert recipe.gen.chat_template_kwargs == {"enable_thinking": True}
    with pytest.raises(ConfigError, match="gen.chat_template_kwargs: expected a JSON object"):
        apply_override(recipe, "gen.chat_template_kwargs", "enable_thinking=true")
    with pytest.raises(ConfigError, match="expected a table"):
        apply_override(recipe, "gen.chat_template_kwargs", "[1, 2]")


def test_gen_flags_take_repeated_endpoints_and_bare_switches():
    args = build_parser().parse_args(
        ["gen", "--endpoint", "http://a:1", "--endpoint", "http://b:2/v1", "--self-instruct", "--num-samples", "7"]
    )
    values = vars(args)
    assert values["gen.endpoints"] == ["http://a:1", "http://b:2/v1"]
    assert values["gen.self_instruct"] == "true" and values["gen.num_samples"] == "7"


def test_thinking_markers_of_the_bundled_target_and_a_family_override(target, monkeypatch):
    from specdraft import targets

    assert target.thinking_markers is None  # SmolLM2 does not think
    monkeypatch.setitem(targets.FAMILIES, "llama", targets.Family(thinking=("<reason>", "</reason>")))
    assert targets.Target("smollm2").thinking_markers == ("<reason>", "</reason>")


def test_render_reads_the_fields_gen_wrote_on_each_message(tmp_path):
    from specdraft.data.sources import read_jsonl

    answer = {
        "role": "assistant",
        "content": "A",
        "reasoning": "R",
        "reasoning_source": "reasoning",
        "token_ids": [1, 2, 3],
    }
    path = tmp_path / "conversations.jsonl"
    path.write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "Q"}, answer]}) + "\n")
    (record,) = read_jsonl(path)
    assert record["messages"][1] == answer
