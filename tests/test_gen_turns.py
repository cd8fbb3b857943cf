"""In-process gen over every user turn (gen.max_turns): the real bundled target answers real ShareGPT
conversations turn by turn, each turn given its own earlier answers, and stops where render would cut."""

from __future__ import annotations

import json

from specdraft.cli import main
from specdraft.config import load_recipe
from specdraft.data.generate import CONVERSATIONS
from specdraft.data.sources import prompts

MAX_TURNS = 3
MAX_NEW_TOKENS = 8
MAX_LENGTH = 140  # one of the first four conversations ends before its third turn (its prompt: 164)
RECIPE = f"""
name = "turns"
[data]
num_train = 4
max_prompt_tokens = 128
[gen]
batch_size = 4
max_new_tokens = {MAX_NEW_TOKENS}
max_turns = {MAX_TURNS}
[render]
max_length = {MAX_LENGTH}
"""


def test_every_turn_answered_in_order_and_none_past_renders_cut(target, tmp_path):
    (tmp_path / "turns.toml").write_text(RECIPE)
    run = tmp_path / "run"
    assert main(["gen", "--recipe", str(tmp_path / "turns.toml"), "--run", str(run)]) == 0
    records = [json.loads(line) for line in (run / CONVERSATIONS).read_text().splitlines()]
    recipe = load_recipe(str(tmp_path / "turns.toml"))
    d = recipe.data
    source = {c["id"]: [m["content"] for m in c["messages"] if m["role"] == "user"]
              for c in prompts(d.source, "train", d.eval_fraction, d.split_seed)}
    answered, cut = [], 0
    for r in records:
        msgs = r["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)
        users = [m["content"] for m in msgs if m["role"] == "user"]
        assert users == source[r["id"]][: len(users)]  # the source's own user turns, in order
        answers = [m for m in msgs if m["role"] == "assistant"]
        assert all(0 < len(a["token_ids"]) <= MAX_NEW_TOKENS for a in answers)
        assert len(answers) <= MAX_TURNS
        history = [{"role": m["role"], "content": m["content"]} for m in msgs]
        assert len(target.chat_ids(history, add_generation_prompt=False)) <= MAX_LENGTH
        if len(answers) < min(MAX_TURNS, len(source[r["id"]])):
            # it stopped early only because the next turn would not have fit render's cut
            nxt = history + [{"role": "user", "content": source[r["id"]][len(answers)]}]
            assert len(target.chat_ids(nxt, add_generation_prompt=True)) + MAX_NEW_TOKENS > MAX_LENGTH
            cut += 1
        answered.append(len(answers))
    assert max(answered) == MAX_TURNS and cut >= 1, answered  # both ends of a conversation were reached
    counts = json.loads((run / "manifest.json").read_text())["stages"]["gen"]["counts"]
    assert counts["records"] == len(records) == 4 and counts["turns"] == sum(answered)
