"""The trainer on real extracted hidden states: resume after a kill, torchrun DDP / FSDP2 on gloo, the
checkpoint layout, starting from a published drafter, and the Kimi-K2.5 drafter's size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pausing import kill_at

from specdraft.cli import main
from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter
from specdraft.methods.eagle3.objective import TTT
from specdraft.run import RunFolder
from specdraft.stages.train import COMPLETE

REPO = Path(__file__).resolve().parents[1]
# Small rows so the tiny recipe's 8 samples make several optimizer steps per epoch.
FAST = [
    "--set",
    "train.batch_tokens=160",
    "--set",
    "train.holdout=0.25",
    "--set",
    "train.epochs=2",
    "--set",
    "train.eval_every=3",
    "--set",
    "train.checkpoint_every=2",
    "--set",
    "train.warmup_steps=2",
]


def fresh_copy(extracted_run: Path, tmp_path: Path, name: str) -> Path:
    run = tmp_path / name
    shutil.copytree(extracted_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    return run


def train_log(run: Path, kind: str = "train") -> list[dict]:
    lines = (RunFolder(run).train_log).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def cli(run: Path, extracted_run: Path, *extra: str) -> list[str]:
    return ["train", "--recipe", str(extracted_run.parent / "tiny.toml"), "--run", str(run), *FAST, *extra]


def env(threads: int = 1) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}


@pytest.fixture(scope="module")
def uninterrupted(extracted_run, tmp_path_factory) -> Path:
    run = fresh_copy(extracted_run, tmp_path_factory.mktemp("train"), "whole")
    assert main(cli(run, extracted_run)) == 0
    return run


@pytest.mark.slow
def test_checkpoints_logs_and_manifest(uninterrupted):
    ckpt = uninterrupted / "checkpoints"
    for name in ("latest", "best", "final"):
        assert (ckpt / name / COMPLETE).exists(), name
        assert (ckpt / name / "model.safetensors").exists(), name
    assert (ckpt / "latest" / "trainer.safetensors").exists() and (ckpt / "latest" / "trainer.json").exists()
    assert not list(ckpt.glob("*/trainer.pt")), "no pickle"
    assert not list(ckpt.glob(".*tmp")), "no temporary folder is left behind"
    assert (ckpt / "curves.png").stat().st_size > 0
    assert list((ckpt / "tensorboard").glob("events.out.tfevents.*"))
    steps = [r["step"] for r in train_log(uninterrupted)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5
    evals = train_log(uninterrupted, "eval")
    assert evals and evals[-1]["step"] == steps[-1]
    for e in evals:
        assert len(e["cond_accept"]) == 3 and 1.0 <= e["tau"] <= 4.0
    best = json.loads((ckpt / "best" / "config.json").read_text())
    assert best["metrics"]["tau"] == max(e["tau"] for e in evals)
    entry = json.loads((uninterrupted / "manifest.json").read_text())["stages"]["train"]
    assert entry["state"] == "done" and entry["checkpoint"] == "checkpoints/best"
    assert entry["counts"]["heldout_samples"] == 2 and entry["counts"]["samples"] == 6
    # The wall time is broken down: every phase measured, none negative, together within the stage's time
    phases = entry["metrics"]["phase_seconds"]
    assert set(phases) == {"start-up", "top tokens", "steps", "held-out", "checkpoints", "data wait"}
    assert min(phases.values()) >= -0.1 and phases["steps"] > 0 and phases["checkpoints"] > 0
    assert sum(phases.values()) <= entry["seconds"] + 0.5
    # The first step's loss is the untrained drafter's; training lowers it.
    losses = [r["weighted_loss"] for r in train_log(uninterrupted)]
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_killed_run_resumes_on_the_uninterrupted_curve(extracted_run, uninterrupted, tmp_path):
    """A run killed (SIGKILL) between steps restarts from `latest` and continues the loss curve of the
    run that was never stopped: same data position, optimizer, schedule."""
    run = fresh_copy(extracted_run, tmp_path, "killed")
    # With the thread count of the runs in this process: another count sums the gradients in another order,
    # and the bf16 steps after it carry that difference past the tolerance.
    # Killed as step 4 begins: steps 1-3 are logged and `latest` holds step 2 (checkpoint_every=2).
    kill_at(
        "specdraft.stages.train:Trainer.train_step",
        4,
        cli(run, extracted_run),
        tmp_path,
        when="before",
        env=env(torch.get_num_threads()),
    )
    expected = train_log(uninterrupted)
    killed_at = max(r["step"] for r in train_log(run))
    saved = json.loads((run / "checkpoints" / "latest" / "config.json").read_text())["step"]
    assert (killed_at, saved) == (3, 2) and saved < len(expected)

    assert main(cli(run, extracted_run)) == 0
    resumed = train_log(run)
    assert [r["step"] for r in resumed] == [r["step"] for r in expected], "each step logged once"
    for a, b in zip(resumed, expected):
        assert a["weighted_loss"] == pytest.approx(b["weighted_loss"], rel=1e-4, abs=1e-5), a["step"]
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-6)


TWO_ROWS = ["--set", "train.micro_batches=2", "--set", "train.epochs=1"]


@pytest.fixture(scope="module")
def single_two_rows(extracted_run, tmp_path_factory) -> Path:
    """One process taking 2 packed rows per optimizer step."""
    run = fresh_copy(extracted_run, tmp_path_factory.mktemp("train"), "single")
    assert main(cli(run, extracted_run, *TWO_ROWS)) == 0
    return run


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_two_processes_equal_one(extracted_run, single_two_rows, tmp_path, parallel):
    """torchrun with 2 gloo processes (each taking one of the step's 2 packed rows) takes the same steps
    as one process taking both rows."""
    # The run folder is the default runs/<recipe name> under cwd: torchrun's own parser would take a
    # `--run` flag for an abbreviation of its `--run-path`, even after the module name.
    (tmp_path / parallel / "runs").mkdir(parents=True)
    multi = fresh_copy(extracted_run, tmp_path / parallel / "runs", "tiny")
    args = cli(multi, extracted_run, *TWO_ROWS, "--set", f"train.parallel={parallel}")
    args = args[:3] + args[5:]  # without --run
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "specdraft.cli",
        *args,
    ]
    done = subprocess.run(
        cmd, env=env(), capture_output=True, text=True, timeout=900, cwd=tmp_path / parallel, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    a, b = train_log(single_two_rows), train_log(multi)
    assert len(a) == len(b) >= 2
    for x, y in zip(a, b):
        assert x["weighted_loss"] == pytest.approx(y["weighted_loss"], rel=1e-4), x["step"]
        assert x["acc"] == pytest.approx(y["acc"], abs=1e-6)
    manifest = json.loads((multi / "manifest.json").read_text())["stages"]["train"]
    assert manifest["counts"]["processes"] == 2


def test_init_from_names_what_does_not_fit(tmp_path):
    """Starting from a published drafter checks every shape against the target's drafter; a drafter
    for another target is refused with each tensor that does not fit."""
    from specdraft.methods.eagle3 import init_from
    from specdraft.methods.eagle3.formats import write_sglang

    def drafter(hidden, vocab):
        from specdraft.drafters import vocab as vocabulary

        torch.manual_seed(0)
        d = Eagle3Drafter(
            DrafterConfig(
                hidden_size=hidden,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                intermediate_size=64,
                vocab_size=vocab,
                draft_vocab_size=40,
                target_hidden_size=hidden,
                aux_layer_ids=[1, 2, 3],
            )
        )
        d2t, t2d = vocabulary.build(torch.arange(vocab), 40)
        d.d2t.copy_(d2t)
        d.t2d.copy_(t2d)
        return d

    published = drafter(32, 50)
    folder = write_sglang(published, tmp_path / "published", include_embed=False, provenance={})
    ours = drafter(32, 50)
    torch.nn.init.zeros_(ours.fc.weight)
    init_from(ours, folder, published.embed_tokens.weight.detach())

    def as_written(w):  # export writes bf16
        return w.detach().to(torch.bfloat16).float()

    torch.testing.assert_close(ours.fc.weight, as_written(published.fc.weight))
    torch.testing.assert_close(ours.lm_head.weight, as_written(published.lm_head.weight))

    other = drafter(48, 50)
    with pytest.raises(ValueError) as err:
        init_from(other, folder, published.embed_tokens.weight.detach())
    message = str(err.value)
    assert "fc.weight: drafter for this target needs (48, 144)" in message and "has (32, 96)" in message
    assert "lm_head.weight" in message


def test_kimi_k25_drafter_size_on_meta():
    """The Kimi-K2.5 drafter (bench/RESULTS.md): 1190.9 M trainable, a 1174.4 M frozen embedding, and 2594.7 M in
    all with the frozen verifier head restricted to the draft vocabulary (what the trainer holds)."""
    cfg = DrafterConfig(
        hidden_size=7168,
        num_attention_heads=64,
        num_key_value_heads=64,
        head_dim=128,
        intermediate_size=18432,
        vocab_size=163840,
        draft_vocab_size=32000,
        target_hidden_size=7168,
        aux_layer_ids=[2, 30, 58],
    )
    with torch.device("meta"):
        model = TTT(Eagle3Drafter(cfg), torch.empty(cfg.draft_vocab_size, cfg.target_hidden_size), 7, 0.8)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    embedding = model.drafter.embed_tokens.weight.numel()
    head = model.draft_head.numel()
    assert not model.drafter.embed_tokens.weight.requires_grad
    assert round(trainable / 1e6, 1) == 1190.9
    assert round(embedding / 1e6, 1) == 1174.4
    assert round((trainable + embedding + head) / 1e6, 1) == 2594.7


@pytest.mark.slow
def test_fewer_samples_same_holdout_and_head_from_target(extracted_run, tmp_path):
    """max_samples trains on fewer samples and holds out the same ones; lm_head_init "target" starts
    lm_head and the final norm from the target's (lr 1e-30, the least step short of the refused 0, keeps
    them there to be read back: a step moves no weight by more than ~1e-29)."""
    from specdraft.targets import Target

    run = fresh_copy(extracted_run, tmp_path, "opts")
    assert (
        main(
            cli(
                run,
                extracted_run,
                "--set",
                "train.max_samples=3",
                "--set",
                "train.lm_head_init=target",
                "--set",
                "train.lr=1e-30",
                "--set",
                "train.epochs=1",
            )
        )
        == 0
    )
    entry = json.loads((run / "manifest.json").read_text())["stages"]["train"]
    assert entry["counts"]["samples"] == 3 and entry["counts"]["heldout_samples"] == 2
    from safetensors.torch import load_file

    state = load_file(str(run / "checkpoints" / "final" / "model.safetensors"))
    target = Target("smollm2", meta_ids(run))
    t2d = state["t2d"]
    assert torch.allclose(state["lm_head.weight"].float(), target.head_weight()[t2d].float(), rtol=0, atol=1e-20)
    assert torch.allclose(state["norm.weight"].float(), target.final_norm_weight())


def test_a_batch_past_the_memory_is_refused_before_training_with_the_batch_that_fits(extracted_run, tmp_path, capsys):
    """A batch the plan's memory model puts past the whole device memory stops train at once, with the
    batch that fits, and leaves no checkpoint behind; the same run then trains at that batch."""
    import re

    run = fresh_copy(extracted_run, tmp_path, "memory")
    assert main(cli(run, extracted_run, "--set", "train.batch_tokens=100000000")) == 2
    err = capsys.readouterr().err
    assert "training" in err and "usable" in err and "train.batch_tokens = 100,000,000" in err, err
    fit = int(re.search(r"--batch-tokens (\d+)", err).group(1))
    assert not (run / "checkpoints").exists()
    assert 0 < fit < 100_000_000
    assert (
        main(cli(run, extracted_run, "--set", "train.epochs=1", "--set", f"train.batch_tokens={min(fit, 4096)}")) == 0
    )


@pytest.mark.slow
def test_frozen_target_head_stays_and_residual_flag_reaches_the_drafter(extracted_run, tmp_path):
    """lm_head_init "target-frozen": after training at a real lr the head is still the target's rows and
    is not counted as trainable; norm_before_residual reaches the saved drafter config."""
    from safetensors.torch import load_file

    from specdraft.targets import Target

    run = fresh_copy(extracted_run, tmp_path, "frozen")
    assert (
        main(
            cli(
                run,
                extracted_run,
                "--set",
                "train.max_samples=3",
                "--set",
                "train.lm_head_init=target-frozen",
                "--set",
                "train.norm_before_residual=true",
                "--set",
                "train.epochs=3",
                "--set",
                "train.warmup_steps=0",
            )
        )
        == 0
    )
    counts = json.loads((run / "manifest.json").read_text())["stages"]["train"]["counts"]
    state = load_file(str(run / "checkpoints" / "final" / "model.safetensors"))
    target = Target("smollm2", meta_ids(run))
    assert torch.equal(state["lm_head.weight"].float(), target.head_weight()[state["t2d"]].float())
    assert not torch.allclose(state["norm.weight"].float(), target.final_norm_weight())  # the norm trains
    own = sum(t.numel() for k, t in state.items() if k not in ("embed_tokens.weight", "d2t", "t2d", "lm_head.weight"))
    assert counts["trainable_params"] == own
    config = json.loads((run / "checkpoints" / "final" / "config.json").read_text())
    assert config["drafter"]["norm_before_residual"] is True


def meta_ids(run: Path) -> list[int]:
    return json.loads((run / "checkpoints" / "final" / "config.json").read_text())["aux_layer_ids"]


def test_hidden_noise_only_in_training():
    """Noise of +-share x RMS on the aux states while training; none in eval (held-out scores stay exact)."""
    cfg = DrafterConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=50,
        draft_vocab_size=50,
        target_hidden_size=32,
        aux_layer_ids=[0, 1, 2],
    )
    model = TTT(Eagle3Drafter(cfg), torch.randn(50, 32), 3, 0.8, hidden_noise=0.2)
    aux = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(0)) * 7
    rms = aux.pow(2).mean(-1, keepdim=True).sqrt()
    noisy = model.train().noisy(aux)
    assert not torch.equal(noisy, aux) and ((noisy - aux).abs() <= 0.2 * rms + 1e-6).all()
    assert (noisy - aux).abs().max() > 0.1 * rms.min()
    assert torch.equal(model.eval().noisy(aux), aux)


def test_every_epoch_has_its_steps_when_packing_differs():
    """Each epoch's shuffle packs into its own number of rows; the run's step count is the fewest of
    any epoch, so no epoch runs out of rows (with epoch 0's count taken for all, an epoch that packs
    fewer rows ends in StopIteration)."""
    import dataclasses

    from specdraft.config import TrainConfig
    from specdraft.training import epoch_rows, epoch_steps, step_batches

    lengths = [int(n) for n in torch.randint(20, 200, (300,), generator=torch.Generator().manual_seed(1))]
    cfg = dataclasses.replace(TrainConfig(), batch_tokens=512, epochs=20, loader_workers=0, micro_batches=1)
    idx = list(range(len(lengths)))
    counts = [len(epoch_rows(idx, lengths, cfg, e)) for e in range(cfg.epochs)]
    assert min(counts) < counts[0], counts  # the case that failed: a later epoch packs fewer rows
    hidden = 4
    source = [
        {
            "input_ids": torch.arange(n),
            "loss_mask": torch.ones(n, dtype=torch.bool),
            "aux": torch.zeros(n, 3 * hidden),
            "last": torch.zeros(n, hidden),
        }
        for n in lengths
    ]
    tops = [torch.zeros(n, dtype=torch.long) for n in lengths]
    per_epoch = epoch_steps(idx, lengths, cfg)
    seen = [
        epoch for epoch, _ in step_batches(source, tops, idx, lengths, cfg, 0, per_epoch, 0, 1, torch.device("cpu"))
    ]
    assert seen == [e for e in range(cfg.epochs) for _ in range(per_epoch)]


@pytest.mark.slow
def test_muon_trains_the_matrices_and_resumes(extracted_run, tmp_path, capsys):
    """train.optimizer = "muon": Muon over fc's and the layer's matrices, AdamW over lm_head and the
    norms; both optimizers' states and schedules are checkpointed, so a killed run resumes exactly."""
    import dataclasses

    from specdraft.config import TrainConfig
    from specdraft.training import make_optimizers

    drafter = Eagle3Drafter(
        DrafterConfig(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=64,
            vocab_size=100,
            draft_vocab_size=50,
            target_hidden_size=32,
            aux_layer_ids=[0, 1, 2],
        )
    )
    drafter.embed_tokens.weight.requires_grad_(False)
    muon, adamw = make_optimizers(drafter, dataclasses.replace(TrainConfig(), optimizer="muon"))
    names = {id(p): n for n, p in drafter.named_parameters()}
    in_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert "fc.weight" in in_muon and any("q_proj" in n for n in in_muon) and "lm_head.weight" in in_adamw
    assert not in_muon & in_adamw and all(drafter.get_parameter(n).ndim == 2 for n in in_muon)
    assert any("norm" in n for n in in_adamw) and "embed_tokens.weight" not in in_muon | in_adamw

    run = fresh_copy(extracted_run, tmp_path, "muon")
    args = cli(
        run,
        extracted_run,
        "--set",
        "train.optimizer=muon",
        "--set",
        "train.weight_decay=0.1",
        "--set",
        "train.epochs=2",
        "--set",
        "train.checkpoint_every=1",
    )
    assert main(args) == 0
    log = [json.loads(line) for line in (RunFolder(run).train_log).read_text().splitlines()]
    first, last = log[0], [r for r in log if r["kind"] == "train"][-1]
    assert last["weighted_loss"] < first["weighted_loss"]
    # A second run killed as step 4 begins resumes from `latest` (step 3), both optimizers included, and
    # continues the uninterrupted run's curve.
    killed = fresh_copy(extracted_run, tmp_path, "muon-killed")
    killed_args = [a.replace(str(run), str(killed)) for a in args]
    kill_at(
        "specdraft.stages.train:Trainer.train_step",
        4,
        killed_args,
        tmp_path,
        when="before",
        env=env(torch.get_num_threads()),
    )
    assert json.loads((killed / "checkpoints" / "latest" / "config.json").read_text())["step"] == 3
    capsys.readouterr()
    assert main(killed_args) == 0
    assert "resumed at step 3" in capsys.readouterr().out
    resumed, expected = train_log(killed), train_log(run)
    assert [r["step"] for r in resumed] == [r["step"] for r in expected] and len(expected) > 4
    for a, b in zip(resumed, expected):
        assert a["weighted_loss"] == pytest.approx(b["weighted_loss"], rel=1e-4, abs=1e-5), a["step"]


