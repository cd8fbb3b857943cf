"""The render stage on the bundled target's own multi-turn answers to real ShareGPT conversations:
its own ids trained, the re-tokenization share reported, and (with the real vLLM server) every
prompt compared with vLLM's own tokenization. Run under `flock /tmp/specdraft-vllm.lock`."""

from __future__ import annotations

import json

import pytest

from specdraft.cli import main
from specdraft.data.tokens import load_tokens
from specdraft.run import RunFolder
from specdraft.stages.render import ChatTemplate, verify_with_server
from specdraft.targets import resolve_dtype

pytestmark = pytest.mark.slow

NUM_CONVERSATIONS = 4
MAX_NEW_TOKENS = 24
# Short user turns keep the target's prompts (and this test) small.
MAX_USER_CHARS = 300


def _two_turn_prompts() -> list[dict]:
    from specdraft.data.sources import read_sharegpt

    out = []
    for conv in read_sharegpt():
        users = [m for m in conv["messages"] if m["role"] == "user"]
        if (
            conv["messages"][0]["role"] == "user"
            and len(users) >= 2
            and all(0 < len(u["content"]) < MAX_USER_CHARS for u in users[:2])
        ):
            out.append({"id": conv["id"], "users": [u["content"] for u in users[:2]]})
        if len(out) == NUM_CONVERSATIONS:
            return out
    raise AssertionError("ShareGPT has too few short two-turn conversations")


@pytest.fixture(scope="module")
def own_run(tmp_path_factory, target):
    """A run whose conversations.jsonl holds SmolLM2's own answers to two user turns each, replayed turn
    by turn (the second answer given its own first one), each turn with the ids it generated."""
    from conftest import TINY_RECIPE

    from specdraft.config import GenConfig, load_recipe
    from specdraft.run import RunFolder
    from specdraft.stages.gen import answer_turns

    root = tmp_path_factory.mktemp("render-stage")
    recipe_path = root / "tiny.toml"
    recipe_path.write_text(TINY_RECIPE)
    model = target.load_model(resolve_dtype("auto", "cpu"))  # as the stages compute here
    cfg = GenConfig(max_new_tokens=MAX_NEW_TOKENS, max_turns=2)
    convs = []
    for p in _two_turn_prompts():
        first = [{"role": "user", "content": p["users"][0]}]
        convs.append(
            {
                "id": p["id"],
                "messages": first,
                "later_users": p["users"][1:],
                "prompt_ids": target.chat_ids(first, add_generation_prompt=True),
            }
        )
    answer_turns(model, target, convs, cfg, max_length=4096)
    convs = [{"id": c["id"], "split": "train", "messages": c["messages"]} for c in convs]
    run_path = root / "run"
    run = RunFolder(run_path)
    run.init(load_recipe(str(recipe_path)))
    (run_path / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    run.record("gen", state="done")
    return run_path, recipe_path, convs


def test_render_trains_the_targets_own_ids_and_reports_the_retokenized_share(own_run, target):
    run_path, recipe_path, convs = own_run
    assert main(["render", "--recipe", str(recipe_path), "--run", str(run_path)]) == 0
    entry = json.loads((run_path / "manifest.json").read_text())["stages"]["render"]
    tok = target.tokenizer
    eos = target.eos_token_id
    differs = 0
    expected_samples = 0
    for conv in convs:
        answers = [m for m in conv["messages"] if m["role"] == "assistant"]
        for a in answers:
            stopped = a["token_ids"][-1] == eos
            differs += a["token_ids"] != tok.encode(a["content"], add_special_tokens=False) + [eos] * stopped
        # The second turn extends the first one's sample only where the server's re-rendering of the
        # first answer gives back exactly the ids the target produced (and its "\n" after <|im_end|>).
        first = (
            target.chat_ids(conv["messages"][:1], add_generation_prompt=True)
            + answers[0]["token_ids"]
            + (tok.encode("\n", add_special_tokens=False) if answers[0]["token_ids"][-1] == eos else [])
        )
        second_prompt = target.chat_ids(conv["messages"][:3], add_generation_prompt=True)
        expected_samples += 1 + (second_prompt[: len(first)] != first)
    turns = 2 * len(convs)
    assert entry["counts"]["turns"] == turns and entry["counts"]["turns_with_token_ids"] == turns
    assert entry["counts"]["retokenized_differs"] == differs
    assert entry["metrics"]["retokenized_differs_share"] == round(differs / turns, 4)
    assert entry["counts"]["template_mismatches"] == 0
    index, samples = load_tokens(RunFolder(run_path).tokens)
    assert len(samples) == expected_samples == index["num_samples"]
    # Each conversation's masked tokens, over its samples, are exactly the ids the target generated.
    for conv in convs:
        keys = [k for k, sid in enumerate(index["ids"]) if sid.split("#")[0] == conv["id"]]
        trained = [t for k in keys for t, m in zip(*samples[k]) if m]
        assert trained == [t for m in conv["messages"] if m["role"] == "assistant" for t in m["token_ids"]]


def test_render_agrees_with_vllms_own_tokenization(own_run, vllm_target, target):
    run_path, recipe_path, convs = own_run
    assert (
        main(["render", "--recipe", str(recipe_path), "--run", str(run_path), "--verify-endpoint", vllm_target.url])
        == 0
    )
    entry = json.loads((run_path / "manifest.json").read_text())["stages"]["render"]
    assert entry["counts"]["vllm_checked"] == 2 * len(convs)
    assert entry["counts"]["vllm_mismatches"] == 0 and entry["metrics"]["vllm_mismatch_share"] == 0.0


def test_a_template_other_than_the_served_one_is_caught_by_vllm(vllm_target, target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target.path)
    served = tok.chat_template
    tok.chat_template = served.replace("named SmolLM", "named SmolLM2")
    assert tok.chat_template != served
    conv = {
        "id": "other",
        "messages": [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi!"}],
    }
    template = ChatTemplate(tok)
    (m,) = verify_with_server(template, conv, vllm_target.url)
    ours = template.prompt_ids(conv["messages"][:1])
    theirs = target.chat_ids(conv["messages"][:1], add_generation_prompt=True)
    pos = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    assert (m.kind, m.turn, m.position) == ("vllm_prompt", 1, pos)
    assert str(m) == (
        f"conversation other turn 1: vllm_prompt mismatch at token {pos}: ours "
        f"{tok.decode([ours[pos]])!r} ({ours[pos]}) vs vLLM {tok.decode([theirs[pos]])!r} ({theirs[pos]})"
    )
