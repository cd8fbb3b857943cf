"""render: the real SmolLM2 template on real ShareGPT conversations, the thinking-model templates
(tests/data/templates, on the SmolLM2 tokenizer with their marker tokens added), the target's own ids,
and mismatch reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdraft.stages.render import ChatTemplate, RenderError, TemplateMismatch, render_conversation

TEMPLATES = Path(__file__).parent / "data" / "templates"
# Each thinking template: its file, the special tokens its format needs, its end-of-turn token (the
# eos the model emits), its bos, template kwargs, the field render should pass reasoning in.
FORMATS = {
    "qwen3": ("qwen3.jinja", [], "<|im_end|>", None, {}, "reasoning_content"),
    "qwen3-instruct": ("qwen3.jinja", [], "<|im_end|>", None, {"enable_thinking": False}, "reasoning_content"),
    "qwen3-thinking-2507": ("qwen3-thinking-2507.jinja", [], "<|im_end|>", None, {}, "reasoning_content"),
    "deepseek-r1": (
        "deepseek-r1.jinja",
        ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>",
        {},
        "wrapped",
    ),
    "kimi-k2": (
        "kimi-k2.jinja",
        ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"],
        "<|im_end|>",
        None,
        {},
        "wrapped",
    ),
    "gpt-oss": (
        "gpt-oss.jinja",
        ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"],
        "<|return|>",
        None,
        {},
        "thinking",
    ),
}
# What each model generates after its generation prompt for reasoning R and answer A, written out from
# the public formats (not from the templates): (end of the generation prompt, generated text before the
# end-of-turn token, what the template writes after that token).
SERVED = {
    "qwen3": ("<|im_start|>assistant\n", "<think>\n{R}\n</think>\n\n{A}", "\n"),
    "qwen3-instruct": ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "{A}", "\n"),
    "qwen3-thinking-2507": ("<|im_start|>assistant\n<think>\n", "{R}\n</think>\n\n{A}", "\n"),
    "deepseek-r1": ("<｜Assistant｜><think>\n", "{R}\n</think>\n\n{A}", ""),
    "kimi-k2": ("<|im_assistant|>assistant<|im_middle|>", "<think>{R}</think>{A}", ""),
    "gpt-oss": (
        "<|start|>assistant",
        "<|channel|>analysis<|message|>{R}<|end|><|start|>assistant<|channel|>final<|message|>{A}",
        "",
    ),
}
REASONING = ["The user asks for 2+2.\nTwo plus two makes four.", "Now 3+3: three and three is six."]
ANSWERS = ["2 + 2 = 4.", "It is 6."]


def thinking_conversation(with_reasoning: bool = True) -> dict:
    turns = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": ANSWERS[0], "reasoning": REASONING[0]},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": ANSWERS[1], "reasoning": REASONING[1]},
    ]
    if not with_reasoning:
        turns = [{k: v for k, v in m.items() if k != "reasoning"} for m in turns]
    return {"id": "think-1", "messages": turns}


@pytest.fixture(scope="module")
def make_template(target):
    from transformers import AutoTokenizer

    def make(fmt: str) -> ChatTemplate:
        name, tokens, eos, bos, kwargs, _ = FORMATS[fmt]
        tok = AutoTokenizer.from_pretrained(target.path)
        tok.add_tokens(tokens, special_tokens=True)
        tok.add_tokens(["<think>", "</think>"])  # added, not special: as in Qwen3's and Kimi's tokenizers
        tok.chat_template = (TEMPLATES / name).read_text()
        tok.eos_token = eos
        if bos:
            tok.bos_token = bos
        return ChatTemplate(tok, template_kwargs=kwargs)

    return make


@pytest.fixture(scope="module")
def sharegpt_multiturn():
    """Real ShareGPT conversations with at least two assistant turns, short enough to render fast."""
    from specdraft.data.sources import read_sharegpt

    out = []
    for conv in read_sharegpt():
        m = conv["messages"]
        if (
            m[0]["role"] == "user"
            and sum(x["role"] == "assistant" for x in m) >= 2
            and sum(len(x["content"]) for x in m) < 4000
        ):
            out.append(conv)
        if len(out) == 40:
            break
    return out


def masked(sample) -> list[int]:
    ids, mask = sample
    return [t for t, k in zip(ids, mask) if k]


def test_sharegpt_multiturn_renders_as_the_template_with_only_answers_masked(target, sharegpt_multiturn):
    template = ChatTemplate.of_target(target)
    eos = target.eos_token_id
    for conv in sharegpt_multiturn:
        messages = conv["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        r = render_conversation(template, conv, max_length=100_000)
        assert r.mismatches == [] and len(r.samples) == 1, conv["id"]
        ids, mask = r.samples[0]
        # ChatML keeps every turn as it was: the sample is the template's own rendering of the whole chat.
        assert ids == target.chat_ids(messages[: last + 1], add_generation_prompt=False)
        expected_mask = [0] * len(ids)
        for i, m in enumerate(messages[: last + 1]):
            if m["role"] == "assistant":
                start = len(target.chat_ids(messages[:i], add_generation_prompt=True))
                end = len(target.chat_ids(messages[: i + 1], add_generation_prompt=False)) - 1  # the "\n"
                assert ids[end - 1] == eos
                expected_mask[start:end] = [1] * (end - start)
        assert mask == expected_mask, conv["id"]
        assert r.turns == sum(m["role"] == "assistant" for m in messages)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_thinking_templates_render_each_turn_as_the_model_generated_it(fmt, make_template):
    template = make_template(fmt)
    tok = template.tokenizer
    eos = tok.convert_tokens_to_ids(FORMATS[fmt][2])
    assert template.describe()["reasoning"] == FORMATS[fmt][5]
    prompt_end, generated, after = SERVED[fmt]
    conv = thinking_conversation(with_reasoning=fmt != "qwen3-instruct")
    r = render_conversation(template, conv, max_length=100_000)
    assert r.mismatches == []
    # Every template here drops the first turn's reasoning (or, for ChatML-style Qwen3 instruct, its
    # empty think block) once the user speaks again: the second turn is trained in a sample of its own.
    assert len(r.samples) == 2
    for k, (turn, sample) in enumerate(zip((1, 3), r.samples)):
        history = conv["messages"][:turn]
        prompt_text = tok.apply_chat_template(
            [{"role": x["role"], "content": x["content"]} for x in history],
            add_generation_prompt=True,
            tokenize=False,
            **template.template_kwargs,
        )
        assert prompt_text.endswith(prompt_end)
        if k == 1:
            # The context is the history as the template renders it for serving: no earlier reasoning.
            assert REASONING[0] not in tok.decode(sample[0])
        text = generated.format(R=REASONING[k], A=ANSWERS[k])
        body = template.encode(text) + [eos]
        assert sample[0] == template.encode(prompt_text) + body + template.encode(after)
        assert masked(sample) == body
        assert sample[1] == [0] * len(template.encode(prompt_text)) + [1] * len(body) + [0] * len(
            template.encode(after)
        )


def test_a_prompt_that_opens_the_think_block_gets_it_closed_even_without_reasoning(make_template):
    template = make_template("deepseek-r1")
    r = render_conversation(template, thinking_conversation(with_reasoning=False), max_length=100_000)
    eos = template.tokenizer.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    assert r.mismatches == []
    assert masked(r.samples[0]) == template.encode(f"\n</think>\n\n{ANSWERS[0]}") + [eos]


def test_the_targets_own_ids_are_trained_and_retokenization_is_reported(target):
    template = ChatTemplate.of_target(target)
    tok = target.tokenizer
    answer = "First line.\n\nSecond line."
    retokenized = tok.encode(answer, add_special_tokens=False) + [target.eos_token_id]
    newline, double_newline = tok.convert_tokens_to_ids(["Ċ", "ĊĊ"])
    at = retokenized.index(newline)
    assert retokenized[at + 1] == newline
    # The target emitted one "\n\n" token where the tokenizer makes two "\n" (docs/engine-facts.md: such splits change
    # 15 % of SmolLM2's answers): same text, other ids.
    own = retokenized[:at] + [double_newline] + retokenized[at + 2 :]
    assert tok.decode(own) == tok.decode(retokenized)
    conv = {
        "id": "own",
        "messages": [
            {"role": "user", "content": "Two lines please."},
            {"role": "assistant", "content": answer, "token_ids": own},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You're welcome."},
        ],
    }
    r = render_conversation(template, conv, max_length=100_000)
    assert r.turns_with_ids == 1 and r.retokenized_differs == 1
    (m,) = r.mismatches
    assert (m.kind, m.turn, m.position) == ("retokenized", 1, at)
    assert "ours '\\n\\n' (1116)" in str(m) and "re-tokenized '\\n' (198)" in str(m)
    # The first turn trains on the target's own ids; the server re-tokenizes that history for the next
    # turn, so the second turn gets a sample whose context is the re-tokenized text.
    assert len(r.samples) == 2
    assert masked(r.samples[0]) == own
    prompt = target.chat_ids(conv["messages"][:3], add_generation_prompt=True)
    assert r.samples[1][0][: len(prompt)] == prompt
    assert tok.decode(masked(r.samples[1])) == "You're welcome.<|im_end|>"


def test_older_records_answer_token_ids_and_a_turn_cut_short(target):
    template = ChatTemplate.of_target(target)
    cut = target.tokenizer.encode("An answer that was cut", add_special_tokens=False)
    record = {
        "id": "old",
        "messages": [
            {"role": "user", "content": "Say something."},
            {"role": "assistant", "content": "An answer that was cut"},
        ],
        "answer_token_ids": cut,
    }
    r = render_conversation(template, record, max_length=100_000)
    ids, mask = r.samples[0]
    # No end-of-turn token was generated, so none is trained and nothing follows the answer.
    assert masked(r.samples[0]) == cut and ids[-len(cut) :] == cut
    assert r.turns_with_ids == 1 and r.retokenized_differs == 0


def test_a_template_mismatch_names_the_first_differing_token(make_template):
    # Thinking switched off in the prompt, yet the record has reasoning: the prompt's empty think block
    # cannot be a prefix of the turn as rendered with its reasoning.
    template = make_template("qwen3-instruct")
    conv = thinking_conversation(with_reasoning=True)
    with pytest.raises(
        TemplateMismatch,
        match=r"conversation think-1 turn 1: prefix mismatch at token \d+: "
        r"ours .* vs template .*",
    ):
        render_conversation(template, conv, max_length=100_000)
    # With the target's own ids the turn is still trained as generated, and the mismatch is reported.
    tok = template.tokenizer
    own = tok.encode(ANSWERS[0], add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    conv["messages"][1]["token_ids"] = own
    conv["messages"] = conv["messages"][:2]
    r = render_conversation(template, conv, max_length=100_000)
    assert [m.kind for m in r.mismatches] == ["prefix", "retokenized"]
    assert masked(r.samples[0]) == own


def test_reasoning_without_markers_or_field_is_an_error(target):
    template = ChatTemplate.of_target(target)
    assert template.reasoning_field is None and template.markers is None
    with pytest.raises(RenderError, match="thinking markers"):
        render_conversation(template, thinking_conversation(), max_length=100_000)


def test_sources_keep_the_gen_fields_and_name_a_bad_line(tmp_path):
    from specdraft.data.sources import DataError, read_jsonl

    good = {
        "id": "a",
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "a",
                "reasoning": "r",
                "reasoning_source": "reasoning",
                "token_ids": [1, 2],
            },
        ],
    }
    bad = {
        "id": "b",
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "token_ids": ["x"]}],
    }
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    records = read_jsonl(path)
    assert next(records)["messages"][1] == good["messages"][1]
    with pytest.raises(DataError, match=rf"{path}:2: message 1 field 'token_ids'"):
        next(records)


def test_the_stage_names_the_file_and_conversation_it_cannot_render(tmp_path, tiny_recipe, capsys):
    from specdraft.cli import main
    from specdraft.config import load_recipe
    from specdraft.run import RunFolder

    run = RunFolder(tmp_path / "run")
    run.init(load_recipe(str(tiny_recipe)))
    run.record("gen", state="done")
    plain = {"id": "plain", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    path = run.path / "conversations.jsonl"
    path.write_text(json.dumps(plain) + "\n" + json.dumps(thinking_conversation()) + "\n")
    assert main(["render", "--run", str(run.path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: conversation think-1 turn 1:" in err and "thinking markers" in err
    assert run.stage("render")["state"] == "failed"
    path.write_text(json.dumps(plain) + "\n")
    assert main(["render", "--run", str(run.path)]) == 0
    entry = run.stage("render")
    assert entry["counts"]["samples"] == 1 and entry["counts"]["turns_with_token_ids"] == 0
    assert entry["metrics"]["retokenized_differs_share"] is None
    assert "next: specdraft extract" in capsys.readouterr().out
