"""The data people already have: JSONL and JSON, Parquet, Arrow and `datasets` folders (each
file written here by the library that writes it), OpenAI `messages` and ShareGPT `conversations`, column
names mapped by recipe fields, conversations with tools through the target's own template, and
pre-rendered rows that go straight to extract. The target is the real bundled SmolLM2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specdraft.cli import main
from specdraft.config import ConfigError, DataConfig, load_recipe
from specdraft.data.sources import DataError, read_source
from specdraft.data.tokens import load_tokens
from specdraft.run import RunFolder
from specdraft.stages.render import ChatTemplate, render_conversation

CHATS = [
    {
        "id": "c1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
        ],
    },
    {
        "id": "c2",
        "messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6."},
        ],
    },
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CHAT = {
    "id": "t1",
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp_c": 20}', "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is 20 degrees in Paris."},
    ],
}
FORMATS = ("jsonl", "json", "parquet", "arrow", "datasets")


def write(rows: list[dict], path: Path, fmt: str) -> Path:
    """`rows` written as `fmt` by the library that writes it: json for JSON, datasets for the rest."""
    import datasets

    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif fmt == "arrow":
        import pyarrow as pa

        table = datasets.Dataset.from_list(rows).data.table
        with pa.ipc.new_file(str(path), table.schema) as w:
            w.write_table(table)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def error_line(capsys) -> str:
    """The one `specdraft: error:` line the command wrote to stderr (progress bars aside), no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specdraft: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def source_path(tmp_path: Path, fmt: str, stem: str = "chats") -> Path:
    return tmp_path / (stem if fmt == "datasets" else f"{stem}.{fmt}")


def recipe_file(tmp_path: Path, data: str, gen: str = "") -> Path:
    path = tmp_path / "r.toml"
    path.write_text(
        f'name = "data"\n[data]\n{data}\neval_fraction = 0.0\nnum_train = 0\n'
        f'[gen]\n{gen}\n[extract]\nbatch_tokens = 512\n'
    )
    return path


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_the_conversations_it_was_written_with(tmp_path, fmt):
    path = write(CHATS, source_path(tmp_path, fmt), fmt)
    records = list(read_source(str(path)))
    assert [{"id": r["id"], "messages": r["messages"]} for r in records] == CHATS


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_sharegpt_conversations_from_value(tmp_path, fmt):
    rows = [
        {
            "id": "s1",
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Name a colour."},
                {"from": "gpt", "value": "Blue."},
            ],
        }
    ]
    (record,) = read_source(str(write(rows, source_path(tmp_path, fmt), fmt)))
    assert record["messages"] == CHATS[0]["messages"]


def test_sharegpt_tool_turns_function_call_and_observation(tmp_path):
    """ShareGPT with tools as LLaMA-Factory lays it out: the call as JSON text in a `function_call` turn, the
    result in an `observation` turn, the tools as JSON text."""
    turns = [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": '{"temp_c": 20}'},
        {"from": "gpt", "value": "It is 20 degrees in Paris."},
    ]
    path = write([{"id": "t1", "conversations": turns, "tools": json.dumps(TOOLS)}], tmp_path / "t.jsonl", "jsonl")
    (record,) = read_source(str(path))
    expected = [{k: v for k, v in m.items() if k != "tool_call_id"} for m in TOOL_CHAT["messages"]]
    assert record["messages"] == expected and record["tools"] == TOOLS
    turns[1]["value"] = "get_weather(Paris)"
    write([{"conversations": turns}], path, "jsonl")
    with pytest.raises(DataError, match=r"t.jsonl:1: message 1 \(function_call\) must hold its call as JSON"):
        list(read_source(str(path)))


def test_reasoning_under_other_names_is_read_as_reasoning(tmp_path):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4.", "reasoning_content": "Two and two."},
                {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "6.", "thinking": "Three and three."},
            ]
        }
    ]
    (record,) = read_source(str(write(rows, tmp_path / "r.parquet", "parquet")))
    assert [m.get("reasoning") for m in record["messages"]] == [None, "Two and two.", None, "Three and three."]


