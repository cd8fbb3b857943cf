import json

import pytest

from specdraft.data.sources import DataError, prompts, read_jsonl, read_sharegpt, split_of


def test_sharegpt_recovers_whole_conversations_before_the_cut():
    from specdraft.data.sources import _iter_json_array, sharegpt_path

    raw = list(_iter_json_array(sharegpt_path().read_text()))
    # The dump decodes to 17,671 whole conversations before the cut, 11,144 of them starting with a human turn.
    assert len(raw) == 17_671
    assert sum(1 for o in raw if o["conversations"] and o["conversations"][0]["from"] == "human") == 11_144
    convs = list(read_sharegpt())
    # Empty conversations and repeated ids are dropped; every id is unique, every role known.
    assert 17_000 < len(convs) < len(raw)
    assert len({c["id"] for c in convs}) == len(convs)
    assert all(m["role"] in ("system", "user", "assistant") for c in convs for m in c["messages"])


def test_split_is_deterministic_and_disjoint():
    train = prompts("sharegpt", "train", 0.05, 0, limit=300)
    held = prompts("sharegpt", "eval", 0.05, 0, limit=30)
    assert not {c["id"] for c in train} & {c["id"] for c in held}
    assert all(split_of(c["id"], 0.05, 0) == "eval" for c in held)
    assert [c["id"] for c in prompts("sharegpt", "eval", 0.05, 0, limit=30)] == [c["id"] for c in held]
    # About 5 % held out.
    share = sum(split_of(str(i), 0.05, 0) == "eval" for i in range(20_000)) / 20_000
    assert 0.04 < share < 0.06


def test_jsonl_messages(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "yo"}], "extra": 1})
        + "\n"
    )
    recs = list(read_jsonl(path))
    assert [r["id"] for r in recs][0] == "a" and len(recs) == 2 and recs[1]["extra"] == 1


@pytest.mark.parametrize(
    "line, problem",
    [
        ("{not json", "not valid JSON"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "ok"}]}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{problem}"):
        list(read_jsonl(path))
