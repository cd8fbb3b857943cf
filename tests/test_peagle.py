"""P-EAGLE (specdraft/methods/peagle/): the parallel forward is the math vLLM computes, training lowers the
loss, the exported folder passes doctor and imports back, the bad folders are failed and refused in one
line, and the reference decoder is exact against greedy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdraft.cli import main
from specdraft.decoding.static import StepGraphs
from specdraft.methods.peagle.decode import SlotState, StaticSlotState
from specdraft.methods.peagle.drafter import PEagleConfig, PEagleDrafter
from specdraft.methods.peagle.objective import slot_logits
from specdraft.run import RunFolder

K = 3


def tiny_drafter(seed: int = 0, num_layers: int = 1) -> PEagleDrafter:
    torch.manual_seed(seed)
    cfg = PEagleConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=50,
        draft_vocab_size=50,
        target_hidden_size=24,
        mask_token_id=49,
        speculative_tokens=4,
        aux_layer_ids=[1, 2, 3],
        num_layers=num_layers,
    )
    d = PEagleDrafter(cfg).eval()
    torch.nn.init.normal_(d.embed_tokens.weight)
    d.t2d.fill_(True)
    return d


@pytest.mark.parametrize("layers", [1, 3])
def test_parallel_forward_is_one_causal_forward_over_real_and_mask_slots(layers):
    """vLLM's round: ONE causal forward over [(x_{t+1}, fc(aux_t)) for t <= n, (mask, fc(mask_hidden)) at
    n+1 .. n+K-1]; its last K rows are the K drafts. Our decode state (cache, then the mask slots) and
    the training objective's slots (the block anchored at n, through diagonal keys) give the same logits,
    with one decoder layer or several."""
    d = tiny_drafter(num_layers=layers)
    n1, Ktr = 7, d.config.speculative_tokens
    aux, tokens = torch.randn(n1, 72), torch.randint(0, 49, (n1,))
    # the reference: one plain causal forward over the whole sequence
    mh, mt = d.mask_inputs(1, Ktr - 1, "cpu")
    hidden = torch.cat([d.project(aux)[None], mh], 1)
    ids = torch.cat([tokens[None], mt], 1)
    ref, _, _ = d(hidden, ids, torch.arange(n1 + Ktr - 1)[None])
    ref = ref[0, n1 - 1 :]  # [K, Vd]
    # the decode state, advanced in two rounds' worth of rows
    state = SlotState(d)
    state.advance(aux[:4], tokens[:4].tolist(), 0)
    state.advance(aux[4:], tokens[4:].tolist(), 4)
    got = torch.cat([state.root_logits[None], d.mask_slots(state.cache, state.root_position, Ktr)])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert state.draft(Ktr) == ref.argmax(-1).tolist()
    # the training objective's view: slot i of the block anchored at n (the last position)
    ids_row = torch.cat([torch.tensor([0]), tokens])[None]  # a row x_0 .. x_{n+1}: slot 0 at t reads x_{t+1}
    aux_row = torch.cat([aux, torch.zeros(1, 72)])[None]
    outs = list(slot_logits(d, aux_row, ids_row, torch.zeros_like(ids_row), torch.arange(n1 + 1)[None], Ktr))
    torch.testing.assert_close(torch.stack([o[0, n1 - 1] for o in outs]), ref, atol=1e-5, rtol=1e-5)
    # the static engine's buffers (a mask over the whole capacity) draft the same
    static = StaticSlotState(d, 32, StepGraphs(torch.device("cpu"), False))
    static.reset(4)
    static.advance(aux[:4], tokens[:4].tolist(), 0)
    static.advance(aux[4:], tokens[4:].tolist(), 4)
    assert static.draft(Ktr) == state.draft(Ktr)


def test_a_drafter_of_several_layers_round_trips_through_the_folder_vllm_reads(tmp_path):
    """train.peagle_layers = 3: the folder says num_hidden_layers 3 and carries every layer under vLLM's
    names (a later layer's hidden_norm too: vLLM builds one in every layer and loads it), and reading it
    back gives the same drafter."""
    from safetensors import safe_open

    from specdraft.methods.peagle.formats import read_peagle, write_peagle

    d = tiny_drafter(num_layers=3)
    folder = write_peagle(
        d,
        tmp_path / "f",
        verifier="t",
        verifier_architectures=[],
        speculative_tokens=K,
        include_embed=True,
        provenance={},
    )
    config = json.loads((folder / "config.json").read_text())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 3
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert {"layers.2.hidden_norm.weight", "layers.1.self_attn.q_proj.weight"} <= set(f.keys())
        assert list(f.get_tensor("layers.1.self_attn.q_proj.weight").shape) == [32, 32]  # H wide, not 2H
    back = read_peagle(folder, d.embed_tokens.weight.detach())
    assert back.config == d.config
    aux, ids = torch.randn(1, 5, 72), torch.randint(0, 49, (1, 5))
    want, _, _ = d.to(torch.bfloat16).float()(d.project(aux), ids, torch.arange(5)[None])
    got, _, _ = back(back.project(aux), ids, torch.arange(5)[None])
    torch.testing.assert_close(got, want)


@pytest.fixture(scope="module")
def peagle_run(memorised_peagle_run) -> Path:
    """The memorised P-EAGLE run (conftest's MEMORISED_PEAGLE_RECIPE, K = 3, two layers: trained once per machine and
    shared with tests/test_vllm_peagle.py), exported fresh by the current export code. Tests that write
    into it copy it first."""
    return memorised_peagle_run


def test_training_lowers_the_loss_and_every_slot_learns(peagle_run):
    """One statistic row per slot, and the mask slots learn as the real one does: on the 8 memorised
    answers every slot's training accuracy ends near 1 (a mask slot that the objective fed other inputs
    than a round does would still learn here; the decode test below checks that a round drafts them)."""
    folder = RunFolder(peagle_run)
    meta = json.loads((folder.checkpoint("final") / "config.json").read_text())
    assert meta["method"] == "peagle" and meta["drafter"]["speculative_tokens"] == K
    assert meta["drafter"]["num_layers"] == 2  # conftest's recipe: train.peagle_layers = 2
    train = [json.loads(line) for line in folder.train_log.read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert {len(r["acc"]) for r in train} == {K}
    assert train[-1]["loss"][0] < train[0]["loss"][0] and train[-1]["loss"][-1] < train[0]["loss"][-1], train
    assert min(train[-1]["acc"]) > 0.9, train[-1]


def test_export_is_the_peagle_folder_served_in_parallel_and_doctor_passes_it(peagle_run, capsys):
    folder = RunFolder(peagle_run)
    config = json.loads((folder.export("vllm") / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["para_depths"] == K
    assert isinstance(config["mask_token_id"], int)
    printed = folder.stage("export")["serve_commands"]["vllm"]
    spec = json.loads(printed.split("--speculative-config ", 1)[1].strip("'"))
    assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True and spec["num_speculative_tokens"] == 3
    capsys.readouterr()
    assert main(["doctor", str(folder.export("vllm")), "--run", str(peagle_run), "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "PASS  parallel flag" in out and "PASS  mask_hidden" in out, out


def test_eval_decodes_the_memorised_answers_in_parallel_exactly(peagle_run, tmp_path):
    """The reference decoder (fp32, exact against greedy) on two training prompts, 16 tokens: slots 2 and 3
    draft the memorised tokens as slot 1 does, so a round's mask-slot inputs are those the objective trained.
    Prompts 2 and 7: the two whose fp32 greedy answer is the memorised one (gen wrote the answers in this
    CPU's bf16; in fp32 the others leave it within a few tokens, and then nothing is memorised: measured on
    all 8 at 32 tokens, tau 4.00 on these two, 1.03 to 2.82 on the others)."""
    run = tmp_path / "run"
    shutil.copytree(peagle_run, run, ignore=shutil.ignore_patterns("hidden"))
    prompts = tmp_path / "prompts.jsonl"
    records = [json.loads(line) for line in (run / "conversations.jsonl").read_text().splitlines()]
    prompts.write_text("".join(json.dumps({"messages": records[i]["messages"][:-1]}) + "\n" for i in (1, 6)))
    settings = {"prompts_file": prompts, "num_prompts": 2, "max_new_tokens": 16, "draft_tokens": K}
    assert main(["eval", "--run", str(run), *(a for k, v in settings.items() for a in ("--set", f"eval.{k}={v}"))]) == 0
    report = json.loads(RunFolder(run).eval_report.read_text())
    assert report["method"] == "peagle" and report["drafting"] == ["parallel"]
    assert report["exact_prompts"] == report["prompts"] == 2
    acceptance = report["parallel"]["per_position_acceptance"]
    assert len(acceptance) == K and min(acceptance) > 0.5, report["parallel"]
    assert f"{K} drafted per forward (trained for {K})" in (RunFolder(run).eval / "report.md").read_text()


def _broken(peagle_run, tmp_path, edit) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(RunFolder(peagle_run).export("vllm"), out)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


BAD = {
    "no mask token": (lambda c: c.pop("mask_token_id"), "mask token", "mask_token_id None"),
    "K above trained": (
        lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=K + 2),
        "K served <= K trained",
        f"speculative_tokens {K + 2} > para_depths {K}",
    ),
    "parallel flag missing": (
        lambda c: c.update(speculators_model_type="eagle3"),
        "parallel flag",
        "speculators_model_type 'eagle3': the parallel flag is missing",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_folders_fail_doctor_and_import_refuses_them_in_one_line(peagle_run, tmp_path, capsys, case):
    edit, check, said = BAD[case]
    broken = _broken(peagle_run, tmp_path, edit)
    capsys.readouterr()
    assert main(["doctor", str(broken), "--target", "smollm2", "--no-measure"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  {check}" in out, out
    assert main(["import", str(broken), "--target", "smollm2", "--out", str(tmp_path / "imported")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdraft: error: import: ") and "\n" not in err and said in err, err


def test_export_refuses_k_above_the_trained_one(peagle_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(peagle_run, run)
    before = (RunFolder(run).export("vllm") / "config.json").read_text()
    assert main(["export", "--run", str(run), "--set", f"eval.draft_tokens={K + 1}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdraft: error: eval.draft_tokens = 4: the drafter was trained for K = 3"), err
    assert (RunFolder(run).export("vllm") / "config.json").read_text() == before  # the last good folder kept


def test_import_round_trip(peagle_run, tmp_path, target):
    from specdraft.methods import load_checkpoint, load_trained

    assert (
        main(
            [
                "import",
                str(RunFolder(peagle_run).export("vllm")),
                "--target",
                "smollm2",
                "--out",
                str(tmp_path / "imported"),
            ]
        )
        == 0
    )
    folder = RunFolder(peagle_run)
    trained, _, _ = load_trained(folder.recipe(), folder)
    imported, meta = load_checkpoint(tmp_path / "imported", target.embed_weight())
    assert meta["method"] == "peagle" and imported.config == trained.config
    for k, v in trained.state_dict().items():  # weights exported in bf16; d2t / t2d as they are
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        torch.testing.assert_close(imported.state_dict()[k], want.to(imported.state_dict()[k].dtype))