def test_training_checkpoint_restores_what_resuming_needs(tmp_path):
    """save_training writes the drafter and its trainer state (only on rank 0); load_training puts the trainable
    weights, the optimizer and schedule and the RNG back and returns the saved data position."""
    import random

    from specdraft.drafters.checkpoint import load_training, save_training
    from specdraft.methods import load_checkpoint

    cfg = DrafterConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=50,
        draft_vocab_size=50,
        target_hidden_size=32,
        aux_layer_ids=[0, 1, 2],
    )

    def trainer(seed):
        torch.manual_seed(seed)
        model = TTT(Eagle3Drafter(cfg), torch.randn(50, 32), 3, 0.8)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))
        return model, optimizer, scheduler

    model, optimizer, scheduler = trainer(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    optimizer.step()
    scheduler.step()
    state = {"step": 1, "tokens": 100, "seconds": 2.0, "best_tau": 1.5}
    save_training(tmp_path / "not-rank-0", model, [optimizer], [scheduler], cfg, {"step": 1}, state, rank=1)
    assert not (tmp_path / "not-rank-0").exists()
    rng = torch.get_rng_state(), random.getstate()
    save_training(tmp_path / "latest", model, [optimizer], [scheduler], cfg, {"step": 1}, state, rank=0)
    assert (tmp_path / "latest" / COMPLETE).exists() and (tmp_path / "latest" / "trainer.safetensors").exists()

    embed = model.drafter.embed_tokens.weight.detach()
    saved, meta = load_checkpoint(tmp_path / "latest", embed)
    assert meta["step"] == 1 and meta["drafter"]["hidden_size"] == 32
    for k, v in model.drafter.state_dict().items():
        torch.testing.assert_close(saved.state_dict()[k], v)

    other, other_optimizer, other_scheduler = trainer(1)
    other.drafter.embed_tokens.weight.data.copy_(embed)  # the target's, not in the checkpoint
    assert load_training(tmp_path / "latest", other, [other_optimizer], [other_scheduler]) == state
    for k, v in model.state_dict().items():
        torch.testing.assert_close(other.state_dict()[k], v)
    assert other_scheduler.last_epoch == scheduler.last_epoch == 1
    assert other_scheduler.get_last_lr() == scheduler.get_last_lr()
    torch.testing.assert_close(other_optimizer.state_dict()["state"], optimizer.state_dict()["state"])
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
