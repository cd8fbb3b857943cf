"""EAGLE-3: one decoder layer on the target's aux states, trained with training-time test, drafting a
chain or an EAGLE-2 tree step by step.

- drafter.py: the drafter, top to bottom;
- objective.py: training-time test (TTT), its loss and per-step statistics;
- formats.py: the engine folders (speculators / vLLM and the flat SGLang one), written and read;
- decode.py: its decode state on the eager and static engines, and its rounds;
- doctor.py: doctor's checks of its engine folders;
- this file: the method as the registry lists it (contract.Method), its export and import.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import torch
from torch import nn

from specdraft.config import beyond
from specdraft.decoding.tree import TreeShape
from specdraft.drafters import vocab
from specdraft.drafters.checkpoint import refuse_misfits, save_imported
from specdraft.drafters.common import provenance
from specdraft.files import FileError, read_json
from specdraft.methods.contract import Decode, Method
from specdraft.methods.eagle3 import doctor
from specdraft.methods.eagle3.decode import speculative, speculative_sampled
from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter
from specdraft.methods.eagle3.formats import (
    EMBED_KEY,
    FLAT_ARCHITECTURE,
    fit_problems,
    read_drafter,
    read_published,
    write_sglang,
    write_vllm,
)
from specdraft.methods.eagle3.objective import TTT
from specdraft.run import staged_folders


def init_from(drafter: Eagle3Drafter, folder: Path, embed: torch.Tensor) -> None:
    """Start from a published drafter (speculators `layers.0.*` or flat `midlayer.*` layout), after
    checking every shape against the drafter this target needs; a mismatch names each tensor."""

    src = read_drafter(Path(folder), embed)
    want = {k: v.shape for k, v in drafter.state_dict().items()}
    have = {k: v.shape for k, v in src.state_dict().items()}
    problems = [
        f"{k}: drafter for this target needs {tuple(want[k])}, {folder} has "
        f"{tuple(have[k]) if k in have else 'nothing'}"
        for k in want
        if have.get(k) != want[k]
    ]
    problems += [f"{k}: in {folder} but not used by this drafter" for k in have if k not in want]
    if problems:
        raise ValueError(f"train.init_from = {folder} does not fit the target:\n  " + "\n  ".join(problems))
    drafter.load_state_dict(src.state_dict())


# ---------------------------------------------------------------------------------------------------
# Export


def sglang_serve_command(target_path: str, drafter_dir: Path, speculative_tokens: int) -> str:
    """A chain of K drafted tokens: K steps of top-1, verified as K + 1 tokens."""
    k = speculative_tokens
    return (
        f"python -m sglang.launch_server --model-path {shlex.quote(str(target_path))} "
        f"--speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {shlex.quote(str(Path(drafter_dir).resolve()))} "
        f"--speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1} "
        f"--dtype bfloat16"
    )


def expected_speedups(per_position: list[float], cost: float) -> dict[int, float]:
    """Expected speedup of a chain of K drafts, for each K the eval measured: tokens per target step
    1 + p_1 + ... + p_K (p_i: share of rounds whose draft i was accepted, which a chain of K shares
    with a longer one) over the cost of K drafting steps at `cost` target steps each plus one
    verification, taken as one target step (decoding is memory-bound on GPUs; on this CPU the
    4-token verification measured 1.4x a single step, so CPU figures are optimistic)."""
    return {k: (1 + sum(per_position[:k])) / (1 + k * cost) for k in range(1, len(per_position) + 1)}


def choose_speculative_tokens(folder, default: int) -> dict:
    """The number of speculative tokens to serve with: the K of the best expected speedup from the
    run's eval report when it measured this drafter (eval finished after train), else `default`."""
    report_path = folder.eval_report
    train, evaluated = folder.stage("train") or {}, folder.stage("eval") or {}
    if (
        evaluated.get("state") != "done"
        or not report_path.exists()
        or evaluated.get("finished", "") < train.get("finished", "")
    ):
        return {
            "value": default,
            "source": "recipe (eval.draft_tokens); run eval, then export again, to choose it from measured acceptance",
        }
    fix = "rerun `specdraft eval` to write it again"
    report = read_json(report_path, fix=fix)
    acceptance, cost = report.get("per_position_acceptance"), report.get("draft_to_target_cost")
    if not (
        isinstance(acceptance, list)
        and acceptance
        and all(isinstance(a, (int, float)) for a in acceptance)
        and isinstance(cost, (int, float))
    ):
        raise FileError(f"{report_path}: no per_position_acceptance list and draft_to_target_cost; {fix}")
    speedups = expected_speedups(acceptance, cost)
    best = max(speedups, key=speedups.get)
    return {
        "value": best,
        "source": "eval/report.json",
        "expected_speedup": {k: round(v, 3) for k, v in speedups.items()},
        "per_position_acceptance": acceptance,
        "draft_to_target_cost": cost,
        "measured_up_to": len(speedups),
    }


