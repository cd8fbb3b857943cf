"""The trainer's resume state without pickle: a checkpoint folder from someone else never runs code
when a run resumes from it; the state round-trips (AdamW and Muon, schedules, RNG) through safetensors
and JSON; saving draws nothing from the RNG, so a resumed run continues the uninterrupted one's stream."""

from __future__ import annotations

import json
import math
import pathlib
import random
import shutil
from pathlib import Path

import pytest
import torch

from specdraft.cli import main
from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter
from specdraft.methods.eagle3.objective import TTT
from specdraft.run import RunFolder


class Plant:
    """Unpickling this creates the file `path`: what a pickled checkpoint from a stranger could do."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def plant_pickle(ckpt: Path, marker: Path) -> None:
    """A checkpoint folder as specdraft before this change wrote it, its trainer.pt carrying code."""
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.save({"model": Plant(marker), "state": {"step": 2}}, ckpt / "trainer.pt")
    (ckpt / "COMPLETE").write_text("")


def test_resume_from_a_pickled_trainer_state_runs_no_code(extracted_run, tmp_path, capsys):
    """`specdraft train` resuming from a checkpoints/latest whose trainer.pt would run code when
    unpickled: refused with one line naming the file, the code never runs, the folder is left as it was."""
    from specdraft.config import load_recipe, to_dict

    recipe = extracted_run.parent / "tiny.toml"
    run = tmp_path / "shared"
    shutil.copytree(extracted_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    latest = RunFolder(run).checkpoint("latest")
    marker = tmp_path / "code-ran"
    plant_pickle(latest, marker)
    # The train config it was "saved" with is the one this run asks for, so nothing else stops the resume.
    (latest / "config.json").write_text(json.dumps({"train": to_dict(load_recipe(str(recipe)).train), "step": 2}))

    try:
        code = main(["train", "--recipe", str(recipe), "--run", str(run)])
    except Exception as e:  # noqa: BLE001 - a loader that unpickles fails on what it got, after running its code
        code = e
    err = capsys.readouterr().err
    assert not marker.exists(), "unpickling the checkpoint ran its code"
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("specdraft: error:")]
    assert len(lines) == 1 and "trainer.pt" in lines[0] and "pickle" in lines[0], err
    assert "train.resume=false" in lines[0]
    assert "Traceback" not in err
    assert (latest / "trainer.pt").exists() and (latest / "COMPLETE").exists(), "the checkpoint is kept"


def test_load_training_refuses_pickle_and_missing_state(tmp_path):
    from specdraft.drafters.checkpoint import load_training

    marker = tmp_path / "code-ran"
    plant_pickle(tmp_path / "old", marker)
    model, optimizers, schedulers = trainer(0)
    with pytest.raises(ValueError, match="pickle") as err:
        load_training(tmp_path / "old", model, optimizers, schedulers)
    assert "\n" not in str(err.value) and not marker.exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no trainer state"):
        load_training(tmp_path / "empty", model, optimizers, schedulers)


CFG = DrafterConfig(
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


def trainer(seed: int, optimizer: str = "adamw"):
    import dataclasses

    from specdraft.config import TrainConfig
    from specdraft.training import make_optimizers

    torch.manual_seed(seed)
    model = TTT(Eagle3Drafter(CFG), torch.randn(50, 32), 3, 0.8)
    optimizers = make_optimizers(model, dataclasses.replace(TrainConfig(), optimizer=optimizer, weight_decay=0.1))
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)) for o in optimizers]
    return model, optimizers, schedulers


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_trainer_state_round_trips_without_pickle(tmp_path, kind):
    """save_training writes trainer.safetensors + trainer.json (no pickle anywhere); load_training puts
    the weights, every optimizer's state, the schedules and every RNG back exactly."""
    import numpy as np

    from specdraft.drafters.checkpoint import load_training, save_training

    model, optimizers, schedulers = trainer(0, kind)
    assert len(optimizers) == (2 if kind == "muon" else 1)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p) if p.requires_grad else None
        for o, s in zip(optimizers, schedulers):
            o.step()
            s.step()
    state = {"step": 2, "tokens": 100, "seconds": 2.5, "best_tau": None}
    np.random.seed(3)
    random.seed(4)
    rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    save_training(tmp_path / "latest", model, optimizers, schedulers, CFG, {"step": 2}, state, rank=0)
    # Saving (which builds the drafter copy it writes) draws nothing from the RNG.
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    files = sorted(p.name for p in (tmp_path / "latest").iterdir())
    assert files == ["COMPLETE", "config.json", "model.safetensors", "trainer.json", "trainer.safetensors"]
    skeleton = json.loads((tmp_path / "latest" / "trainer.json").read_text())
    assert skeleton["format"] == "specdraft trainer state" and skeleton["version"] == 1

    other, other_optimizers, other_schedulers = trainer(1, kind)  # which also moves torch's RNG on
    random.seed(99)
    np.random.seed(99)
    other.drafter.embed_tokens.weight.data.copy_(model.drafter.embed_tokens.weight)  # the target's, not saved
    assert load_training(tmp_path / "latest", other, other_optimizers, other_schedulers) == state
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    for a, b in zip(optimizers, other_optimizers, strict=True):
        sa, sb = a.state_dict(), b.state_dict()
        # torch's set_optimizer_state_dict itself gives betas / ns_coefficients back as lists
        assert json.dumps(sa["param_groups"]) == json.dumps(sb["param_groups"])
        assert sa["state"].keys() == sb["state"].keys()
        for i in sa["state"]:
            for name, t in sa["state"][i].items():
                assert torch.equal(sb["state"][i][name], t) and sb["state"][i][name].dtype == t.dtype, (i, name)
    for a, b in zip(schedulers, other_schedulers, strict=True):
        assert a.state_dict() == b.state_dict()
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[1]
    saved_np, now_np = rng[2], np.random.get_state()
    assert saved_np[0] == now_np[0] and (saved_np[1] == now_np[1]).all() and saved_np[2:] == now_np[2:]


