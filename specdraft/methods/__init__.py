"""The drafter methods' registry: each method's name -> its package (specdraft/methods/<name>/), every
one a contract.Method. Stages and shared library modules ask here for a method, never import a method's
package, and never name one: a new method is its own package plus one line in METHODS.

Which method a saved drafter belongs to is written into its checkpoint (config.json's "method"), so the
readers below dispatch on what they load, never on a recipe that may have changed since; an engine
folder belongs to the method whose `owns` accepts its config.json, else to DEFAULT.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.drafters import checkpoint
from specdraft.files import FileError
from specdraft.methods import dflash, eagle3, peagle
from specdraft.methods.contract import Decode, Method
from specdraft.targets import Target

__all__ = [
    "DEFAULT",
    "METHODS",
    "Decode",
    "Method",
    "for_drafter",
    "for_folder",
    "load_checkpoint",
    "load_trained",
    "named",
    "read_meta",
]

METHODS: dict[str, Method] = {m.name: m for m in (eagle3.METHOD, dflash.METHOD, peagle.METHOD)}

# The method of a checkpoint that names none (written before there were several), and of an engine
# folder no other method claims (its checks then say why it is not one).
DEFAULT = eagle3.METHOD.name


def named(name: str) -> Method:
    """The method called `name` (train.method, a checkpoint's "method"); an unknown one names the known."""
    if name not in METHODS:
        raise ValueError(f"method {name!r}: expected one of {', '.join(METHODS)}")
    return METHODS[name]


def for_drafter(drafter) -> Method:
    """The method of a loaded drafter (its class's METHOD)."""
    return named(drafter.METHOD)


def for_folder(config: dict) -> Method:
    """The method whose engine folder has this config.json."""
    return next((m for m in METHODS.values() if m.owns(config)), METHODS[DEFAULT])


# ---------------------------------------------------------------------------------------------------
# Checkpoints, read by the method they name


def read_meta(path: Path) -> dict:
    """A checkpoint's config.json, checked for the drafter config and a registered method."""
    return checkpoint.read_meta(path, METHODS, DEFAULT)


def drafter_config(meta: dict, path: Path):
    """The drafter config a checkpoint's config.json (`meta`, read from `path`) holds."""
    return checkpoint.drafter_config(meta, path, METHODS[meta["method"]].config_class)


def load_checkpoint(path: Path, embed: torch.Tensor | None = None, head: torch.Tensor | None = None):
    """The drafter of a checkpoint, of the method its config.json names, with the target's `embed` (and
    `head`, the target's lm_head weight, for a drafter sharing it) where the checkpoint left them out;
    -> (drafter, config.json)."""
    path = Path(path)
    meta = read_meta(path)
    drafter = drafter_config(meta, path).make_drafter()
    return checkpoint.load_weights(drafter, path, embed, head), meta


def load_trained(recipe, folder):
    """The run's trained drafter, the target it was trained for (with the checkpoint's aux layers),
    and the target's embedding (which the drafter shares)."""
    entry = folder.require("train")
    ckpt = folder.path / entry["checkpoint"] if "checkpoint" in entry else folder.checkpoint("final")
    meta = read_meta(ckpt)
    if "aux_layer_ids" not in meta:
        raise FileError(
            f"{ckpt / 'config.json'}: no 'aux_layer_ids' (the layers it drafts from); {checkpoint.checkpoint_fix(ckpt)}"
        )
    target = Target(recipe.target.model, meta["aux_layer_ids"])
    embed = target.embed_weight()
    shared = checkpoint.target_tensors(drafter_config(meta, ckpt))
    head = target.head_weight() if "lm_head.weight" in shared else None
    drafter, _ = load_checkpoint(ckpt, embed, head)
    return drafter, target, embed
