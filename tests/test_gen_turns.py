"""In-process gen over every user turn (gen.max_turns): the real bundled target answers real ShareGPT
conversations turn by turn, each turn given its own earlier answers, and stops where render would cut."""

from __future__ import annotations

import json

from specdraft.cli import main
from specdraft.config import load_recipe
from specdraft.data.sources import prompts
from specdraft.run import RunFolder

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
    records = [json.loads(line) for line in (RunFolder(run).conversations).read_text().splitlines()]
    recipe = load_recipe(str(tmp_path / "turns.toml"))
    d = recipe.data
    source = {
        c["id"]: [m["content"] for m in c["messages"] if m["role"] == "user"]
        for c in prompts(d.source, "train", d.eval_fraction, d.split_seed)
    }
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


def test_rows_are_cut_by_the_kv_budget_and_answered_in_the_order_given(target):
    """generate_rows sorts prompts by length and packs calls within rows x (prompt + answer) tokens; each
    answer is the one that prompt gets alone (greedy, float32), back in the caller's order."""
    from collections import Counter

    from specdraft.config import GenConfig
    from specdraft.stages.gen import generate_batch, generate_rows

    model = target.load_model("float32")
    lengths = [30, 5, 17, 9, 24]
    rows = [target.tokenizer.encode("Tell me a story about a red fox " * 4)[:n] for n in lengths]
    cfg = GenConfig(batch_size=2, batch_tokens=(17 + MAX_NEW_TOKENS) * 2, max_new_tokens=MAX_NEW_TOKENS)
    stats = Counter()
    answers = generate_rows(model, rows, target.eos_token_id, target.tokenizer.pad_token_id, cfg, stats)
    # sorted 5, 9 | 17 (17 and 24 would pass the budget) | 24 | 30
    assert stats["generate_calls"] == 4
    alone = [generate_batch(model, [r], target.eos_token_id, target.tokenizer.pad_token_id, cfg)[0] for r in rows]
    assert answers == alone


def test_a_killed_multi_turn_gen_resumes_its_unfinished_conversations_at_the_turn_they_reached(tmp_path):
    """kill -9 after a turn: the rerun keeps every saved conversation, goes on with the in-flight ones from
    their saved turn (their earlier answers kept, not regenerated) and ends with each conversation once."""
    from pausing import kill_at

    recipe = (
        RECIPE.replace("num_train = 4", "num_train = 8")
        .replace(f"max_turns = {MAX_TURNS}", "max_turns = 0")
        .replace(f"max_length = {MAX_LENGTH}", "max_length = 512")
        .replace("batch_size = 4", "batch_size = 3\ndtype = \"float32\"")
    )
    (tmp_path / "turns.toml").write_text(recipe)
    run = tmp_path / "run"
    # Killed once the first generate call's conversations are saved (finished ones and those in flight).
    kill_at(
        "specdraft.stages.gen:_CallSaver.__call__",
        1,
        ["gen", "--recipe", str(tmp_path / "turns.toml"), "--run", str(run)],
        tmp_path,
    )
    flight = RunFolder(run).gen_in_flight
    assert flight.exists() and flight.stat().st_size, "gen ended before a turn left conversations in flight"
    in_flight = {r["id"]: r for r in map(json.loads, flight.read_text().splitlines())}
    saved = (RunFolder(run).conversations).read_text().splitlines() if (RunFolder(run).conversations).exists() else []
    assert main(["gen", "--recipe", str(tmp_path / "turns.toml"), "--run", str(run)]) == 0
    records = [json.loads(line) for line in (RunFolder(run).conversations).read_text().splitlines()]
    assert records[: len(saved)] == [json.loads(line) for line in saved]
    assert len({r["id"] for r in records}) == len(records) == 8
    for r in records:
        if r["id"] in in_flight:
            kept = in_flight[r["id"]]["messages"]
            assert r["messages"][: len(kept)] == kept and len(r["messages"]) > len(kept)
    counts = json.loads((run / "manifest.json").read_text())["stages"]["gen"]["counts"]
    # (a kill between saving a turn's finished conversations and the in-flight file leaves them in both)
    saved_ids = {json.loads(line)["id"] for line in saved}
    assert counts["resumed_in_flight"] == len(in_flight.keys() - saved_ids) > 0 and not flight.exists()


