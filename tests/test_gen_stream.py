"""In-process gen saves as it goes: every finished conversation is appended (and fsynced) after the
`generate` call that finished it, so `kill -9` loses at most the call in flight, and a rerun ends with
each conversation once and, single-turn and greedy, with the records an uninterrupted run writes.

The run is killed while a generate call is in flight: the child process is real gen on the real
bundled target, with generate_batch wrapped so that its Nth call announces itself (a marker file) and
then waits to be killed. The kill lands at the same point on any machine, however fast."""

from __future__ import annotations

import json
from pathlib import Path

from pausing import kill_at

from specdraft.cli import main
from specdraft.run import RunFolder

ROOT = Path(__file__).resolve().parents[1]
ROWS = 3  # gen.batch_size: each generate call answers this many conversations
CONVERSATIONS = 12
RECIPE = f"""
name = "stream"
[data]
num_train = {CONVERSATIONS}
max_prompt_tokens = 128
[gen]
batch_size = {ROWS}
max_new_tokens = 8
# bf16 is emulated (slow) on a CPU without bf16 units; float32 everywhere keeps the answers comparable
dtype = "float32"
"""


def records(run: Path) -> list[dict]:
    path = RunFolder(run).conversations
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kill_in_call(tmp_path: Path, recipe: Path, run: Path, pause_at: int) -> None:
    """Run gen in a child process and kill -9 it while its `pause_at`-th generate call is in flight."""
    kill_at(
        "specdraft.stages.gen:generate_batch",
        pause_at,
        ["gen", "--recipe", str(recipe), "--run", str(run)],
        tmp_path,
        when="before",
    )


def test_a_killed_single_turn_gen_keeps_every_finished_call_and_resumes_to_an_uninterrupted_runs_records(tmp_path):
    recipe = tmp_path / "stream.toml"
    recipe.write_text(RECIPE)
    run = tmp_path / "run"
    kill_in_call(tmp_path, recipe, run, pause_at=3)
    # Two calls finished before the kill: their conversations are on disk, whole, once each.
    saved = records(run)
    assert len(saved) == 2 * ROWS, f"{len(saved)} conversations saved after 2 finished generate calls"
    assert len({r["id"] for r in saved}) == len(saved)

    assert main(["gen", "--recipe", str(recipe), "--run", str(run)]) == 0
    resumed = records(run)
    assert resumed[: len(saved)] == saved  # what was saved stays as it was
    ids = [r["id"] for r in resumed]
    assert len(ids) == len(set(ids)) == CONVERSATIONS
    counts = json.loads((run / "manifest.json").read_text())["stages"]["gen"]["counts"]
    assert counts["records"] == CONVERSATIONS and counts["already_done"] == len(saved)
    assert counts["generate_calls"] == (CONVERSATIONS - len(saved)) // ROWS

    # The same recipe uninterrupted. Greedy and single-turn, the prompts sorted by length and cut into
    # calls of ROWS from the shortest: the resumed run's calls hold the same rows as the uninterrupted
    # run's last calls, so every answer, and the order they were saved in, is the same.
    whole = tmp_path / "whole"
    assert main(["gen", "--recipe", str(recipe), "--run", str(whole)]) == 0
    assert records(whole) == resumed


def test_a_killed_multi_turn_gen_loses_no_answered_turn(tmp_path):
    """Multi-turn, every conversation in one group (group_size 0): after each generate call the conversations
    it ended are saved and those it moved on are in gen_in_flight.jsonl as they stand, so the kill loses
    only the call in flight; the rerun ends with each conversation once, the saved ones as they were."""
    recipe = tmp_path / "turns.toml"
    recipe.write_text(
        RECIPE.replace("max_new_tokens = 8", "max_new_tokens = 8\nmax_turns = 0").replace(
            f"num_train = {CONVERSATIONS}", "num_train = 6"
        )
        + "[render]\nmax_length = 512\n"
    )
    run = tmp_path / "run"
    kill_in_call(tmp_path, recipe, run, pause_at=2)  # mid first turn: 6 conversations in calls of 3
    folder = RunFolder(run)
    saved = records(run)
    flight = folder.gen_in_flight
    in_flight = {}
    if flight.exists():
        for line in flight.read_text().splitlines():
            state = json.loads(line)
            in_flight[state["id"]] = state  # the last line of a conversation is how it stands
    answered = {r["id"] for r in saved} | set(in_flight)
    # The first turn's finished call answered ROWS conversations: each is saved or in flight.
    assert len(answered) == ROWS, (len(saved), len(in_flight))
    assert all(s["turn"] >= 1 for s in in_flight.values())

    assert main(["gen", "--recipe", str(recipe), "--run", str(run)]) == 0
    final = records(run)
    assert final[: len(saved)] == saved
    ids = [r["id"] for r in final]
    assert len(ids) == len(set(ids)) == 6
    for r in final:
        if r["id"] in in_flight and r["id"] not in {s["id"] for s in saved}:
            kept = in_flight[r["id"]]["messages"]
            assert r["messages"][: len(kept)] == kept  # resumed at its turn, earlier answers not redone
    assert not flight.exists()
