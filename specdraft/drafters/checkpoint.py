"""specdraft's own checkpoint of a drafter: its weights (safetensors), its config and what it was
trained on (meta.json), and a completeness marker written last, so a folder cut off mid-save is never
read as a checkpoint.
"""

from __future__ import annotations

import json
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