def test_column_names_mapped_by_recipe_fields(tmp_path):
    rows = [
        {
            "uid": "m1",
            "dialogue": [{"speaker": "user", "text": "Name a colour."}, {"speaker": "assistant", "text": "Blue."}],
        }
    ]
    path = write(rows, tmp_path / "mapped.parquet", "parquet")
    recipe = load_recipe(
        str(
            recipe_file(
                tmp_path,
                f'source = "{path}"\nmessages_field = "dialogue"\n'
                f'role_field = "speaker"\ncontent_field = "text"\nid_field = "uid"',
            )
        )
    )
    (record,) = read_source(str(path), recipe.data)
    assert record["id"] == "m1" and record["messages"] == [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ]
    # Unmapped, the row has no conversation where one is looked for: the error names the row and its columns.
    with pytest.raises(
        DataError,
        match=r"mapped.parquet: row 0: 'messages' must be a non-empty list .*"
        r"data.messages_field.*\['dialogue', 'uid'\]",
    ):
        list(read_source(str(path)))


def test_data_format_is_a_choice_checked_when_the_recipe_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"data.format: 'csv' is not one of 'auto', 'jsonl'"):
        load_recipe(str(recipe_file(tmp_path, 'format = "csv"')))
    path = write(CHATS, tmp_path / "chats.txt", "jsonl")
    with pytest.raises(DataError, match=r"chats.txt: no format known by the suffix '.txt'.*data.format"):
        list(read_source(str(path)))
    assert len(list(read_source(str(path), DataConfig(format="jsonl")))) == 2


@pytest.mark.parametrize(
    "fmt, where",
    [
        ("jsonl", ":2: "),
        ("json", ": row 1: "),
        ("parquet", ": row 1: "),
        ("arrow", ": row 1: "),
        ("datasets", ": row 1: "),
    ],
)
def test_a_malformed_row_is_one_error_line_naming_its_file_and_row(tmp_path, capsys, fmt, where):
    bad = {"id": "b", "messages": [{"role": "robot", "content": "beep"}]}
    path = write([CHATS[0], bad], source_path(tmp_path, fmt, "bad"), fmt)
    assert main(["gen", "--run", str(tmp_path / "run"), "--set", f"data.source={path}"]) == 2
    assert error_line(capsys).startswith(f"specdraft: error: {path}{where}message 0 needs 'role' in")


def test_a_datasets_folder_of_splits_reads_train(tmp_path):
    import datasets

    splits = {"train": CHATS[:1], "test": CHATS[1:]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(tmp_path / "dd")
    assert [r["id"] for r in read_source(str(tmp_path / "dd"))] == ["c1"]
    datasets.DatasetDict({k: datasets.Dataset.from_list(CHATS) for k in ("a", "b")}).save_to_disk(tmp_path / "ab")
    with pytest.raises(DataError, match=r"ab: a datasets folder of splits \['a', 'b'\] and none named 'train'"):
        list(read_source(str(tmp_path / "ab")))


def test_a_file_that_is_not_what_its_suffix_says_is_one_error_line(tmp_path, capsys):
    path = tmp_path / "broken.parquet"
    path.write_text("not parquet")
    assert main(["gen", "--run", str(tmp_path / "run"), "--set", f"data.source={path}"]) == 2
    err = capsys.readouterr().err
    # Nothing but the line: not the datasets library's own log line about the file either.
    assert err.count("\n") == 1 and err.startswith(f"specdraft: error: {path}: not a readable parquet file")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"messages": [{"role": "user", "content": "hi"}]}\n\xff\xfe\n')
    with pytest.raises(DataError, match=r"binary.jsonl:2: not UTF-8 text"):
        list(read_source(str(binary)))