def test_skeleton_keeps_every_python_type_and_refuses_objects():
    """The JSON skeleton keeps what a state dict holds: int keys, tuples, None, inf, nested lists, 0-d
    and bf16 tensors; an object it cannot write without pickle is refused when saving, by its path."""
    from specdraft.drafters.checkpoint import flatten_state, unflatten_state

    state = {
        "state": {0: {"step": torch.tensor(3.0), "buf": torch.randn(2, 3).bfloat16()}},
        "groups": [{"betas": (0.9, 0.999), "params": [0, 1], "foreach": None, "name": "x/y"}],
        "rng": (3, tuple(range(5)), None),
        "inf": math.inf,
        "flag": True,
        "__tuple__": [1],
    }
    tensors, skeleton = flatten_state(state)
    back = unflatten_state(json.loads(json.dumps(skeleton)), tensors)
    assert back["groups"] == state["groups"] and back["rng"] == state["rng"] and back["inf"] == math.inf
    assert back["flag"] is True and back["__tuple__"] == [1] and list(back["state"]) == [0]
    assert torch.equal(back["state"][0]["buf"], state["state"][0]["buf"])
    assert back["state"][0]["step"].shape == () and back["state"][0]["step"].item() == 3.0
    with pytest.raises(TypeError, match="optimizer/hook"):
        flatten_state({"optimizer": {"hook": object()}})


@pytest.mark.slow
def test_resume_continues_the_random_stream(extracted_run, tmp_path, monkeypatch):
    """With hidden-state noise (drawn from torch's RNG every step), a run stopped after a checkpoint
    and resumed logs exactly what the run never stopped logs: the checkpoint saved the RNG where the
    uninterrupted run goes on from (building the drafter copy it writes, or the next epoch's data
    loader, draws nothing from it)."""
    from specdraft.stages.train import Trainer

    recipe = extracted_run.parent / "tiny.toml"
    args = [
        "--recipe",
        str(recipe),
        "--set",
        "train.hidden_noise=0.3",
        "--set",
        "train.batch_tokens=160",
        "--set",
        "train.holdout=0.25",
        "--set",
        "train.epochs=2",
        "--set",
        "train.checkpoint_every=2",
        "--set",
        "train.eval_every=3",
        "--set",
        "train.warmup_steps=2",
    ]

    def copy(name):
        run = tmp_path / name
        shutil.copytree(extracted_run, run, ignore=shutil.ignore_patterns("checkpoints"))
        return run

    def log(run):
        return [json.loads(line) for line in RunFolder(run).train_log.read_text().splitlines()]

    whole = copy("whole")
    assert main(["train", "--run", str(whole), *args]) == 0
    expected = log(whole)
    steps = max(r["step"] for r in expected)
    stop_at = 2 * max(1, steps // 4)  # a checkpoint step (checkpoint_every = 2) in the first half

    stopped = copy("stopped")
    step = Trainer.train_step

    def stop(self, micro):
        if self.state["step"] == stop_at:
            raise KeyboardInterrupt
        return step(self, micro)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", stop)
        assert main(["train", "--run", str(stopped), *args]) == 130
    saved = json.loads((RunFolder(stopped).checkpoint("latest") / "config.json").read_text())["step"]
    assert saved == stop_at and 0 < saved < steps
    assert main(["train", "--run", str(stopped), *args]) == 0
    assert log(stopped) == expected