# ---------------------------------------------------------------------------------------------------
# The method


def _tree_decoding(shape: TreeShape):
    return lambda runner, drafter, prompt, max_new, eos, stats: speculative(
        runner, drafter, prompt, max_new, eos, shape, stats
    )


class Eagle3(Method):
    name = "eagle3"
    title = "EAGLE-3"
    config_class = DrafterConfig
    drafter_class = Eagle3Drafter
    position = "TTT step"
    first_position = 0
    resume_fixed = ("ttt_steps", "norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")
    formats = ("vllm", "sglang")
    samples = True

    def check(self, recipe) -> None:
        """A packed row holds a token and the labels of its every training-time-test step."""
        t = recipe.train
        if t.batch_tokens < t.ttt_steps + 2:
            raise beyond(
                "train.batch_tokens",
                t.batch_tokens,
                f">= train.ttt_steps + 2 = {t.ttt_steps + 2}",
                "a packed row must hold a token and the labels of its every training-time-test step",
            )

    def build(self, cfg, target, counts: torch.Tensor) -> Eagle3Drafter:
        """The drafter on the target's embedding, with the draft vocabulary of `counts` (or init_from's)
        and lm_head as train.lm_head_init says."""
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

    def objective(self, drafter: Eagle3Drafter, draft_head: torch.Tensor, cfg) -> nn.Module:
        return TTT(
            drafter,
            draft_head,
            cfg.ttt_steps,
            cfg.step_weight_decay,
            cfg.loss,
            cfg.gradient_checkpointing,
            cfg.hidden_noise,
        )

    def positions(self, cfg) -> int:
        return cfg.ttt_steps

    def loss_weights(self, cfg) -> list[float]:
        return [cfg.step_weight_decay**i for i in range(cfg.ttt_steps)]

    def goal(self, train: dict, export: dict, eval: dict, vocab: str) -> tuple[str, int]:
        return (
            f"EAGLE-3 drafter trained for {train['epochs']} epochs with {train['ttt_steps']} TTT steps and "
            f"{vocab}, exported for {', '.join(export['formats'])}"
        ), eval["draft_tokens"]

    def plan_config(self, target, cfg) -> DrafterConfig:
        return DrafterConfig.from_target(target, cfg.draft_vocab_size)

    def queries(self, cfg) -> float:
        """One per TTT step."""
        return cfg.ttt_steps

    def decodings(self, runner, drafter: Eagle3Drafter, cfg) -> dict[str, Decode]:
        """A chain of draft_tokens (what vLLM's num_speculative_tokens serves) and an EAGLE-2 tree."""
        tree = TreeShape(cfg.tree_topk, cfg.tree_depth, cfg.tree_tokens)
        if "sliding" in runner.target.family.attention and tree.topk > 1:
            # A tree's 4-D mask replaces the model's own, which is where sliding windows and attention
            # sinks live (gpt-oss): verified that way the tree is not exact. Such targets are measured with
            # chains (a chain's mask is the model's causal one).
            print(
                f"eval: {runner.target.family.attention} attention: tree drafting measured as a chain of {tree.depth}"
            )
            tree = TreeShape.chain(tree.depth)
        return {
            name: Decode(
                shape.depth,
                vars(shape),
                _tree_decoding(shape),
                describe=f"top-k {shape.topk}, depth {shape.depth}, {shape.tokens} tokens",
            )
            for name, shape in (("chain", TreeShape.chain(cfg.draft_tokens)), ("tree", tree))
        }

    def sampled(self, runner, drafter, prompt, max_new, eos, K, temperature, stats, generator):
        return speculative_sampled(runner, drafter, prompt, max_new, eos, K, temperature, stats, generator)

    def serve_config(self, folder: str, K: int | None) -> dict:
        """A chain of K (3 unless given)."""
        return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K or 3}

    def export(self, recipe, folder, formats, drafter, target, embed, t_start) -> dict:
        """The speculators and flat folders, with the K of the best expected speedup once eval measured it."""
        k = choose_speculative_tokens(folder, recipe.eval.draft_tokens)
        speculative_tokens = k["value"]
        if "expected_speedup" in k:
            table = ", ".join(f"K={n}: {v:.2f}x" for n, v in k["expected_speedup"].items())
            print(
                f"export: {speculative_tokens} speculative tokens, the best expected speedup from the eval report "
                f"({table}; draft/target cost {k['draft_to_target_cost']})"
            )
        else:
            print(f"export: {speculative_tokens} speculative tokens from the {k['source']}")
        # The embedding is frozen at the target's during training, so the engine's shared copy is identical.
        include_embed = not torch.equal(drafter.embed_tokens.weight.detach(), embed.float())
        written, commands = {}, {}
        # Every format's folder written under a temporary name, all swapped in at the end: a format refused
        # or failing midway leaves the last good export's folders as they were.
        with staged_folders(*(folder.export(fmt) for fmt in formats)) as staged:
            for fmt, tmp in zip(formats, staged):
                out = folder.export(fmt)
                if fmt == "vllm":
                    write_vllm(
                        drafter,
                        tmp,
                        verifier=str(target.path),
                        verifier_architectures=list(target.config.architectures or []),
                        speculative_tokens=speculative_tokens,
                        include_embed=include_embed,
                        provenance=provenance(recipe.name),
                    )
                    commands[fmt] = self.serve_command(target.path, out, speculative_tokens)
                else:
                    write_sglang(drafter, tmp, include_embed=include_embed, provenance=provenance(recipe.name))
                    commands[fmt] = sglang_serve_command(str(target.path), out, speculative_tokens)
                layout = "speculators (Eagle3Speculator)" if fmt == "vllm" else f"flat ({FLAT_ARCHITECTURE})"
                written[fmt] = {"path": str(out.relative_to(folder.path)), "format": layout}
        engines = {"vllm": "vLLM", "sglang": "SGLang"}
        for fmt in formats:
            print(f"export: {engines[fmt]} drafter in {folder.export(fmt)}\n  serve it with:\n  {commands[fmt]}")
        print(f"\nnext: specdraft doctor {folder.export(formats[0])}")
        return self.record_export(
            recipe, folder, t_start, commands, written, embed_included=include_embed, speculative_tokens=k
        )

    def import_folder(self, folder, target, out, extracted_aux_layer_ids=None):
        """A published drafter folder -> a specdraft checkpoint at `out` (the trainer's checkpoint format,
        which eval, export and fine-tuning read), after checking it against `target` (and against the
        layers a run's hidden states hold, when given). Any misfit is an error that lists every one."""
        folder = Path(folder)
        published = read_published(folder, target.default_aux_layer_ids())
        refuse_misfits(
            folder,
            target,
            fit_problems(published.config, target, EMBED_KEY[1] in published.tensors),
            published.config.aux_layer_ids,
            extracted_aux_layer_ids,
        )
        embed = target.embed_weight()
        drafter = published.build(embed)
        if EMBED_KEY[1] in published.tensors and not torch.equal(drafter.embed_tokens.weight, embed.float()):
            published.notes.append("embed_tokens: differs from the target's; kept in the checkpoint")
        save_imported(drafter, target, folder, out, published.layout, published.notes)
        return drafter, published

    def describe(self, drafter) -> str:
        cfg = drafter.config
        return (
            f"EAGLE-3, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads x {cfg.head_dim}, draft vocab "
            f"{cfg.draft_vocab_size} of {cfg.vocab_size}, aux layers {cfg.aux_layer_ids}, "
            f"norm_before_residual {cfg.norm_before_residual}"
        )

    def diagnose(self, folder, config, target, run_path, measured, conversations) -> list:
        return doctor.diagnose(folder, config, target, run_path, measured, conversations)


METHOD = Eagle3()
