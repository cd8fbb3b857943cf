"""P-EAGLE (parallel EAGLE): EAGLE-3's drafter on the target's aux states that drafts K tokens in one
forward, the next token's real slot followed by K - 1 mask slots, as vLLM 0.32 serves it with
`{"method": "eagle3", "parallel_drafting": true}` (docs/peagle.md).

- drafter.py: the drafter, top to bottom (its layers are drafters/common.py's, shared with EAGLE-3);
- objective.py: a block of K slots anchored at every position, trained in one forward;
- formats.py: the speculators `peagle` folder vLLM serves, written and read;
- decode.py: its state on the eager and static engines, and its rounds;
- doctor.py: doctor's checks of its folders;
- this file: the method as the registry lists it (contract.Method), its export and import.

Train fields it reads: ttt_steps (K, the slots trained per block), step_weight_decay (slot i weighs
decay^i), mask_token_id (-1: the target's default mask token, as DFlash's), draft_vocab_size,
lm_head_init, norm_before_residual, norm_before_fc, loss, hidden_noise, gradient_checkpointing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdraft.config import ConfigError, beyond
from specdraft.drafters import vocab
from specdraft.drafters.checkpoint import refuse_misfits, save_imported
from specdraft.drafters.common import REEXPORT, default_mask_token, provenance
from specdraft.files import read_json
from specdraft.methods.contract import Decode, Method
from specdraft.methods.peagle import doctor
from specdraft.methods.peagle.decode import speculative_peagle
from specdraft.methods.peagle.drafter import PEagleConfig, PEagleDrafter
from specdraft.methods.peagle.formats import is_peagle, problems, read_config, read_peagle, served_k, write_peagle
from specdraft.methods.peagle.objective import ParallelSlots
from specdraft.run import staged_folders


def mask_token(cfg, target) -> int:
    """train.mask_token_id, or the target's default mask token; refused outside the vocabulary."""
    mask = cfg.mask_token_id if cfg.mask_token_id >= 0 else default_mask_token(target.tokenizer, target.vocab_size)
    if mask >= target.vocab_size:
        raise ValueError(
            f"train.mask_token_id = {mask} is outside its range: < {target.vocab_size:,} (the vocabulary "
            f"of {target.path})"
        )
    return mask


def build(cfg, target, counts: torch.Tensor) -> PEagleDrafter:
    """The drafter on the target's frozen embedding, with the draft vocabulary of `counts` and lm_head as
    train.lm_head_init says (as EAGLE-3's)."""
    dcfg = PEagleConfig.from_target(
        target, cfg.draft_vocab_size, mask_token(cfg, target), cfg.ttt_steps, cfg.peagle_layers
    )
    dcfg.norm_before_residual, dcfg.norm_before_fc = cfg.norm_before_residual, cfg.norm_before_fc
    drafter = PEagleDrafter(dcfg)
    d2t, t2d = vocab.build(counts, dcfg.draft_vocab_size)
    drafter.embed_tokens.weight.data.copy_(target.embed_weight().float())
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    if cfg.lm_head_init.startswith("target"):
        drafter.lm_head.weight.data.copy_(target.head_weight()[drafter.t2d].float())
        drafter.norm.weight.data.copy_(target.final_norm_weight())
        drafter.lm_head.weight.requires_grad_(cfg.lm_head_init == "target")
    return drafter


def export(recipe, folder, formats: list[str], drafter: PEagleDrafter, target, embed, t_start: float) -> dict:
    """The folder vLLM serves with parallel drafting, K = eval.draft_tokens (at most the K trained);
    refused before anything is written where vLLM would refuse it or serve another network."""
    if formats != ["vllm"]:
        raise ValueError(f"export: a P-EAGLE drafter has vLLM's folder format only, not {formats}; use --formats vllm")
    K, trained = recipe.eval.draft_tokens, drafter.config.speculative_tokens
    if K > trained:
        raise ValueError(
            f"eval.draft_tokens = {K}: the drafter was trained for K = {trained} "
            f"(train.ttt_steps); export at most {trained}, or train with ttt_steps >= {K}"
        )
    include_embed = not torch.equal(drafter.embed_tokens.weight.detach(), embed.float())
    out = folder.export("vllm")
    with staged_folders(out) as (staged,):  # the last good folder stays until this one is whole
        write_peagle(
            drafter,
            staged,
            verifier=str(target.path),
            verifier_architectures=list(target.config.architectures or []),
            speculative_tokens=K,
            include_embed=include_embed,
            provenance=provenance(recipe.name),
        )
    command = METHOD.serve_command(target.path, out, K)
    print(
        f"export: vLLM P-EAGLE drafter in {out} ({K} parallel drafts per round of the {trained} trained, mask "
        f"token {drafter.config.mask_token_id})\n  serve it with:\n  {command}\n\nnext: specdraft doctor {out}"
    )
    written = {"vllm": {"path": str(out.relative_to(folder.path)), "format": "speculators (peagle)"}}
    k = {"value": K, "source": "recipe (eval.draft_tokens)", "trained": trained}
    return METHOD.record_export(
        recipe, folder, t_start, {"vllm": command}, written, embed_included=include_embed, speculative_tokens=k
    )


@dataclass
class PEagleRead:
    layout: str
    notes: list[str]


