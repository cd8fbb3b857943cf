"""The whole path on a tiny scale, through the real CLI, on the real bundled target and ShareGPT."""

from __future__ import annotations

import json

import pytest
import torch
from states import Reference

from specdraft.cli import main
from specdraft.run import RunFolder
from specdraft.targets import resolve_dtype

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, target):
    from conftest import TINY_RECIPE

    root = tmp_path_factory.mktemp("pipeline")
    recipe = root / "tiny.toml"
    recipe.write_text(TINY_RECIPE)
    run = root / "run"
    assert main(["demo", "--recipe", str(recipe), "--run", str(run)]) == 0
    return run


def test_every_stage_is_recorded_done(tiny_run):
    m = json.loads((tiny_run / "manifest.json").read_text())
    assert m["recipe"]["name"] == "tiny"
    for stage in ("gen", "render", "extract", "train", "export", "eval"):
        entry = m["stages"][stage]
        assert entry["state"] == "done", stage
        assert (
            entry["environment"]["versions"]["torch"] == torch.__version__.split("+")[0]
            or entry["environment"]["versions"]["torch"] == torch.__version__
        )
        assert entry["environment"]["ram_bytes"] > 0
    assert m["stages"]["extract"]["metrics"]["bytes_per_token"] == 4 * 576 * 2
    assert m["stages"]["extract"]["metrics"]["tokens_per_s"] > 0


def test_gen_kept_the_targets_own_token_ids(tiny_run, target):
    records = [json.loads(line) for line in (tiny_run / "conversations.jsonl").read_text().splitlines()]
    assert len(records) == 8 and len({r["id"] for r in records}) == 8
    for r in records:
        answer = r["messages"][-1]
        assert answer["role"] == "assistant"
        assert answer["reasoning"] == "" and answer["reasoning_source"] == "none"
        ids = answer["token_ids"]
        assert 0 < len(ids) <= 24
        assert (r["finish_reason"] == "stop") == (ids[-1] == target.eos_token_id)
        assert answer["content"] == target.tokenizer.decode(
            ids[:-1] if r["finish_reason"] == "stop" else ids, skip_special_tokens=True
        )


def test_render_masks_only_the_answer(tiny_run, target):
    from specdraft.data.tokens import load_tokens

    index, samples = load_tokens(RunFolder(tiny_run).tokens)
    records = [json.loads(line) for line in (tiny_run / "conversations.jsonl").read_text().splitlines()]
    assert index["ids"] == [r["id"] for r in records]
    for (ids, mask), r in zip(samples, records):
        answer = [t for t, m in zip(ids, mask) if m]
        assert answer == r["messages"][-1]["token_ids"]
        prompt = target.chat_ids(r["messages"][:-1], add_generation_prompt=True)
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])


def test_hidden_states_match_the_targets_own_layers(tiny_run, target):
    """Stored aux id k equals transformers' output_hidden_states[k]; `last` is the final-norm output."""
    from specdraft.hidden.store import HiddenStore

    store = HiddenStore(RunFolder(tiny_run).hidden)
    assert store.aux_layer_ids == [2, 15, 27]
    sample = store[0]
    models: dict = {}
    ref = Reference(target, sample["input_ids"], models)
    for j, k in enumerate((2, 15, 27)):
        ref.assert_layer(sample["aux"][:, j * 576 : (j + 1) * 576], k)
    # transformers' last hidden state is already the final-norm output (docs/engine-facts.md), as `last` is.
    ref.assert_layer(sample["last"], -1)
    model = models[resolve_dtype("auto", "cpu")]
    with torch.inference_mode():
        out = model(input_ids=sample["input_ids"].long()[None])
    logits = model.lm_head(sample["last"].to(model.lm_head.weight.dtype))
    assert (logits.argmax(-1) == out.logits[0].argmax(-1)).float().mean() > 0.95


def test_eval_is_exact_and_reports_acceptance(tiny_run):
    r = json.loads((tiny_run / "eval" / "report.json").read_text())
    assert r["prompts"] == 3
    assert r["exact_prompts"] + r["numerical_ties"] == 3
    assert r["exact_prompts"] >= 2  # fp32: a tie is rare
    K = r["draft_tokens"]
    assert len(r["accepted_length_histogram"]) == K + 1 and sum(r["accepted_length_histogram"]) == r["rounds"]
    assert r["tau"] == pytest.approx(
        sum((a + 1) * c for a, c in enumerate(r["accepted_length_histogram"])) / r["rounds"], abs=1e-3
    )
    assert (tiny_run / "eval" / "report.md").read_text().startswith("# Drafter evaluation: eagle3")
    assert (tiny_run / "eval" / "accepted_lengths.png").stat().st_size > 1000


def test_export_round_trip_gives_identical_logits(tiny_run, target):
    from specdraft.methods import load_checkpoint
    from specdraft.methods.eagle3.formats import read_drafter

    embed = target.embed_weight()
    trained, _ = load_checkpoint(tiny_run / "checkpoints" / "final", embed)
    served = read_drafter(tiny_run / "export" / "vllm", embed)
    config = json.loads((tiny_run / "export" / "vllm" / "config.json").read_text())
    assert "model_type" not in config  # vLLM detects the speculators format by its absence
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert config["norm_before_residual"] is False
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 3
    torch.manual_seed(0)
    aux, ids = torch.randn(1, 7, 3 * 576), torch.randint(0, 49152, (1, 7))
    with torch.no_grad():
        # bf16 storage: compare the bf16-rounded checkpoint with itself.
        trained = trained.to(torch.bfloat16).float()
        a = trained(trained.project(aux), ids, torch.arange(7)[None])[0]
        b = served(served.project(aux), ids, torch.arange(7)[None])[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(trained.d2t, served.d2t) and torch.equal(trained.t2d, served.t2d)


def test_gen_resumes_without_duplicates(tiny_run, tmp_path):
    """A torn last line (an interrupted append) is repaired, and finished ids are not redone."""
    import shutil

    from specdraft.stages.gen import finished_ids

    run = tmp_path / "resumed"
    shutil.copytree(tiny_run, run)
    path = run / "conversations.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:5]) + lines[5][: len(lines[5]) // 2])
    assert len(finished_ids(path)) == 5
    assert main(["gen", "--run", str(run)]) == 0
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert len(ids) == 8 and len(set(ids)) == 8
    m = json.loads((run / "manifest.json").read_text())
    assert m["stages"]["gen"]["counts"]["already_done"] == 5
    assert m["stages"]["gen"]["counts"]["generated"] == 3
