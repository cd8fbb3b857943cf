"""specdraft's own checkpoint of a drafter: its weights (safetensors), its config and what it was
trained on (meta.json), and a completeness marker written last, so a folder cut off mid-save is never
read as a checkpoint. A training checkpoint adds trainer.pt, what resuming needs besides the weights.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from specdraft.config import Recipe
from specdraft.drafters.eagle3 import DrafterConfig, Eagle3Drafter
from specdraft.drafters.formats import read_drafter
from specdraft.run import RunFolder, write_json
from specdraft.targets import Target

COMPLETE = "COMPLETE"  # written last into a checkpoint folder: a folder without it is ignored


def save_checkpoint(drafter: Eagle3Drafter, path: Path, meta: dict, extra: dict | None = None) -> None:
    """A checkpoint folder, written whole under a temporary name, marked complete, then renamed. The
    embedding is left out: it is the target's, read from there on load. `extra` (optimizer, scheduler,
    data position, RNG) goes to trainer.pt for resuming."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    save_file(state, str(tmp / "model.safetensors"))
    write_json(tmp / "config.json", {"drafter": drafter.config.to_dict(), **meta})
    if extra is not None:
        torch.save(extra, tmp / "trainer.pt")
    (tmp / COMPLETE).write_text("")
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def save_training(path: Path, wrapped, optimizers: list, schedulers: list, config: DrafterConfig, meta: dict,
                  state: dict, rank: int) -> None:
    """A resumable checkpoint of the drafter in training: its weights, plus the trainable weights,
    optimizer and scheduler states, `state` (step, tokens, ...) and RNG in trainer.pt. `wrapped` is the
    TTT module, under DDP or FSDP or neither. Every process calls it, since gathering the full state
    dicts is collective; only rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(wrapped, options=full)
    optim_state = get_optimizer_state_dict(wrapped, optimizers, options=full)
    if rank != 0:
        return
    trainable = {k: v for k, v in model_state.items() if "embed_tokens" not in k}
    extra = {"model": trainable, "optimizer": optim_state, "scheduler": [x.state_dict() for x in schedulers],
             "state": dict(state), "rng": rng_state()}
    drafter = Eagle3Drafter(config)
    drafter.load_state_dict({k.removeprefix("drafter."): v for k, v in model_state.items()})
    save_checkpoint(drafter, path, meta, extra)


def load_training(path: Path, wrapped, optimizers: list, schedulers: list) -> dict:
    """Restore what `save_training` wrote at `path` into the model, optimizers and schedulers, and the
    RNG; returns the saved `state`."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    extra = torch.load(path / "trainer.pt", weights_only=False)
    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(wrapped, extra["model"], options=full)
    set_optimizer_state_dict(wrapped, optimizers, extra["optimizer"], options=full)
    # trainer.pt written before there could be several optimizers holds one scheduler's state, not a list.
    saved_schedulers = extra["scheduler"] if isinstance(extra["scheduler"], list) else [extra["scheduler"]]
    for scheduler, saved_state in zip(schedulers, saved_schedulers, strict=True):
        scheduler.load_state_dict(saved_state)
    torch.set_rng_state(extra["rng"]["torch"])
    random.setstate(extra["rng"]["python"])
    if extra["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(extra["rng"]["cuda"])
    return extra["state"]


def load_checkpoint(path: Path, embed: torch.Tensor | None = None) -> tuple[Eagle3Drafter, dict]:
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / "config.json").read_text())
    drafter = Eagle3Drafter(DrafterConfig(**meta["drafter"]))
    state = load_file(str(path / "model.safetensors"))
    if "embed_tokens.weight" not in state:
        if embed is None:
            raise ValueError(f"{path}: checkpoint has no embedding; pass the target's")
        state["embed_tokens.weight"] = embed
    drafter.load_state_dict(state)
    return drafter.eval(), meta


def load_trained(recipe: Recipe, folder: RunFolder):
    """The run's trained drafter, the target it was trained for (with the checkpoint's aux layers),
    and the target's embedding (which the drafter shares)."""

    entry = folder.require("train")
    ckpt = folder.path / entry["checkpoint"] if "checkpoint" in entry else folder.checkpoint("final")
    meta = json.loads((ckpt / "config.json").read_text())
    target = Target(recipe.target.model, meta["aux_layer_ids"])
    embed = target.embed_weight()
    drafter, _ = load_checkpoint(ckpt, embed)
    return drafter, target, embed


def init_from(drafter: Eagle3Drafter, folder: Path, embed: torch.Tensor) -> None:
    """Start from a published drafter (speculators `layers.0.*` or flat `midlayer.*` layout), after
    checking every shape against the drafter this target needs; a mismatch names each tensor."""

    src = read_drafter(Path(folder), embed)
    want = {k: v.shape for k, v in drafter.state_dict().items()}
    have = {k: v.shape for k, v in src.state_dict().items()}
    problems = [f"{k}: drafter for this target needs {tuple(want[k])}, {folder} has "
                f"{tuple(have[k]) if k in have else 'nothing'}" for k in want if have.get(k) != want[k]]
    problems += [f"{k}: in {folder} but not used by this drafter" for k in have if k not in want]
    if problems:
        raise ValueError(f"train.init_from = {folder} does not fit the target:\n  " + "\n  ".join(problems))
    drafter.load_state_dict(src.state_dict())
