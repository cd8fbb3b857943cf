"""DFlash (block diffusion drafting): a few decoder layers on the target's aux states that draft a whole
block of block_size - 1 tokens in one forward, from the anchor and mask slots.

- drafter.py: the drafter, top to bottom;
- objective.py: many blocks per sequence in one forward, position-weighted;
- formats.py: vLLM's `method: dflash` folder (and the speculators library's), written and read;
- decode.py: its block context on the eager and static engines, and its rounds;
- doctor.py: doctor's checks of its folders;
- this file: the method as the registry lists it (contract.Method), its export and import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdraft.config import beyond
from specdraft.drafters import vocab
from specdraft.drafters.checkpoint import refuse_misfits, save_imported
from specdraft.drafters.common import REEXPORT, provenance
from specdraft.files import read_json
from specdraft.methods.contract import Decode, Method
from specdraft.methods.dflash import doctor
from specdraft.methods.dflash.decode import speculative_dflash
from specdraft.methods.dflash.drafter import DFlashConfig, DFlashDrafter, default_mask_token
from specdraft.methods.dflash.formats import is_dflash, is_speculators, problems, read_dflash, write_dflash
from specdraft.methods.dflash.objective import DFlashObjective, slot_weights
from specdraft.run import staged_folders

# Through the target's lm_head (shared, or started from it) DFlash learnt nothing past the unigram at
# lr 3e-3 with a short warmup, and memorised at 3e-4, or at 1e-3 after 50 warmup steps (bench/RESULTS.md).
DFLASH_TARGET_HEAD_MAX_LR = 3e-4
DFLASH_LONG_WARMUP = 50


def warn_of_stalling(cfg) -> None:
    """A warning, not a refusal: a large data set may well train at such an lr; the small ones measured did not."""
    target_head = cfg.draft_vocab_size == 0 or cfg.lm_head_init != "random"
    if target_head and cfg.lr > DFLASH_TARGET_HEAD_MAX_LR and cfg.warmup_steps < DFLASH_LONG_WARMUP:
        print(
            f"train: warning: a DFlash drafter reading through the target's lm_head at lr {cfg.lr:g} with "
            f"{cfg.warmup_steps} warmup steps stalled at the unigram when measured; lr <= "
            f"{DFLASH_TARGET_HEAD_MAX_LR:g} or warmup_steps >= {DFLASH_LONG_WARMUP} trained (docs/dflash.md)"
        )


@dataclass
class DFlashRead:
    layout: str
    notes: list[str]  # how it was read: vLLM's defaults taken, an embedding of its own


class DFlash(Method):
    name = "dflash"
    title = "DFlash"
    config_class = DFlashConfig
    drafter_class = DFlashDrafter
    position = "block slot"
    first_position = 1
    resume_fixed = ("block_size", "dflash_layers", "mask_token_id")
    formats = ("vllm",)

    def check(self, recipe) -> None:
        """What DFlash cannot train: a published EAGLE-3 drafter to start from, a block longer than a sample
        or a packed row."""
        cfg = recipe.train
        self.refuse_init_from(cfg)
        for name, limit in (("train.batch_tokens", cfg.batch_tokens), ("render.max_length", recipe.render.max_length)):
            if cfg.block_size > limit:
                raise beyond(
                    "train.block_size",
                    cfg.block_size,
                    f"<= {name} = {limit}",
                    "a block must fit within a sample and a packed row",
                )

    def check_target(self, recipe, vocab_size: int, target: str) -> None:
        self.check_mask_token(recipe, vocab_size, target)

    def build(self, cfg, target, counts: torch.Tensor) -> DFlashDrafter:
        """A drafter as wide as the target, reading the same aux layers as EAGLE-3 (so one extract serves
        both), on the target's frozen embedding. Over the whole vocabulary (draft_vocab_size 0) it shares
        the target's lm_head and final norm, frozen, as vLLM serves it; a smaller draft vocabulary has its
        own lm_head, started as train.lm_head_init says."""
        warn_of_stalling(cfg)
        mask = cfg.mask_token_id if cfg.mask_token_id >= 0 else default_mask_token(target.tokenizer, target.vocab_size)
        dcfg = DFlashConfig.from_target(
            target,
            mask_token_id=mask,
            block_size=cfg.block_size,
            num_layers=cfg.dflash_layers,
            draft_vocab_size=cfg.draft_vocab_size or None,
        )
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

    def objective(self, drafter: DFlashDrafter, draft_head: torch.Tensor, cfg) -> nn.Module:
        return DFlashObjective(drafter, draft_head, cfg.dflash_gamma, cfg.dflash_anchors, cfg.loss)

    def positions(self, cfg) -> int:
        return cfg.block_size - 1

    def loss_weights(self, cfg) -> list[float]:
        return slot_weights(cfg.block_size, cfg.dflash_gamma)[1:].tolist()

    def goal(self, train: dict, export: dict, eval: dict, vocab: str) -> tuple[str, int]:
        return (
            f"DFlash drafter ({train['dflash_layers']} layer(s), blocks of {train['block_size']}) trained for "
            f"{train['epochs']} epochs with {vocab}, exported for vLLM"
        ), train["block_size"] - 1

    def plan_config(self, target, cfg) -> DFlashConfig:
        """The drafter `build` makes, without reading the tokenizer: the mask token's id does not
        change the bill."""
        return DFlashConfig.from_target(
            target,
            mask_token_id=max(0, cfg.mask_token_id),
            block_size=cfg.block_size,
            num_layers=cfg.dflash_layers,
            draft_vocab_size=cfg.draft_vocab_size or None,
        )

    def queries(self, cfg) -> float:
        """Block slots per batch token, at most: dflash_anchors blocks of block_size per packed row of
        batch_tokens (fewer where a row has fewer assistant tokens)."""
        return min(cfg.dflash_anchors, cfg.batch_tokens) * cfg.block_size / cfg.batch_tokens

    def decodings(self, runner, drafter: DFlashDrafter, cfg) -> dict[str, Decode]:
        """One block per round: K = block_size - 1 drafts, the K vLLM serves (the drafter was trained on
        blocks of that size, so eval.draft_tokens does not apply)."""
        c = drafter.config
        return {
            "block": Decode(
                c.speculative_tokens,
                {"block_size": c.block_size, "drafted": c.speculative_tokens},
                speculative_dflash,
                describe=f"block of {c.block_size}: {c.speculative_tokens} drafted per forward",
            )
        }

    def owns(self, config: dict) -> bool:
        return is_dflash(config)

    def serve_config(self, folder: str, K: int | None) -> dict:
        """One block per round: K = block_size - 1 of the folder unless given."""
        if K is None:
            config = read_json(Path(folder) / "config.json", fix=REEXPORT)
            K = config.get("block_size", 0) - 1
        return {"method": "dflash", "model": str(folder), "num_speculative_tokens": K}

    def export(self, recipe, folder, formats, drafter, target, embed, t_start) -> dict:
        """vLLM's DFlash folder and its serve command; refused before anything is written where vLLM would
        not load it or would serve it as another network (formats.problems)."""
        if formats != ["vllm"]:
            raise ValueError(
                f"export: a DFlash drafter has vLLM's folder format only, not {formats}; use --formats vllm"
            )
        out = folder.export("vllm")
        with staged_folders(out) as (staged,):  # the last good folder stays until this one is whole
            write_dflash(drafter, staged, target_num_layers=target.num_layers, provenance=provenance(recipe.name))
        K = drafter.config.speculative_tokens
        command = self.serve_command(target.path, out, K)
        print(
            f"export: vLLM DFlash drafter in {out} (block of {drafter.config.block_size}, mask token "
            f"{drafter.config.mask_token_id})\n  serve it with:\n  {command}\n\nnext: specdraft doctor {out}"
        )
        k = {"value": K, "source": "block_size - 1 (the block the drafter was trained on)"}
        written = {"vllm": {"path": str(out.relative_to(folder.path)), "format": "DFlash (DFlashDraftModel)"}}
        return self.record_export(
            recipe, folder, t_start, {"vllm": command}, written, embed_included=False, speculative_tokens=k
        )

    def import_folder(self, folder, target, out, extracted_aux_layer_ids=None) -> tuple[DFlashDrafter, DFlashRead]:
        """A DFlash folder -> a specdraft checkpoint at `out`, after checking it against `target` as vLLM
        would serve it (the target's embedding and, over the whole vocabulary, its lm_head)."""
        if (Path(folder) / "mask_embedding.pt").exists():
            # vLLM feeds the mask slots that tensor instead of an embedding row, which our drafter has no place for.
            raise ValueError(
                f"import: {folder} ships mask_embedding.pt (a mask embedding apart from the vocabulary), "
                "which specdraft's DFlash drafter does not model"
            )
        notes: list[str] = []
        drafter = read_dflash(folder, target.embed_weight(), target.head_weight(), notes)
        cfg = drafter.config
        found = problems(cfg, target.num_layers)
        if cfg.vocab_size != target.vocab_size:
            found.append(f"vocab_size: drafter {cfg.vocab_size}, target {target.vocab_size} (another tokenizer)")
        if cfg.target_hidden_size != target.hidden_size:
            found.append(
                f"target_hidden_size: drafter {cfg.target_hidden_size}, target hidden_size {target.hidden_size}"
            )
        refuse_misfits(folder, target, found, cfg.aux_layer_ids, extracted_aux_layer_ids)
        if not torch.equal(drafter.embed_tokens.weight, target.embed_weight().float()):
            notes.append("embed_tokens: the folder's own, differing from the target's (vLLM keeps it); kept")
        config = read_json(Path(folder) / "config.json", fix=REEXPORT, kind=None)  # read_dflash has checked it
        published = DFlashRead("speculators (dflash)" if is_speculators(config) else "dflash", notes)
        save_imported(drafter, target, folder, out, published.layout, notes)
        return drafter, published

    def describe(self, drafter) -> str:
        cfg = drafter.config
        return (
            f"DFlash, {cfg.num_layers} layer(s), hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads x "
            f"{cfg.head_dim}, draft vocab {cfg.draft_vocab_size} of {cfg.vocab_size}, aux layers "
            f"{cfg.aux_layer_ids}, block {cfg.block_size}, mask token {cfg.mask_token_id}, rope theta "
            f"{cfg.rope_theta:g}"
        )

    def diagnose(self, folder, config, target, run_path, measured, conversations) -> list:
        return doctor.diagnose(folder, config, target, run_path, measured, conversations)


METHOD = DFlash()