def test_tools_through_smollm2s_template_loss_on_assistant_answers_only(tmp_path, target):
    """SmolLM2's template writes role and content only: the tool definitions and the tool calls are not in
    its text. What is true is trained: the tool turn is context, the turn that only calls a tool has
    nothing the template writes (context, not trained), the answer after the tool's result is trained."""
    path = write([TOOL_CHAT], tmp_path / "tools.parquet", "parquet")
    recipe = recipe_file(tmp_path, f'source = "{path}"')
    run = tmp_path / "run"
    assert main(["gen", "--recipe", str(recipe), "--run", str(run), "--answers", "source"]) == 0
    (record,) = [json.loads(line) for line in RunFolder(run).conversations.read_text().splitlines()]
    assert record["tools"] == TOOLS and record["messages"] == TOOL_CHAT["messages"]
    assert main(["render", "--run", str(run)]) == 0
    entry = RunFolder(run).stage("render")
    assert entry["template"]["tools"] == "ignored" and entry["template"]["tool_calls"] == "ignored"
    assert entry["counts"]["tool_call_turns"] == 1 and entry["counts"]["untrained_tool_calls"] == 1
    _, [(ids, mask)] = load_tokens(RunFolder(run).tokens)
    tok = target.tokenizer
    assert ids == target.chat_ids(TOOL_CHAT["messages"], add_generation_prompt=False, tools=TOOLS)
    assert tok.decode([t for t, k in zip(ids, mask) if k]) == "It is 20 degrees in Paris.<|im_end|>"


def test_in_process_gen_keeps_the_tools_with_the_targets_answer(tmp_path, target):
    path = write([TOOL_CHAT], tmp_path / "tools.jsonl", "jsonl")
    run = tmp_path / "run"
    recipe = recipe_file(tmp_path, f'source = "{path}"', gen="max_new_tokens = 8")
    assert main(["gen", "--recipe", str(recipe), "--run", str(run)]) == 0
    (record,) = [json.loads(line) for line in RunFolder(run).conversations.read_text().splitlines()]
    prompt = TOOL_CHAT["messages"][:1]
    assert record["tools"] == TOOLS and record["messages"][:1] == prompt
    assert record["prompt_tokens"] == len(target.chat_ids(prompt, add_generation_prompt=True, tools=TOOLS))
    answer = record["messages"][1]
    assert answer["role"] == "assistant" and 0 < len(answer["token_ids"]) <= 8


def test_gen_through_servers_refuses_a_conversation_with_tools(tmp_path, target):
    """Servers are not sent tools yet: a source with them is refused, not answered without its tools."""
    from collections import Counter

    from specdraft.stages.gen import _conversation_prompts

    path = write([CHATS[1], TOOL_CHAT], tmp_path / "tools.jsonl", "jsonl")
    recipe = load_recipe(str(recipe_file(tmp_path, f'source = "{path}"')))
    items = _conversation_prompts(recipe, target, Counter())
    assert next(items)["id"] == "c2"
    with pytest.raises(DataError, match=r"conversation t1 has tools, which gen does not send to servers yet"):
        next(items)


# A ChatML template that writes tools and tool calls in the Hermes / Qwen2.5 format (definitions in the
# system turn, each call as JSON in <tool_call> tags), written for this test: SmolLM2's own writes neither.
TOOL_TEMPLATE = r"""
{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>' }}{%- for t in tools %}{{- '\n' + (t | tojson) }}
{%- endfor %}{{- '\n</tools><|im_end|>\n' }}{%- endif %}
{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' + m.content }}
{%- for c in m.tool_calls or [] %}{{- ('\n' if m.content or not loop.first else '') + '<tool_call>\n{"name": "'
+ c.function.name + '", "arguments": ' + (c.function.arguments | tojson) + '}\n</tool_call>' }}{%- endfor %}
{{- '<|im_end|>\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""


@pytest.fixture
def tool_template(target) -> ChatTemplate:
    """TOOL_TEMPLATE on the SmolLM2 tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target.path)
    tok.chat_template = TOOL_TEMPLATE
    return ChatTemplate(tok)


def test_tools_through_a_template_that_writes_them_train_the_call_and_the_answer(tool_template):
    template = tool_template
    assert template.writes_tools and template.writes_tool_calls
    r = render_conversation(template, TOOL_CHAT, max_length=100_000)
    ((ids, mask),) = r.samples
    assert r.untrained_tool_calls == 0 and r.tool_call_turns == 1 and not r.mismatches
    tok = template.tokenizer
    text = tok.decode(ids)
    assert "get_weather" in text[: text.index("Weather in Paris?")]  # the definitions, in the system turn
    spans, run = [], []
    for t, k in zip(ids, mask):
        if k:
            run.append(t)
        elif run:
            spans.append(tok.decode(run))
            run = []
    # Two trained spans: the call (as the template writes it) and the answer; the tool's result is not trained.
    assert len(spans) == 2
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in spans[0]
    assert spans[1].endswith("It is 20 degrees in Paris.<|im_end|>") and "temp_c" not in "".join(spans)