def import_folder(folder: Path, target, out: Path, extracted_aux_layer_ids: list[int] | None = None):
    """A P-EAGLE folder -> a specdraft checkpoint at `out`, after checking it against `target`."""
    notes: list[str] = []
    config = read_config(folder)
    found = problems(config)
    if found:  # one line: what vLLM would refuse or serve wrong, and the fix
        raise ValueError(f"import: {folder}: " + "; ".join(f"{p} ({fix})" for p, fix in found))
    drafter = read_peagle(folder, target.embed_weight(), notes)
    cfg = drafter.config
    bad = []
    if cfg.vocab_size != target.vocab_size or cfg.mask_token_id >= target.vocab_size:
        bad.append(
            f"vocab_size {cfg.vocab_size} / mask token {cfg.mask_token_id}: the target's vocabulary is "
            f"{target.vocab_size}"
        )
    if cfg.target_hidden_size != target.hidden_size:
        bad.append(f"target_hidden_size: drafter {cfg.target_hidden_size}, target {target.hidden_size}")
    outside = [k for k in cfg.aux_layer_ids if not 1 <= k < target.num_layers]
    if outside:
        bad.append(f"aux layer ids {outside} outside 1..{target.num_layers - 1}")
    refuse_misfits(folder, target, bad, cfg.aux_layer_ids, extracted_aux_layer_ids)
    if "para_depths" not in config:
        notes.append(f"para_depths: absent; the K trained taken as the K served, {cfg.speculative_tokens}")
    save_imported(drafter, target, folder, out, "speculators (peagle)", notes)
    return drafter, PEagleRead("speculators (peagle)", notes)


class PEagle(Method):
    name = "peagle"
    title = "P-EAGLE"
    config_class = PEagleConfig
    drafter_class = PEagleDrafter
    position = "slot"
    first_position = 1
    resume_fixed = ("ttt_steps", "peagle_layers", "mask_token_id", "norm_before_fc", "norm_before_residual")
    formats = ("vllm",)

    def check(self, recipe) -> None:
        """Train choices P-EAGLE does not take, and a packed row too short for its slots."""
        cfg = recipe.train
        self.refuse_init_from(cfg)
        if cfg.fc_norm or cfg.norm_output:
            raise ConfigError(
                "train.fc_norm / train.norm_output: P-EAGLE feeds no output state forward and vLLM's "
                "peagle folder carries neither norm; set both false with train.method = 'peagle'"
            )
        if cfg.batch_tokens < cfg.ttt_steps + 2:
            raise beyond(
                "train.batch_tokens",
                cfg.batch_tokens,
                f">= train.ttt_steps + 2 = {cfg.ttt_steps + 2}",
                "a packed row must hold a token and the labels of its every slot",
            )

    def check_target(self, recipe, vocab_size: int, target: str) -> None:
        self.check_mask_token(recipe, vocab_size, target)

    def build(self, cfg, target, counts: torch.Tensor) -> PEagleDrafter:
        return build(cfg, target, counts)

    def objective(self, drafter: PEagleDrafter, draft_head: torch.Tensor, cfg) -> nn.Module:
        return ParallelSlots(
            drafter, draft_head, cfg.step_weight_decay, cfg.loss, cfg.gradient_checkpointing, cfg.hidden_noise
        )

    def positions(self, cfg) -> int:
        return cfg.ttt_steps

    def loss_weights(self, cfg) -> list[float]:
        return [cfg.step_weight_decay**i for i in range(cfg.ttt_steps)]

    def goal(self, train: dict, export: dict, eval: dict, vocab: str) -> tuple[str, int]:
        return (
            f"P-EAGLE drafter ({train['ttt_steps']} parallel slots) trained for {train['epochs']} epochs with "
            f"{vocab}, exported for vLLM"
        ), min(eval["draft_tokens"], train["ttt_steps"])

    def plan_config(self, target, cfg) -> PEagleConfig:
        """The drafter `build` makes, without reading the tokenizer (the mask token does not change the bill)."""
        return PEagleConfig.from_target(
            target, cfg.draft_vocab_size, max(0, cfg.mask_token_id), cfg.ttt_steps, cfg.peagle_layers
        )

    def queries(self, cfg) -> float:
        """One per slot: K queries per batch token (each anchors a block of K)."""
        return cfg.ttt_steps

    def decodings(self, runner, drafter: PEagleDrafter, cfg) -> dict[str, Decode]:
        """K = eval.draft_tokens parallel drafts per round (at most the K trained)."""
        K = min(cfg.draft_tokens, drafter.config.speculative_tokens)

        def run(runner, drafter, prompt, max_new, eos, stats):
            return speculative_peagle(runner, drafter, prompt, max_new, eos, K, stats)

        trained = drafter.config.speculative_tokens
        return {
            "parallel": Decode(
                K, {"drafted": K, "trained": trained}, run, describe=f"{K} drafted per forward (trained for {trained})"
            )
        }

    def owns(self, config: dict) -> bool:
        return is_peagle(config)

    def serve_config(self, folder: str, K: int | None) -> dict:
        """K drafts per round: the folder's served K unless given."""
        if K is None:
            K = served_k(read_json(Path(folder) / "config.json", fix=REEXPORT)) or 1
        return {"method": "eagle3", "parallel_drafting": True, "model": str(folder), "num_speculative_tokens": K}

    def export(self, recipe, folder, formats, drafter, target, embed, t_start) -> dict:
        return export(recipe, folder, formats, drafter, target, embed, t_start)

    def import_folder(self, folder, target, out, extracted_aux_layer_ids):
        return import_folder(folder, target, out, extracted_aux_layer_ids)

    def describe(self, drafter) -> str:
        cfg = drafter.config
        return (
            f"P-EAGLE, {cfg.num_layers} layer(s), hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads x "
            f"{cfg.head_dim}, draft vocab {cfg.draft_vocab_size} of {cfg.vocab_size}, aux layers {cfg.aux_layer_ids}, "
            f"K {cfg.speculative_tokens}, mask token {cfg.mask_token_id}"
        )

    def diagnose(self, folder, config, target, run_path, measured, conversations) -> list:
        return doctor.diagnose(folder, config, target, run_path, measured, conversations)


METHOD = PEagle()
