"""Drafter methods: what differs between EAGLE-3 and DFlash, one entry each, behind one small table.

A method is a choice inside one design (`train.method`): every method trains from the same extracted
hidden states, in the same trainer loop, and is measured by the same eval. What differs is here:

- `build`: the drafter for a target, on its frozen embedding (and lm_head where it shares it);
- `objective`: the module the trainer steps, batch dict -> (loss, per-position statistics
  [positions, len(ttt.STAT_COLUMNS)]) read by ttt.summarize;
- `positions` and `loss_weights`: how many statistic rows that is and the weight of each in the
  logged loss (EAGLE-3: TTT steps decaying by step_weight_decay; DFlash: block slots decaying by
  exp(-(j - 1) / gamma));
- `plan_config` and `queries`: what plan bills (the drafter's config; how many drafter queries a
  batch token costs: EAGLE-3 one per TTT step, DFlash block_size per anchor);
- `decodings`: the reference decoder's ways of drafting, each a function of (runner, drafter, prompt,
  max_new, eos, stats) (EAGLE-3: a chain and a tree; DFlash: one block per round), all rounds of
  decoding/rounds.py's one loop;
- `position` and `first_position`: what a statistic row is called in the training curves (TTT step
  0, 1, ... or block slot 1, 2, ...).

Which method a saved drafter belongs to is its class's METHOD (written into checkpoints), so readers
dispatch on the drafter they load, never on a recipe that may have changed since.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specdraft.config import EvalConfig, TrainConfig
from specdraft.decoding.dflash import speculative_dflash
from specdraft.decoding.rounds import speculative
from specdraft.decoding.tree import TreeShape
from specdraft.drafters import vocab
from specdraft.drafters.checkpoint import init_from
from specdraft.drafters.dflash import DFlashConfig, DFlashDrafter, default_mask_token
from specdraft.drafters.dflash_objective import DFlashObjective, slot_weights
from specdraft.drafters.eagle3 import DrafterConfig, Eagle3Drafter
from specdraft.drafters.ttt import TTT

Decoding = Callable  # (runner, drafter, prompt ids, max_new, eos, Stats) -> generated ids


@dataclass(frozen=True)
class Decode:
    """One way the reference decoder drafts: `depth` drafted tokens per round at most, `shape` as
    reported (JSON-ready), `run` the decoding function."""
    depth: int
    shape: dict
    run: Decoding


@dataclass(frozen=True)
class Method:
    name: str
    build: Callable  # (TrainConfig, Target, answer-token counts) -> drafter
    objective: Callable  # (drafter, target's lm_head rows of the draft vocab, TrainConfig) -> nn.Module
    positions: Callable  # TrainConfig -> statistic rows per step
    loss_weights: Callable  # TrainConfig -> weight of each row in the logged loss
    decodings: Callable  # (target runner, drafter, EvalConfig) -> {name: Decode}, the first headlining the report
    check: Callable  # TrainConfig -> None, raising ValueError for a choice the method does not take
    plan_config: Callable  # (Target, TrainConfig) -> the drafter's config, for plan's bill
    queries: Callable  # TrainConfig -> drafter queries per batch token (each through every drafter layer)
    position: str  # what one statistic row is, as plots and logs name it
    first_position: int  # the number of the first row (TTT steps count from 0, drafted block slots from 1)

    def position_labels(self, n: int) -> list[str]:
        """The names of n statistic rows: 'TTT step 0', ... or 'block slot 1', ..."""
        return [f"{self.position} {self.first_position + i}" for i in range(n)]


# ---------------------------------------------------------------------------------------------------
# EAGLE-3


def build_eagle3(cfg: TrainConfig, target, counts: torch.Tensor) -> Eagle3Drafter:
    """The drafter on the target's embedding, with the draft vocabulary of `counts` (or init_from's)
    and lm_head as train.lm_head_init says."""
    from pathlib import Path

    dcfg = DrafterConfig.from_target(target, cfg.draft_vocab_size)  # its size: 0 is the whole vocabulary
    d2t, t2d = vocab.build(counts, dcfg.draft_vocab_size)
    dcfg.norm_before_fc, dcfg.fc_norm, dcfg.norm_output = cfg.norm_before_fc, cfg.fc_norm, cfg.norm_output
    dcfg.norm_before_residual = cfg.norm_before_residual
    drafter = Eagle3Drafter(dcfg)
    embed = target.embed_weight().float()
    drafter.embed_tokens.weight.data.copy_(embed)
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    if cfg.init_from:
        # Its lm_head rows belong to its own draft vocabulary, so that vocabulary is kept.
        init_from(drafter, Path(cfg.init_from), embed)
    elif cfg.lm_head_init.startswith("target"):
        drafter.lm_head.weight.data.copy_(target.head_weight()[drafter.t2d].float())
        drafter.norm.weight.data.copy_(target.final_norm_weight())
        # Frozen, the head is the target's own reading of a hidden state: the one layer learns to write
        # states it reads right, rather than Vd x H more parameters from few answer tokens.
        drafter.lm_head.weight.requires_grad_(cfg.lm_head_init == "target")
    return drafter


def eagle3_objective(drafter: Eagle3Drafter, draft_head: torch.Tensor, cfg: TrainConfig) -> nn.Module:
    return TTT(drafter, draft_head, cfg.ttt_steps, cfg.step_weight_decay, cfg.loss, cfg.gradient_checkpointing,
               cfg.hidden_noise)


def eagle3_decodings(runner, drafter: Eagle3Drafter, cfg: EvalConfig) -> dict[str, Decode]:
    """A chain of draft_tokens (what vLLM's num_speculative_tokens serves) and an EAGLE-2 tree."""
    tree = TreeShape(cfg.tree_topk, cfg.tree_depth, cfg.tree_tokens)
    if "sliding" in runner.target.family.attention and tree.topk > 1:
        # A tree's 4-D mask replaces the model's own, which is where sliding windows and attention
        # sinks live (gpt-oss): verified that way the tree is not exact. Such targets are measured with
        # chains (a chain's mask is the model's causal one).
        print(f"eval: {runner.target.family.attention} attention: tree drafting measured as a chain of {tree.depth}")
        tree = TreeShape.chain(tree.depth)
    return {name: Decode(shape.depth, vars(shape), _tree_decoding(shape))
            for name, shape in (("chain", TreeShape.chain(cfg.draft_tokens)), ("tree", tree))}


def _tree_decoding(shape: TreeShape) -> Decoding:
    return lambda runner, drafter, prompt, max_new, eos, stats: speculative(
        runner, drafter, prompt, max_new, eos, shape, stats)


def check_eagle3(cfg: TrainConfig) -> None:
    """Every EAGLE-3 choice is a field's Literal, checked when the recipe loads."""


# ---------------------------------------------------------------------------------------------------
# DFlash


def build_dflash(cfg: TrainConfig, target, counts: torch.Tensor) -> DFlashDrafter:
    """A drafter as wide as the target, reading the same aux layers as EAGLE-3 (so one extract serves
    both), on the target's frozen embedding. Over the whole vocabulary (draft_vocab_size 0) it shares
    the target's lm_head and final norm, frozen, as vLLM serves it; a smaller draft vocabulary has its
    own lm_head, started as train.lm_head_init says."""
    mask = cfg.mask_token_id if cfg.mask_token_id >= 0 else default_mask_token(target.tokenizer, target.vocab_size)
    dcfg = DFlashConfig.from_target(target, mask_token_id=mask, block_size=cfg.block_size,
                                    num_layers=cfg.dflash_layers, draft_vocab_size=cfg.draft_vocab_size or None)
    drafter = DFlashDrafter(dcfg)
    drafter.embed_tokens.weight.data.copy_(target.embed_weight().float())
    if not dcfg.shares_lm_head:
        d2t, t2d = vocab.build(counts, dcfg.draft_vocab_size)
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
    if dcfg.shares_lm_head or cfg.lm_head_init.startswith("target"):
        drafter.lm_head.weight.data.copy_(target.head_weight()[drafter.t2d].float())
        drafter.norm.weight.data.copy_(target.final_norm_weight())
        drafter.lm_head.weight.requires_grad_(not dcfg.shares_lm_head and cfg.lm_head_init == "target")
    return drafter


def dflash_objective(drafter: DFlashDrafter, draft_head: torch.Tensor, cfg: TrainConfig) -> nn.Module:
    return DFlashObjective(drafter, draft_head, cfg.dflash_gamma, cfg.dflash_anchors, cfg.loss)


def dflash_decodings(runner, drafter: DFlashDrafter, cfg: EvalConfig) -> dict[str, Decode]:
    """One block per round: K = block_size - 1 drafts, the K vLLM serves (the drafter was trained on
    blocks of that size, so eval.draft_tokens does not apply)."""
    c = drafter.config
    return {"block": Decode(c.speculative_tokens, {"block_size": c.block_size, "drafted": c.speculative_tokens},
                            speculative_dflash)}


def plan_dflash(target, cfg: TrainConfig) -> DFlashConfig:
    """The drafter build_dflash makes, without reading the tokenizer: the mask token's id does not
    change the bill."""
    return DFlashConfig.from_target(target, mask_token_id=max(0, cfg.mask_token_id), block_size=cfg.block_size,
                                    num_layers=cfg.dflash_layers, draft_vocab_size=cfg.draft_vocab_size or None)


def dflash_queries(cfg: TrainConfig) -> float:
    """Block slots per batch token, at most: dflash_anchors blocks of block_size per packed row of
    batch_tokens (fewer where a row has fewer assistant tokens)."""
    return min(cfg.dflash_anchors, cfg.batch_tokens) * cfg.block_size / cfg.batch_tokens


# Through the target's lm_head (shared, or started from it) DFlash learnt nothing past the unigram at
# lr 3e-3 with a short warmup, and memorised at 3e-4, or at 1e-3 after 50 warmup steps (bench/RESULTS.md).
DFLASH_TARGET_HEAD_MAX_LR = 3e-4
DFLASH_LONG_WARMUP = 50


def check_dflash(cfg: TrainConfig) -> None:
    if cfg.init_from:
        raise ValueError("train.init_from starts from a published EAGLE-3 drafter; with train.method = 'dflash' "
                         "leave it empty")
    target_head = cfg.draft_vocab_size == 0 or cfg.lm_head_init != "random"
    if target_head and cfg.lr > DFLASH_TARGET_HEAD_MAX_LR and cfg.warmup_steps < DFLASH_LONG_WARMUP:
        # A warning, not a refusal: a large data set may well train at it; the small ones measured did not.
        print(f"train: warning: a DFlash drafter reading through the target's lm_head at lr {cfg.lr:g} with "
              f"{cfg.warmup_steps} warmup steps stalled at the unigram when measured; lr <= "
              f"{DFLASH_TARGET_HEAD_MAX_LR:g} or warmup_steps >= {DFLASH_LONG_WARMUP} trained (docs/dflash.md)")


# ---------------------------------------------------------------------------------------------------
# The table


METHODS: dict[str, Method] = {
    "eagle3": Method("eagle3", build_eagle3, eagle3_objective, lambda cfg: cfg.ttt_steps,
                     lambda cfg: [cfg.step_weight_decay ** i for i in range(cfg.ttt_steps)],
                     eagle3_decodings, check_eagle3,
                     lambda target, cfg: DrafterConfig.from_target(target, cfg.draft_vocab_size),
                     lambda cfg: cfg.ttt_steps, "TTT step", 0),
    "dflash": Method("dflash", build_dflash, dflash_objective, lambda cfg: cfg.block_size - 1,
                     lambda cfg: slot_weights(cfg.block_size, cfg.dflash_gamma)[1:].tolist(),
                     dflash_decodings, check_dflash, plan_dflash, dflash_queries, "block slot", 1),
}



def decodings_for(drafter, runner, cfg: EvalConfig) -> dict[str, Decode]:
    """The reference decoder's ways of drafting with a loaded drafter, by its method."""
    return METHODS[drafter.METHOD].decodings(runner, drafter, cfg)