def _rendered_rows(target) -> list[dict]:
    """Rows as the speculators library writes them: the template's ids, 1 on the assistant tokens, and the
    length (seq_len, which render does not need)."""
    rows = []
    for chat in CHATS:
        prompt = target.chat_ids(chat["messages"][:-1], add_generation_prompt=True)
        ids = target.chat_ids(chat["messages"], add_generation_prompt=False)
        rows.append(
            {"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * (len(ids) - len(prompt)), "seq_len": len(ids)}
        )
    return rows


@pytest.mark.parametrize("fmt", ["datasets", "jsonl"])
def test_pre_rendered_rows_go_straight_to_extract(tmp_path, capsys, target, fmt):
    rows = _rendered_rows(target)
    path = source_path(tmp_path, fmt, "rendered")
    if fmt == "datasets":  # as speculators saves its rows: in torch format, which the folder keeps
        import datasets

        datasets.Dataset.from_list(rows).with_format("torch").save_to_disk(str(path))
    else:
        write(rows, path, fmt)
    recipe = recipe_file(tmp_path, f'source = "{path}"')
    run = tmp_path / "run"
    assert main(["gen", "--recipe", str(recipe), "--run", str(run)]) == 0
    assert "holds pre-rendered rows (input_ids + loss_mask): nothing to generate" in capsys.readouterr().out
    assert RunFolder(run).stage("gen")["counts"] == {"records": 0} and not RunFolder(run).conversations.exists()
    assert main(["render", "--run", str(run)]) == 0
    entry = RunFolder(run).stage("render")
    assert "2 pre-rendered rows" in entry["trusted"] and "not re-rendered" in entry["trusted"]
    assert entry["counts"]["rows"] == 2 and entry["counts"]["loss_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    _, samples = load_tokens(RunFolder(run).tokens)
    assert samples == [(r["input_ids"], r["loss_mask"]) for r in rows]
    assert len(rows[0]["input_ids"]) > 2 and 0 < sum(rows[0]["loss_mask"]) < len(rows[0]["input_ids"])
    assert main(["extract", "--run", str(run)]) == 0
    index = json.loads((RunFolder(run).hidden / "index.json").read_text())
    assert [s["tokens"] for s in index["samples"]] == [len(r["input_ids"]) for r in rows]


def test_render_takes_pre_rendered_rows_without_gen(tmp_path, target):
    path = write(_rendered_rows(target), tmp_path / "rendered.parquet", "parquet")
    run = tmp_path / "run"
    assert main(["render", "--recipe", str(recipe_file(tmp_path, f'source = "{path}"')), "--run", str(run)]) == 0
    assert RunFolder(run).stage("render")["counts"]["samples"] == 2


@pytest.mark.parametrize(
    "row, problem",
    [
        (
            {"input_ids": [1, 2, 3], "loss_mask": [0, 1]},
            r"'loss_mask' must be a list of 0/1 as long as 'input_ids' \(3\)",
        ),
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}, r"'loss_mask' trains no token"),
        ({"input_ids": [1, 10**7, 3], "loss_mask": [0, 1, 1]}, r"token id 10000000 is outside the target's vocabulary"),
    ],
)
def test_a_bad_pre_rendered_row_names_its_row(tmp_path, capsys, target, row, problem):
    path = write([{"input_ids": [1, 2], "loss_mask": [0, 1]}, row], tmp_path / "rendered.jsonl", "jsonl")
    recipe = recipe_file(tmp_path, f'source = "{path}"')
    assert main(["render", "--recipe", str(recipe), "--run", str(tmp_path / "run")]) == 2
    line = error_line(capsys)
    assert line.startswith(f"specdraft: error: {path}:2: ") and re.search(problem, line)


