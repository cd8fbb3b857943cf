"""What a drafter method provides: the one contract every package under specdraft/methods/ fulfils.

A method is a choice inside one design (`train.method`): every method trains from the same extracted
hidden states, in the same trainer loop, is measured by the same eval and bench, and is written, read and
checked by the same stages. What differs lives in the method's package, behind this class; the stages
ask the registry (specdraft/methods/__init__.py, which says how a saved drafter or an engine folder
finds its method) for a method and call it, never name one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from specdraft.config import ConfigError, beyond

Decoding = Callable  # (runner, drafter, prompt ids, max_new, eos, Stats) -> generated ids


@dataclass(frozen=True)
class Decode:
    """One way the reference decoder drafts: `depth` drafted tokens per round at most, `shape` as
    reported (JSON-ready), `run` the decoding function, `describe` the shape in words as the eval
    report's table shows it (the method says what its shape is; eval never reads the shape's keys)."""

    depth: int
    shape: dict
    run: Decoding
    describe: str


class DecodeState(Protocol):
    """A drafter's state across the rounds of one decode (decoding/rounds.py): `advance` feeds it the
    target's aux states of newly accepted positions; the method's round policy reads it to draft."""

    drafter: nn.Module

    def reset(self, max_accepted: int) -> None: ...

    def advance(self, aux: torch.Tensor, next_tokens: list[int], first_position: int) -> None: ...


@dataclass(frozen=True)
class DecodeStates:
    """How a method's decode state is made on each engine (decoding/runners.py): `eager(drafter)` on
    the eager one, `static(drafter, capacity, graphs)` on preallocated buffers whose calls may be CUDA
    graphs. The static runner keeps one and reuses it while the drafter is the same."""

    eager: Callable[[nn.Module], DecodeState]
    static: Callable[[nn.Module, int, Any], DecodeState]


class Method:
    """One drafter method. Its package defines a subclass and one instance, METHOD, that the registry
    lists. Defaults are what a method without that feature does."""

    name: str  # train.method's value, and what checkpoints record
    title: str  # as people write it: "EAGLE-3", "DFlash"
    config_class: type  # the drafter's config (a dataclass with to_dict and make_drafter)
    drafter_class: type
    position: str  # what one statistic row is, as plots and logs name it
    first_position: int  # the number of the first row (TTT steps count from 0, drafted block slots from 1)
    # train fields of this method that a resumed run may not change (the trainer adds its own)
    resume_fixed: tuple[str, ...] = ()
    # the export formats the method writes, the first the one the engines serve most
    formats: tuple[str, ...] = ("vllm",)
    # whether the reference decoder has sampled rounds for it (eval.temperature > 0: `sampled`)
    samples: bool = False

    # --- training -----------------------------------------------------------------------------------

    def check(self, recipe) -> None:
        """Refuse (config.ConfigError) a recipe the method cannot train: a choice it does not take, or a
        range between fields that only it sets. train asks before the run is written, plan before its bill."""

    def check_mask_token(self, recipe, vocab_size: int, target: str) -> None:
        """train.mask_token_id within the target's vocabulary (the methods that draft from mask slots)."""
        if recipe.train.mask_token_id >= vocab_size:
            raise beyond(
                "train.mask_token_id", recipe.train.mask_token_id, f"< {vocab_size:,}", f"the vocabulary of {target}"
            )

    def check_target(self, recipe, vocab_size: int, target: str) -> None:
        """Refuse the ranges the target (`target` names it, of `vocab_size` tokens) sets for the method's
        own fields; train and plan ask where they read the target (besides targets.check_fits)."""

    def build(self, cfg, target, counts: torch.Tensor) -> nn.Module:
        """The drafter for `target` on its frozen embedding, with the draft vocabulary of `counts`."""
        raise NotImplementedError

    def objective(self, drafter: nn.Module, draft_head: torch.Tensor, cfg) -> nn.Module:
        """The module the trainer steps: batch dict -> (loss, statistics [positions, len(STAT_COLUMNS)])."""
        raise NotImplementedError

    def positions(self, cfg) -> int:
        """Statistic rows per step (TTT steps, block slots)."""
        raise NotImplementedError

    def loss_weights(self, cfg) -> list[float]:
        """The weight of each statistic row in the logged loss."""
        raise NotImplementedError

    def position_labels(self, n: int) -> list[str]:
        """The names of n statistic rows: 'TTT step 0', ... or 'block slot 1', ..."""
        return [f"{self.position} {self.first_position + i}" for i in range(n)]

    def goal(self, train: dict, export: dict, eval: dict, vocab: str) -> tuple[str, int]:
        """status's goal: what the drafter of the recorded recipe sections is ("EAGLE-3 drafter trained
        for ..."; `vocab` says its draft vocabulary) and the K its eval measures."""
        raise NotImplementedError

    # --- plan ---------------------------------------------------------------------------------------

    def plan_config(self, target, cfg):
        """The drafter's config for plan's bill, without reading the tokenizer."""
        raise NotImplementedError

    def queries(self, cfg) -> float:
        """Drafter queries per batch token, each through every drafter layer."""
        raise NotImplementedError

    # --- the reference decoder ----------------------------------------------------------------------

    def decodings(self, runner, drafter: nn.Module, cfg) -> dict[str, Decode]:
        """The reference decoder's ways of drafting with `drafter`, the first headlining the report."""
        raise NotImplementedError

    def sampled(
        self,
        runner,
        drafter,
        prompt: list[int],
        max_new: int,
        eos: int,
        K: int,
        temperature: float,
        stats,
        generator: torch.Generator,
    ) -> list[int]:
        """Sampled speculative decoding (eval.temperature > 0), for a method that `samples`: the output
        distributed as the target's own sampling at `temperature`."""
        raise NotImplementedError

    # --- engine folders -----------------------------------------------------------------------------

    def owns(self, config: dict) -> bool:
        """Whether an engine folder's config.json is this method's (the registry's default method
        claims the folders no other does)."""
        return False

    def serve_config(self, folder: str, K: int | None) -> dict:
        """vLLM's --speculative-config serving an exported folder of this method with K drafts per round
        (None: the method's own choice)."""
        raise NotImplementedError

    def serve_command(self, target_path, folder: Path, K: int) -> str:
        """The `vllm serve` command of the target with an exported folder drafting K tokens per round."""
        spec = json.dumps(self.serve_config(str(Path(folder).resolve()), K))
        return f"vllm serve {target_path} --speculative-config '{spec}'"

    def export(self, recipe, folder, formats: list[str], drafter, target, embed: torch.Tensor, t_start: float) -> dict:
        """The engine folders of a trained drafter and their serve commands -> the export stage's record."""
        raise NotImplementedError

    def record_export(self, recipe, folder, t_start: float, commands: dict, written: dict, **extra) -> dict:
        """The export stage's record of the folders written (`written`: format -> path and layout) and
        their serve commands; `extra` (embed_included, speculative_tokens) as the method knows them."""
        first = next(iter(commands))
        return folder.record(
            "export",
            state="done",
            config=recipe.export,
            counts={"formats": len(written)},
            seconds=time.time() - t_start,
            extra={
                "method": self.name,
                "folders": written,
                "serve_command": commands[first],
                "serve_commands": commands,
                **extra,
            },
        )

    def refuse_init_from(self, cfg) -> None:
        """train.init_from reads a published EAGLE-3 drafter, which only EAGLE-3 can start from."""
        if cfg.init_from:
            raise ConfigError(
                "train.init_from starts from a published EAGLE-3 drafter; with train.method = "
                f"'{self.name}' leave it empty"
            )

    def import_folder(self, folder: Path, target, out: Path, extracted_aux_layer_ids: list[int] | None):
        """A published folder -> a specdraft checkpoint at `out`, checked against `target` -> (drafter,
        what was read: .layout and .notes)."""
        raise NotImplementedError

    def describe(self, drafter) -> str:
        """One line about a drafter, for import."""
        raise NotImplementedError

    def diagnose(
        self, folder: Path, config: dict, target, run_path: Path | None, measured: bool, conversations
    ) -> list:
        """doctor's checks of an engine folder of this method (each a checks.Check)."""
        raise NotImplementedError