def test_cut_turns_keeps_the_first_answers_of_the_carried_three_turn_answers(target, tmp_path):
    """scripts/cut_turns.py turns bench/data's 3-turn answers into what a first-turns gen saves: the first
    answer of each conversation, as generated, with its finish reason read from its last token."""
    import lzma
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    with lzma.open(root / "bench/data/smollm2-h200-turns3.conversations.jsonl.xz", "rt") as f:
        lines = f.readlines()
    # the file holds single-turn conversations first (saved after turn 1), then the longer ones
    originals = [json.loads(line) for line in lines[:25] + lines[-25:]]
    text = "".join(json.dumps(r) + "\n" for r in originals)
    cut = subprocess.run(
        [sys.executable, str(root / "scripts/cut_turns.py"), "1", "smollm2"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(cut) == len(originals) and any(len(r["messages"]) > 2 for r in originals)
    for line, original in zip(cut, originals):
        r = json.loads(line)
        assert r["messages"] == original["messages"][:2] and r["messages"][1]["role"] == "assistant"
        stopped = r["messages"][1]["token_ids"][-1] == target.eos_token_id
        assert r["finish_reason"] == ("stop" if stopped else "length")
        assert r["generator"]["sampling"]["max_turns"] == 1


SELF_INSTRUCT = """
name = "magpie"
[data]
max_prompt_tokens = 128
[gen]
self_instruct = true
num_samples = 3
batch_size = 6
max_new_tokens = 40
# bf16 matmuls run ~10x slower than float32 on this CPU (no bf16 units)
dtype = "float32"
"""


def test_in_process_self_instruct_writes_new_user_turns_and_answers_them(target, tmp_path):
    """Magpie without a server: the bundled target writes user turns from its own template's user-turn
    prefix and answers each, greedily; every saved turn is whole, distinct, within max_prompt_tokens; a
    rerun that wants more keeps those and writes only the rest."""
    from specdraft.stages.gen import magpie_id

    (tmp_path / "m.toml").write_text(SELF_INSTRUCT)
    run = tmp_path / "run"
    assert main(["gen", "--recipe", str(tmp_path / "m.toml"), "--run", str(run)]) == 0
    records = [json.loads(line) for line in (RunFolder(run).conversations).read_text().splitlines()]
    assert len(records) == 3 and len({r["id"] for r in records}) == 3
    for r in records:
        user, answer = r["messages"][-2], r["messages"][-1]
        assert user["role"] == "user" and user["content"].strip() and r["id"] == magpie_id(user["content"])
        assert len(target.chat_ids(r["messages"][:-1], add_generation_prompt=True)) <= 128
        assert answer["role"] == "assistant" and 0 < len(answer["token_ids"]) <= 40
        assert r["generator"]["sampling"]["user_turn_temperature"] > 0
    counts = json.loads((run / "manifest.json").read_text())["stages"]["gen"]["counts"]
    assert counts["user_turns_written"] >= 3 + counts["unusable"] + counts["duplicate"] + counts["too_long"]
    assert counts["records"] == 3
    assert main(["gen", "--run", str(run), "--set", "gen.num_samples=4"]) == 0
    again = [json.loads(line) for line in (RunFolder(run).conversations).read_text().splitlines()]
    assert again[:3] == records and len({r["id"] for r in again}) == len(again) == 4


def test_in_process_self_instruct_gives_up_when_no_user_turn_ends(tmp_path):
    """Two tokens never finish a user turn: every one is unusable, and the run stops after its tries with
    the reason in the manifest rather than saving prompts nobody ended."""
    import pytest

    from specdraft.config import load_recipe
    from specdraft.run import RunFolder
    from specdraft.stages import gen as generate

    (tmp_path / "m.toml").write_text(SELF_INSTRUCT.replace("max_new_tokens = 40", "max_new_tokens = 2"))
    recipe = load_recipe(str(tmp_path / "m.toml"))
    run = RunFolder(tmp_path / "run")
    run.init(recipe)
    with pytest.raises(generate.GenStopped, match="self-instruct gave up: 12 unusable"):
        generate.run(recipe, run)
    entry = json.loads((run.path / "manifest.json").read_text())["stages"]["gen"]
    assert entry["state"] == "failed" and entry["counts"]["records"] == 0
    assert entry["counts"]["user_turns_written"] == 12  # 3 wanted x 4 tries


def test_in_process_self_instruct_samples_come_after_the_sources_prompts(target, tmp_path):
    """gen.self_instruct_samples: the source's prompts answered first, then as many first turns the target
    wrote itself; a rerun that wants one more keeps every record and writes only that one."""
    from specdraft.stages.gen import MAGPIE_PREFIX, magpie_id

    recipe = SELF_INSTRUCT.replace("self_instruct = true\nnum_samples = 3", "self_instruct_samples = 2").replace(
        "[data]", "[data]\nnum_train = 2"
    )
    (tmp_path / "m.toml").write_text(recipe)
    run = tmp_path / "run"
    assert main(["gen", "--recipe", str(tmp_path / "m.toml"), "--run", str(run)]) == 0
    records = [json.loads(line) for line in (RunFolder(run).conversations).read_text().splitlines()]
    written = [r for r in records if r["id"].startswith(MAGPIE_PREFIX)]
    assert len(records) == 4 and len(written) == 2 and len({r["id"] for r in records}) == 4
    # the source's first, as asked
    assert all(not r["id"].startswith(MAGPIE_PREFIX) for r in records[:2])
    for r in written:
        assert r["id"] == magpie_id(r["messages"][-2]["content"]) and r["messages"][-1]["token_ids"]
    counts = json.loads((run / "manifest.json").read_text())["stages"]["gen"]["counts"]
    assert counts["prompts"] == 2 and counts["records"] == 4 and counts["user_turns_written"] >= 2
    assert main(["gen", "--run", str(run), "--set", "gen.self_instruct_samples=3"]) == 0
    again = [json.loads(line) for line in (RunFolder(run).conversations).read_text().splitlines()]
    assert again[:4] == records and len(again) == 5 and again[4]["id"].startswith(MAGPIE_PREFIX)


def test_self_instruct_samples_refuse_what_they_cannot_add_to(tmp_path):
    import pytest

    from specdraft.config import ConfigError, load_recipe
    from specdraft.run import RunFolder
    from specdraft.stages import gen as generate

    for extra in ("self_instruct = true\nnum_samples = 3", 'answers = "source"'):
        (tmp_path / "m.toml").write_text(f'name = "m"\n[gen]\nself_instruct_samples = 2\n{extra}\n')
        recipe = load_recipe(str(tmp_path / "m.toml"))
        run = RunFolder(tmp_path / "run")
        run.init(recipe)
        with pytest.raises(ConfigError, match="self_instruct_samples"):
            generate.run(recipe, run)