def _json_rows():
    """Rows near the shapes the readers take and past them: conversations whose turns hold any JSON under
    the keys read, pre-rendered rows of any ids and masks, and any JSON at all."""
    from hypothesis import strategies as st

    leaves = (
        st.none()
        | st.booleans()
        | st.integers(-2, 60_000)
        | st.floats(allow_nan=False)
        | st.text(max_size=6)
        | st.sampled_from(["user", "assistant", "tool", "system", "human", "gpt", "robot"])
    )
    anything = st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=12,
    )
    call = st.fixed_dictionaries(
        {},
        optional={
            "type": anything,
            "function": st.fixed_dictionaries({}, optional={"name": anything, "arguments": anything}) | anything,
        },
    )
    turn = (
        st.fixed_dictionaries(
            {},
            optional={
                k: anything
                for k in ("role", "content", "from", "value", "reasoning", "token_ids", "tool_call_id", "name")
            }
            | {"tool_calls": st.lists(call, max_size=2) | anything},
        )
        | anything
    )
    turns = st.lists(turn, max_size=3) | anything
    conversation = st.fixed_dictionaries(
        {},
        optional={
            "id": anything,
            "messages": turns,
            "conversations": turns,
            "tools": st.lists(anything, max_size=2) | anything,
        },
    )
    ids = st.lists(st.integers(-1, 9) | anything, max_size=4) | anything
    rendered = st.fixed_dictionaries({}, optional={"id": anything, "input_ids": ids, "loss_mask": ids})
    return st.lists(conversation | rendered | anything, min_size=1, max_size=3)


def test_any_json_rows_read_as_whole_records_or_one_data_error_naming_the_file(tmp_path):
    """Property: whatever JSON a row holds, the conversation and pre-rendered readers give whole records or
    a DataError naming the file; never another exception."""
    from hypothesis import given, settings

    from specdraft.data.sources import ROLES, read_rendered

    path = tmp_path / "any.jsonl"

    @settings(max_examples=300, deadline=None, database=None)
    @given(rows=_json_rows())
    def check(rows):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        try:
            for r in read_source(str(path)):
                assert isinstance(r["id"], str) and r["messages"]
                assert all(m["role"] in ROLES and isinstance(m["content"], str) for m in r["messages"])
        except DataError as e:
            assert str(e).startswith(f"{path}:")
        try:
            for _, r in read_rendered(DataConfig(source=str(path))):
                assert len(r["input_ids"]) == len(r["loss_mask"]) and set(r["loss_mask"]) <= {0, 1}
        except DataError as e:
            assert str(e).startswith(f"{path}:")

    check()


def test_pre_rendered_rows_keep_an_eval_split_whose_prompts_eval_drafts(tmp_path, target):
    """A share of the rows (data.eval_fraction, by id) is held out of render; eval's prompts are those rows'
    ids before their first trained token: the template's prompt through the assistant header."""
    from specdraft.data.prompts import select_prompts
    from specdraft.data.sources import split_of

    rows = [{**row, "id": f"r{i}-{j}"} for i in range(6) for j, row in enumerate(_rendered_rows(target))]
    path = write(rows, tmp_path / "rendered.jsonl", "jsonl")
    recipe = (
        recipe_file(tmp_path, f'source = "{path}"').read_text().replace("eval_fraction = 0.0", "eval_fraction = 0.5")
    )
    (tmp_path / "r.toml").write_text(recipe)
    held = [r for r in rows if split_of(r["id"], 0.5, 0) == "eval"]
    assert 0 < len(held) < len(rows)  # the split is by id: both sides have rows
    run = tmp_path / "run"
    assert main(["render", "--recipe", str(tmp_path / "r.toml"), "--run", str(run)]) == 0
    counts = RunFolder(run).stage("render")["counts"]
    assert counts["held_out_for_eval"] == len(held) and counts["samples"] == len(rows) - len(held)
    prompts, _ = select_prompts(load_recipe(str(tmp_path / "r.toml")), target, "eval", None)
    assert [p["id"] for p in prompts] == [r["id"] for r in held]
    chat = {r["id"]: CHATS[int(r["id"].split("-")[1])] for r in held}
    for p in prompts:
        assert p["prompt_ids"] == target.chat_ids(chat[p["id"]]["messages"][:-1], add_generation_prompt=True)
