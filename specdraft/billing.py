"""plan: the disk, memory and time bill of a run before it starts, from the target's config alone.

No weights are read. The target is the stages' own `specdraft.targets.Target`, read from its config
alone (its shape, family, aux layers, quantization, chat template); a model built on the meta device
gives its parameter counts (total, routed experts, active per token); the drafter is the trainer's
(`DrafterConfig.from_target`), built on the meta device too, and the hidden states are billed at
extract's own bytes per token (`specdraft.hidden.store`).
Figures a run has already measured (tokens rendered, tokens/s of each stage) replace the assumed
ones, and every figure says where it came from.

    specdraft plan smollm2-cpu                 # a recipe
    specdraft plan runs/demo --json            # a run: its measured figures, recorded in its manifest
    specdraft plan recipes/x.toml --target path/to/config.json --gpus 8 --gpu-memory-gib 141
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from specdraft import environment
from specdraft.calibrate import Calibration, cached, calibrate, default_cache, has_weights
from specdraft.config import Recipe
from specdraft.data.sources import prompts
from specdraft.files import size_of
from specdraft.hidden.served import memory_bytes, state_file_bytes
from specdraft.hidden.store import TOKEN_BYTES, bytes_per_token, disk_bytes_per_token
from specdraft.methods import DEFAULT, named
from specdraft.run import RunFolder
from specdraft.targets import Target, template_thinking_markers

GiB = 2**30
TiB = 2**40

# Weight bytes per parameter of a quantized target (for the memory of a target resident in online
# mode): int4 carries a bf16 scale per group of 32 (4.5 / 8 bytes), mxfp4 an 8-bit one (4.25 / 8).
QUANT_BYTES = {"fp8": 1.0, "int4": 4.5 / 8, "mxfp4": 4.25 / 8}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Keep this share of the free disk unused: checkpoints, logs and the filesystem itself need room.
DISK_HEADROOM = 0.9
# Share of a device's memory a training process can use (CUDA context, allocator fragmentation).
MEMORY_HEADROOM = 0.9
# A batch size the plan recommends is a multiple of this many tokens.
BATCH_TOKENS_STEP = 256

# The trainer keeps fp32 master weights (autocast runs the matmuls in bf16), fp32 gradients and
# AdamW's two fp32 moments; the frozen embedding and the draft vocab's rows of the target's lm_head
# (the teacher) are fp32 too, and the target's full lm_head stays in bf16 for the top-token labels.
FP32, BF16 = 4, 2
ADAMW_STATES = 2

# Reference throughputs, measured on SmolLM2-135M-Instruct (bench/RESULTS.md), scaled to another model by
# forward FLOPs per token. SmolLM2 has 134,515,008 parameters, its tied head counted once: all of
# them are matmul weights per token (the embedding lookup is free, the head matmul is not).
REFERENCE_MODEL = "SmolLM2-135M-Instruct"
REFERENCE_MATMUL_PARAMS = 134_515_008
# Its drafter shape (hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536, 3 aux layers), for
# scaling the training reference by drafter FLOPs.
REFERENCE_DRAFTER = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "target_hidden_size": 576,
    "aux_layer_ids": [2, 15, 27],
}
REFERENCES = {
    # phase -> (tok/s, what was measured; draft vocab and TTT steps of the training reference)
    "cpu": {
        "gen": (20.0, "greedy bf16 decode, 2-core CPU, bench/RESULTS.md"),
        "extract": (814.0, "bf16 forward + hidden states over 8x512 tokens, 2-core CPU, bench/RESULTS.md"),
        "train": (86.7, "specdraft train, draft vocab 512, 3 TTT steps, 2-core CPU (tests' tiny run)", 512, 3),
        "eval": (10.0, "greedy fp32 decode, 2-core CPU, bench/RESULTS.md"),
    },
    "gpu": {
        "gen": (3361.0, "HF generate, batches of <= 512, H200, bench/RESULTS.md"),
        "extract": (460_000.0, "forward + 4 hidden states over 16x2048 tokens, H200, bench/RESULTS.md"),
        "train": (160_000.0, "speculators trainer, draft vocab 8192, 3 TTT steps, H200, bench/RESULTS.md", 8192, 3),
        "eval": (12.0, "eager HF generate at batch 1, H200, bench/RESULTS.md"),
    },
}


# Decodes eval runs of each prompt: autoregressive, a chain and a tree, each to eval.max_new_tokens.
EVAL_DECODES = 3


# --- the target, from its config ---------------------------------------------------------------


@dataclass
class TargetSpec:
    """A target as plan bills it: the stages' own `Target` (read from its config alone) and the parameter
    counts of its language model."""

    target: Target
    params: dict  # total / embedding / head / routed_experts / active / quantized / matmul_per_token

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    def weight_bytes(self) -> int:
        """The target's weights in memory as stored: the quantized matrices at their width (those the
        quantization config does not exempt), everything else in the checkpoint dtype."""
        q = self.target.architecture()["quantization"]
        per_param = QUANT_BYTES.get(q["kind"]) if q else None
        dtype = self.target.text_config.dtype or self.target.raw_config.get("torch_dtype") or "bfloat16"
        plain = DTYPE_BYTES.get(str(dtype).removeprefix("torch."), BF16)
        if per_param is None:
            return int(self.params["total"] * plain)
        quantized = self.params["quantized"]
        return int((self.params["total"] - quantized) * plain + quantized * per_param)

    def describe(self) -> dict:
        """The target as its config says it is (what STATUS.md shows under "Target as discovered"):
        `Target.architecture()` under the names STATUS.md reads, with the parameters and chat template."""
        t, arch = self.target.text_config, self.target.architecture()
        experts, template = arch["experts"], self.target.chat_template
        return {
            "config": str(self.target.config_file),
            "architectures": self.target.raw_config.get("architectures"),
            "model_type": arch["model_type"],
            "text_model_type": arch["text_model_type"],
            "num_layers": arch["layers"],
            "hidden_size": arch["hidden_size"],
            "intermediate_size": getattr(t, "intermediate_size", None),
            "num_attention_heads": arch["attention_heads"],
            "num_key_value_heads": arch["kv_heads"],
            "head_dim": getattr(t, "head_dim", None),
            "vocab_size": arch["vocab_size"],
            "tie_word_embeddings": arch["tied_embeddings"],
            "moe": None
            if not experts
            else {
                "routed_experts": experts["routed"],
                "shared_experts": experts["shared"],
                "top_k": experts["top_k"],
                "expert_intermediate_size": experts["intermediate_size"],
                "dense_layers": experts["dense_layers"],
            },
            "mla": arch["mla"],
            # Multi-token-prediction layers (absent from transformers' model; counted here).
            "mtp_layers": arch["mtp_layers"],
            "quantization": arch["quantization"],
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()[:16]
            if template is not None
            else None,
            "thinking_markers": [list(m) for m in template_thinking_markers(template)],
            "parameters": self.params,
        }


def _exempt(name: str, patterns: list[str]) -> bool:
    """Whether a module is left unquantized by a config's ignore list ("re:" regexes, globs or names)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return True
        # A module name or glob covers the modules under it too.
        elif any(fnmatch.fnmatch(name, p) for p in (pattern, pattern + ".*", "*." + pattern, "*." + pattern + ".*")):
            return True
    return False


def _count_params(target: Target) -> dict:
    """Parameter counts of the language model, built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(target.text_config)
    quantization = target.quantization_config or {}
    # compressed-tensors names what it leaves alone in "ignore", mxfp4 in "modules_to_not_convert".
    exempt = quantization.get("ignore") or quantization.get("modules_to_not_convert") or []
    total = experts = quantized = 0
    embed_weight = model.get_input_embeddings().weight
    head_weight = model.get_output_embeddings().weight
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is embed_weight and p is head_weight:
            continue  # tied: counted once, below, as the embedding
        total += p.numel()
        # Routed experts only: shared experts run for every token.
        if ".experts." in name:
            experts += p.numel()
        # Quantization applies to linear weights (2-D and up), never to the embedding.
        module = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
        if quantization and p.dim() >= 2 and p is not embed_weight and not _exempt(module, exempt):
            quantized += p.numel()
    embedding = embed_weight.numel()
    head = head_weight.numel()
    tied = embed_weight is head_weight
    total += embedding if tied else 0
    moe = target.architecture()["experts"]
    active = total - experts + (experts * moe["top_k"] // moe["routed"] if moe else 0)
    return {
        "total": total,
        "embedding": embedding,
        "head": head,
        "tied_head": tied,
        "routed_experts": experts,
        "active": active,
        "quantized": quantized,
        # Weights one token multiplies through: the active ones less the embedding, a lookup (a tied
        # embedding is counted once, as the head's matmul).
        "matmul_per_token": active - (0 if tied else embedding),
    }


def read_target(model: str, aux_layer_ids: list[int] | None = None) -> TargetSpec:
    """A target from its config alone (a config.json by any name, a folder with one, a .gguf file or a
    bundled name), as `Target` reads it for every stage, with its parameter counts."""
    target = Target(model, aux_layer_ids)
    return TargetSpec(target=target, params=_count_params(target))


def turns_answered(recipe: Recipe) -> int:
    """Answers gen writes per conversation at most: gen.max_turns (0: every user turn, bounded only by
    render.max_length); the source's own answers are first turns only."""
    return 1 if recipe.gen.answers == "source" else recipe.gen.max_turns


def per_conversation(recipe: Recipe, per_turn: int) -> int:
    """At most `per_turn` tokens a turn over the turns answered, never past render.max_length (gen stops
    a conversation's turns before they pass it)."""
    turns = turns_answered(recipe)
    return min(recipe.render.max_length, per_turn * turns) if turns else recipe.render.max_length


def expected_tokens(recipe: Recipe, folder: RunFolder | None, tokens_per_sample: int | None) -> dict:
    """Tokens the run will extract and train on: rendered when it has been, else samples x length."""
    stages = folder.manifest().get("stages", {}) if folder is not None else {}
    render = stages.get("render")
    if render and render.get("state") == "done" and tokens_per_sample is None:
        c = render["counts"]
        return {
            "samples": c["samples"],
            "tokens": c["tokens"],
            "tokens_per_sample": c["tokens"] / c["samples"],
            "source": "measured: stages.render.counts (the rendered data)",
        }
    # gen.num_samples, where the recipe sets it, overrides data.num_train.
    samples = recipe.gen.num_samples or recipe.data.num_train
    counted = ""
    if not samples:
        # data.num_train = 0 means every usable train conversation. Counted without the tokenizer, so
        # prompts over max_prompt_tokens are in too: an upper bound, like the length below.
        d = recipe.data
        samples = len(prompts(d.source, "train", d.eval_fraction, d.split_seed))
        counted = "; samples: every train conversation of data.source (data.num_train = 0), an upper bound"
    extra = recipe.gen.self_instruct_samples
    if extra and not recipe.gen.self_instruct:
        samples += extra
        counted += f" + gen.self_instruct_samples ({extra:,})"
    if tokens_per_sample is not None:
        source = "assumed: samples x --tokens-per-sample" + counted
    else:
        # An upper bound: the longest prompt kept plus the longest answer, per turn, capped by the render
        # length (gen stops a conversation's turns before they pass it).
        turns = turns_answered(recipe)
        tokens_per_sample = per_conversation(recipe, recipe.data.max_prompt_tokens + recipe.gen.max_new_tokens)
        per = "data.max_prompt_tokens + gen.max_new_tokens"
        if turns != 1:
            per = f"{turns or 'all'} turns x ({per})"
        source = f"assumed: samples x min(render.max_length, {per}), an upper bound" + counted
    return {
        "samples": samples,
        "tokens": samples * tokens_per_sample,
        "tokens_per_sample": tokens_per_sample,
        "source": source,
    }


# --- the drafter and its training memory ---------------------------------------------------------


def drafter_parameters(cfg, frozen_head: bool = False) -> dict:
    """Trainable and frozen parameters by part, from the drafter itself built on the meta device.

    Frozen: the embedding (the target's, copied), the lm_head too where `frozen_head` (the target's own
    rows, train.lm_head_init = "target-frozen"), and the teacher — the draft vocab's rows of the
    target's lm_head, which the trainer holds beside the drafter to compute the target distribution."""
    import torch

    with torch.device("meta"):
        drafter = cfg.make_drafter()
    if frozen_head:  # a DFlash drafter sharing the target's lm_head has it frozen already
        drafter.lm_head.weight.requires_grad_(False)
    parts: dict[str, dict] = {}
    for name, p in drafter.named_parameters():
        # "fc", "embed_tokens", "lm_head", "layers.0.self_attn", "layers.0.mlp"; every norm in "norms".
        part = "norms" if "norm" in name else ".".join(name.split(".")[: 3 if name.startswith("layers.") else 1])
        kind = "trainable" if p.requires_grad else "frozen"
        parts.setdefault(part, {"trainable": 0, "frozen": 0})[kind] += p.numel()
    parts["teacher_head"] = {"trainable": 0, "frozen": cfg.draft_vocab_size * cfg.hidden_size}
    trainable = sum(v["trainable"] for v in parts.values())
    frozen = sum(v["frozen"] for v in parts.values())
    return {"parts": parts, "trainable": trainable, "frozen": frozen, "total": trainable + frozen}


def _drafter_matmul_params(parts: dict) -> tuple[int, int]:
    """(fc, one drafting step's layer + lm_head) weights a token multiplies through."""
    # a frozen lm_head (train.lm_head_init = "target-frozen") is multiplied through all the same
    step = sum(parts["lm_head"].values()) + sum(v["trainable"] for k, v in parts.items() if k.startswith("layers."))
    return parts["fc"]["trainable"], step


def train_flops_per_token(parts: dict, queries: float) -> int:
    """Forward + backward (6 FLOPs per weight): fc once, the layers and lm_head once per drafter query
    (EAGLE-3: per TTT step; DFlash: per block slot)."""
    fc, step = _drafter_matmul_params(parts)
    return round(6 * (fc + queries * step))


def activation_bytes(cfg, batch_tokens: int, row_tokens: int, queries: float) -> dict:
    """Activations the current trainer keeps for backward over one packed batch (eager attention), for
    `queries` drafter queries per token (contract.Method.queries), each through every drafter layer
    (a DFlash drafter of several layers is billed its logits once per layer: an upper bound).

    Per token and TTT step: the attention input (fp32 and its bf16 copy), q/k/v (bf16, and fp32 after
    rotary), the attention output, the MLP's normed input, gate, up, activation and product (bf16), and
    the logits (bf16, fp32, log-softmax, target x log p); plus, per query, the softmax over the row's
    keys (fp32 and bf16). Per token once: the teacher distribution (fp32) and the aux states (bf16, fp32).
    On top, while one step's attention runs: its raw scores and their masked copy (fp32) — measured by
    bench/plan_memory.py as the gap between the saved tensors and the peak on long rows.
    """
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size  # noqa: E741 - the usual names
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_step = (
        2 * H * (FP32 + BF16)
        + (q + 2 * kv) * BF16
        + (q + kv) * FP32
        + q * BF16
        + H * FP32
        + H * (FP32 + BF16)
        + 4 * I * BF16
        + V * (BF16 + 3 * FP32)
    )
    attention = cfg.num_attention_heads * row_tokens * (FP32 + BF16)
    once = V * FP32 + len(cfg.aux_layer_ids) * cfg.target_hidden_size * (BF16 + FP32)
    transient = cfg.num_attention_heads * row_tokens * 2 * FP32
    passes = queries * getattr(cfg, "num_layers", 1)  # EAGLE-3 has one layer
    return {
        "per_token_per_step": per_step + attention,
        "per_token_once": once,
        "per_token_transient": transient,
        "batch": round(batch_tokens * (passes * (per_step + attention) + once + transient)),
    }


def row_tokens_for(batch_tokens: int, tokens_per_sample: float) -> int:
    """Keys each query's attention scores span: its own document's, on a GPU (FlexAttention skips other
    documents' blocks) and on the CPU (one causal product per document, drafters/common.py DocumentSpans)."""
    return min(batch_tokens, math.ceil(tokens_per_sample))


def fitting_batch_tokens(need, batch_tokens: int, limit: int) -> int:
    """The largest batch, a multiple of BATCH_TOKENS_STEP no larger than `batch_tokens`, whose training
    memory `need(batch)` (bytes per device) fits `limit` (0: none does)."""
    # Memory grows with the batch, so the largest fitting one is found by bisection (a recipe's batch
    # can be millions of tokens).
    lo, hi = 0, batch_tokens // BATCH_TOKENS_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid * BATCH_TOKENS_STEP) <= limit else (lo, mid - 1)
    return lo * BATCH_TOKENS_STEP


def training_memory(
    cfg,
    params: dict,
    train,
    row_tokens: int,
    gpus: int,
    fsdp: bool,
    target_weight_bytes: int = 0,
    target_head_params: int = 0,
) -> dict:
    """Bytes per GPU to train the drafter: weights, grads, AdamW states, activations, and (online
    mode) the resident target. FSDP shards weights, grads and optimizer states over the GPUs."""
    shard = gpus if fsdp else 1
    trainable = params["trainable"]
    frozen = params["frozen"]
    mem = {
        "weights": (trainable + frozen) * FP32 // shard + target_head_params * BF16,
        "grads": trainable * FP32 // shard,
        "optimizer": trainable * FP32 * ADAMW_STATES // shard,
        "activations": activation_bytes(cfg, train.batch_tokens, row_tokens, named(train.method).queries(train))[
            "batch"
        ],
        "target": target_weight_bytes // max(1, gpus),
    }
    mem["total"] = sum(mem.values())
    return mem


# --- time ----------------------------------------------------------------------------------------


def _measured_rate(stages: dict, stage: str, metric: str) -> tuple[float | None, str | None]:
    entry = stages.get(stage) or {}
    rate = (entry.get("metrics") or {}).get(metric)
    if entry.get("state") == "done" and rate:
        env = entry.get("environment") or {}
        where = f"{len(env['gpus'])}x {env['gpus'][0]['name']}" if env.get("gpus") else env.get("cpu", "?")
        return float(rate), f"measured: stages.{stage}.metrics.{metric} ({where})"
    return None, None


def time_table(
    recipe: Recipe,
    spec: TargetSpec,
    tokens: dict,
    parts: dict,
    stages: dict,
    gpus: int,
    calibration: Calibration | None = None,
) -> list[dict]:
    """Seconds per phase: measured throughput where the run has one, else this machine's calibration (a
    CPU with the target's weights at hand), else a reference scaled by FLOPs."""
    if calibration is not None and not gpus and recipe.train.hidden == "disk":
        rows = calibrated_rows(
            recipe, spec, tokens, parts, calibration, _trained_tau(stages), mean_prompt_tokens(recipe, spec.target)
        )
        for r in rows:
            _use_measured(r, stages)
        return rows
    return _reference_rows(recipe, spec, tokens, parts, stages, gpus)


def _use_measured(row: dict, stages: dict) -> None:
    """A phase its stage has run: its work at the stage's measured rate."""
    metric = "autoregressive_tokens_per_s" if row["phase"] == "eval" else "tokens_per_s"
    rate, source = _measured_rate(stages, row["phase"], metric)
    if rate is not None and row["work"]:
        row.update(rate_per_s=round(rate, 2), seconds=round(row["work"] / rate, 1), source=source)


def train_work(recipe: Recipe, tokens: dict) -> int:
    """Tokens the trainer steps over: the samples not held out, every epoch."""
    return round(tokens["tokens"] * (1 - recipe.train.holdout) * recipe.train.epochs)


def _trained_tau(stages: dict) -> float | None:
    """The held-out tau train measured (its chain of train.ttt_steps), where train is done."""
    entry = stages.get("train") or {}
    tau = (entry.get("metrics") or {}).get("best_tau") if entry.get("state") == "done" else None
    return float(tau) if tau else None


def mean_prompt_tokens(recipe: Recipe, target: Target) -> float | None:
    """The mean first-turn prompt of the run's train conversations through the target's chat template
    (the prompts over data.max_prompt_tokens, which gen skips, left out); None for sources of several
    turns. The bound max_prompt_tokens billed ShareGPT's prefills several times over."""
    d = recipe.data
    if turns_answered(recipe) != 1 or recipe.gen.answers == "source":
        return None
    tok = target.tokenizer
    lengths = []
    for conv in prompts(d.source, "train", d.eval_fraction, d.split_seed, limit=d.num_train or None):
        user = next(m for m in conv["messages"] if m["role"] == "user")
        text = tok.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        n = len(tok(text, add_special_tokens=False)["input_ids"])
        if n <= d.max_prompt_tokens:
            lengths.append(n)
    return sum(lengths) / len(lengths) if lengths else None


def calibrated_rows(
    recipe: Recipe,
    spec: TargetSpec,
    tokens: dict,
    parts: dict,
    cal: Calibration,
    tau: float | None = None,
    prompt_tokens: float | None = None,
) -> list[dict]:
    """Each phase's work timed from this machine's calibration (specdraft.calibrate), step by step as the
    stage does it: gen's prefills and batched decode steps, extract's forward, train's top-token pass,
    TTT steps and held-out scoring, eval's three decodes of every prompt."""
    where = f"calibrated: {cal.machine}, {cal.dtype}"
    samples, prompt = tokens["samples"], prompt_tokens or _prompt_tokens(recipe, tokens)
    rows = []
    if recipe.gen.answers == "source":
        rows.append(_row("gen", 0, "answer tokens", 0.0, "gen.answers = source: nothing is generated"))
    else:
        steps = per_conversation(recipe, recipe.gen.max_new_tokens)
        calls = math.ceil(samples / max(1, recipe.gen.batch_size))
        seconds = samples * prompt / cal.forward_tokens_per_s + calls * steps * cal.decode_step_s
        rows.append(
            _row(
                "gen",
                samples * steps,
                "answer tokens (samples x gen.max_new_tokens, an upper bound)",
                seconds,
                f"{where}: {calls} generate calls x {steps} steps x {cal.decode_step_s:.3g} s "
                f"(batch {cal.decode_batch}) + prefills of {prompt:,.0f} tokens at "
                f"{cal.forward_tokens_per_s:,.0f} tok/s",
            )
        )
    rows.append(
        _row(
            "extract",
            tokens["tokens"],
            "tokens",
            tokens["tokens"] / cal.forward_tokens_per_s,
            f"{where}: target forward at {cal.forward_tokens_per_s:,.0f} tok/s",
        )
    )
    rows.append(_train_row(recipe, tokens, cal, where))
    rows.append(_eval_row(recipe, spec, parts, prompt, cal, where, tau))
    return rows


def _row(phase: str, work: int, unit: str, seconds: float, source: str) -> dict:
    rate = round(work / seconds, 2) if seconds else None
    return {
        "phase": phase,
        "work": work,
        "unit": unit,
        "rate_per_s": rate,
        "seconds": round(seconds, 1),
        "source": source,
    }


def _prompt_tokens(recipe: Recipe, tokens: dict) -> int:
    """A prompt's tokens: a sample less its answer, at most data.max_prompt_tokens."""
    answer = recipe.gen.max_new_tokens if recipe.gen.answers != "source" else 0
    return max(1, min(recipe.data.max_prompt_tokens, round(tokens["tokens_per_sample"]) - answer))


def _train_row(recipe: Recipe, tokens: dict, cal: Calibration, where: str) -> dict:
    cfg = recipe.train
    work = train_work(recipe, tokens)
    steps = math.ceil(work / cfg.batch_tokens)
    # Held-out scoring every eval_every steps and at the end: a forward without backward, ~1/3 of a step.
    scored = (steps // cfg.eval_every + 1) * tokens["tokens"] * cfg.holdout
    seconds = (
        tokens["tokens"] / cal.top_tokens_per_s + work / cal.train_tokens_per_s + scored / (3 * cal.train_tokens_per_s)
    )
    return _row(
        "train",
        work,
        "tokens x epochs (held-out samples excluded)",
        seconds,
        f"{where}: top tokens at {cal.top_tokens_per_s:,.0f} tok/s, then TTT steps at "
        f"{cal.train_tokens_per_s:,.0f} tok/s ({cal.train_dtype}) + held-out scoring",
    )


def _eval_row(
    recipe: Recipe, spec: TargetSpec, parts: dict, prompt: int, cal: Calibration, where: str, tau: float | None
) -> dict:
    """Eval decodes every prompt three times: autoregressively, as a chain of K and as a tree. A
    speculative round is one verify forward plus its draft steps and yields tau tokens: train's held-out
    tau once it has one (for the tree too, which accepts at least as much: an upper bound on its time),
    before that 1 (none accepted), an upper bound."""
    cfg = recipe.eval
    fc, step = _drafter_matmul_params(parts)
    draft_step = cal.eval_step_s * step / spec.params["matmul_per_token"]
    chain = cal.verify_step_s[str(cfg.draft_tokens + 1)] + cfg.draft_tokens * draft_step
    tree = cal.verify_step_s[str(cfg.tree_tokens)] + cfg.tree_depth * draft_step
    per_prompt = EVAL_DECODES * prompt / cal.forward_tokens_per_s + cfg.max_new_tokens * (
        cal.eval_step_s + (chain + tree) / (tau or 1.0)
    )
    return _row(
        "eval",
        EVAL_DECODES * cfg.num_prompts * cfg.max_new_tokens,
        "decoded tokens (3 decodes x eval.num_prompts x eval.max_new_tokens)",
        cfg.num_prompts * per_prompt,
        f"{where}: batch-1 step {cal.eval_step_s:.3g} s ({cal.eval_dtype}), chain round {chain:.3g} s, "
        f"tree round {tree:.3g} s, "
        + (f"tau {tau:.3g} (train's held-out)" if tau else "tau 1 assumed (an upper bound)"),
    )


def _reference_rows(recipe: Recipe, spec: TargetSpec, tokens: dict, parts: dict, stages: dict, gpus: int) -> list[dict]:
    """Seconds per phase from a reference machine's throughput scaled by FLOPs (no weights to time)."""
    refs = REFERENCES["gpu" if gpus else "cpu"]
    devices = max(1, gpus)  # data parallel: gen, extract and train split their work over the GPUs
    target_scale = REFERENCE_MATMUL_PARAMS / spec.params["matmul_per_token"]
    rows = []

    def row(phase, work, unit, metric_stage, metric, scale, scale_note, devices=devices):
        rate, source = _measured_rate(stages, metric_stage, metric)
        if rate is None:
            ref = refs[phase]
            rate = ref[0] * scale * devices
            source = f"default: {ref[0]:,g} tok/s for {REFERENCE_MODEL} ({ref[1]}) x {scale:.3g} ({scale_note})" + (
                f" x {devices} GPUs (linear scaling assumed)" if devices > 1 else ""
            )
        rows.append(
            {
                "phase": phase,
                "work": work,
                "unit": unit,
                "rate_per_s": round(rate, 2),
                "seconds": round(work / rate, 1),
                "source": source,
            }
        )

    if recipe.gen.answers == "source":
        rows.append(
            _row(
                "gen",
                0,
                "answer tokens",
                0.0,
                "gen.answers = source: the source's own answers are copied, nothing is generated",
            )
        )
    else:
        answer_tokens = tokens["samples"] * per_conversation(recipe, recipe.gen.max_new_tokens)
        what = (
            "gen.max_new_tokens"
            if turns_answered(recipe) == 1
            else "the answers of gen.max_turns turns, within render.max_length"
        )
        row(
            "gen",
            answer_tokens,
            f"answer tokens (samples x {what}, an upper bound)",
            "gen",
            "tokens_per_s",
            target_scale,
            "forward FLOPs ratio",
        )
    online = recipe.train.hidden == "online"
    served = recipe.train.hidden == "served"
    if online or served:
        rows.append(
            _row(
                "extract",
                0,
                "tokens",
                0.0,
                f"train.hidden = {recipe.train.hidden}: the target "
                + ("runs inside train instead" if online else "is served to train instead"),
            )
        )
    else:
        row("extract", tokens["tokens"], "tokens", "extract", "tokens_per_s", target_scale, "forward FLOPs ratio")
    ref_train = refs["train"]
    # The drafter the reference rates were measured with: the default method's, on SmolLM2.
    ref_parts = drafter_parameters(named(DEFAULT).config_class(**REFERENCE_DRAFTER, draft_vocab_size=ref_train[2]))
    ref_parts = ref_parts["parts"]
    train_scale = train_flops_per_token(ref_parts, ref_train[3]) / train_flops_per_token(
        parts, named(recipe.train.method).queries(recipe.train)
    )
    row(
        "train",
        train_work(recipe, tokens),
        "tokens x epochs (held-out samples excluded)",
        "train",
        "tokens_per_s",
        train_scale,
        "drafter training FLOPs ratio",
    )
    if online and rows[-1]["source"].startswith("default"):  # a measured online rate includes the target
        extract_rate = refs["extract"][0] * target_scale * devices
        rows[-1]["seconds"] = round(rows[-1]["seconds"] + tokens["tokens"] * recipe.train.epochs / extract_rate, 1)
        rows[-1]["source"] += (
            f"; + the target's forward every epoch at {extract_rate:,.0f} tok/s (online hidden states)"
        )
    if served:
        rows[-1]["passes"] = served_passes(recipe, tokens, spec.hidden_size, len(spec.target.aux_layer_ids) + 1)
        _add_serving(
            rows[-1],
            recipe,
            tokens,
            stages,
            refs["extract"][0] * target_scale * devices,
            gpus,
            len(spec.target.aux_layer_ids) + 1,
            spec.hidden_size,
        )
    # Eval decodes each prompt three times (plainly, as a chain, as a tree), one prompt at a time on one
    # device: no data-parallel speedup; speculative decodes taken at about the plain rate.
    row(
        "eval",
        EVAL_DECODES * recipe.eval.num_prompts * recipe.eval.max_new_tokens,
        "decoded tokens (3 decodes x eval.num_prompts x eval.max_new_tokens)",
        "eval",
        "autoregressive_tokens_per_s",
        target_scale,
        "forward FLOPs ratio",
        devices=1,
    )
    return rows


def served_passes(recipe: Recipe, tokens: dict, spec_hidden: int, n_states: int) -> float:
    """Passes of the states server over the training tokens: one per epoch, less what the memory cache
    keeps from the first (the share of the training samples' states that fit served_cache_bytes)."""
    cfg = recipe.train
    if cfg.served_cache != "memory" or cfg.epochs <= 1:
        return float(cfg.epochs)
    train_tokens = tokens["tokens"] * (1 - cfg.holdout)
    held = memory_bytes(round(tokens["tokens"] * cfg.holdout), n_states, spec_hidden)
    left = cfg.served_cache_bytes - (held if held <= cfg.served_cache_bytes else 0)  # held-out kept first
    kept = min(1.0, left / max(1, memory_bytes(round(train_tokens), n_states, spec_hidden)))
    return 1 + (cfg.epochs - 1) * (1 - kept)


def heldout_scorings(recipe: Recipe, tokens: dict) -> int:
    """How often the trainer scores the held-out samples: every train.eval_every steps and at the end, the
    steps taken as full rows of train.batch_tokens (an upper bound on the rows packing makes)."""
    cfg = recipe.train
    if cfg.holdout <= 0:
        return 0
    steps = math.ceil(tokens["tokens"] * (1 - cfg.holdout) / (cfg.batch_tokens * cfg.micro_batches)) * cfg.epochs
    return steps // max(1, cfg.eval_every) + 1


def _serving_rate(stages: dict, reference_rate: float) -> tuple[float, str]:
    """The states server's tokens/s: a finished served train's, else extract's, else the reference."""
    train = stages.get("train") or {}
    served_rate = (train.get("metrics") or {}).get("served", {}).get("tokens_per_s")
    if served_rate and train.get("state") == "done":
        return float(served_rate), "measured: stages.train.metrics.served.tokens_per_s"
    rate, source = _measured_rate(stages, "extract", "tokens_per_s")
    if rate:
        return rate, source
    return reference_rate, f"default: extract's reference rate {reference_rate:,.0f} tok/s"


def _add_serving(
    row: dict,
    recipe: Recipe,
    tokens: dict,
    stages: dict,
    reference_rate: float,
    gpus: int,
    n_states: int,
    hidden_size: int,
) -> None:
    """The train row of a served run: the steps, and the states server computing every pass's states at
    its measured rate (the last served train's, else extract's, else the reference). On GPUs the server
    runs beside the trainer (the longer of the two, the trainer waiting the difference); on a CPU they
    share the cores (the sum)."""
    passes = row.pop("passes")
    evals = heldout_scorings(recipe, tokens)
    # The held-out samples are asked for again at every scoring (they are never in the training order),
    # unless the memory cache holds them (it keeps them first).
    held_bytes = memory_bytes(round(tokens["tokens"] * recipe.train.holdout), n_states, hidden_size)
    if recipe.train.served_cache == "memory" and recipe.train.served_cache_bytes >= held_bytes:
        evals = min(evals, 1)
    work = round(tokens["tokens"] * ((1 - recipe.train.holdout) * passes + recipe.train.holdout * evals))
    rate, source = _serving_rate(stages, reference_rate)
    serve_s = work / rate
    train_s = row["seconds"]
    seconds = max(train_s, serve_s) if gpus else train_s + serve_s
    wait = max(0.0, serve_s - train_s) / seconds if gpus and seconds else None
    row["seconds"] = round(seconds, 1)
    row["serving"] = {
        "passes": round(passes, 3),
        "tokens": work,
        "rate_per_s": round(rate, 1),
        "seconds": round(serve_s, 1),
        "wait_share": round(wait, 3) if wait is not None else None,
    }
    row["source"] += (
        f"; + the states server: {work:,} tokens ({passes:.2f} passes, and the held-out samples "
        f"at each of {evals} scorings) at {rate:,.0f} tok/s [{source}], "
        + (
            "beside the trainer (the longer of the two"
            + (f"; the trainer waits {wait:.0%} of it)" if wait else "; the trainer does not wait)")
            if gpus
            else "on the same cores (added)"
        )
    )


# --- the whole plan ------------------------------------------------------------------------------


def machine(run_path: Path | None, gpus: int | None, gpu_memory_gib: float | None) -> dict:
    env = environment.describe(run_path or Path.cwd())
    detected = env["gpus"]
    n = len(detected) if gpus is None else gpus
    memory = gpu_memory_gib * GiB if gpu_memory_gib is not None else detected[0]["memory_bytes"] if detected else None
    return {
        "hardware": environment.hardware_line(),
        "gpus": n,
        "gpu_memory_bytes": int(memory) if memory else None,
        "gpus_source": "detected" if gpus is None else "--gpus",
        "ram_bytes": env["ram_bytes"],
        "disk_free_bytes": env["disk_free_bytes"],
        "disk_path": str(run_path or Path.cwd()),
    }


@dataclass(frozen=True)
class MemoryModel:
    """What the training-memory bill is computed from: the target, the drafter's config and parameters,
    the expected tokens, the machine; `memory(fsdp, batch_tokens)` bills one device's training memory."""

    spec: TargetSpec
    recipe: Recipe
    tokens: dict
    dcfg: object  # the method's drafter config
    params: dict
    mach: dict
    sharded: bool  # billed sharded: the recipe shards (FSDP) over several GPUs

    def memory(self, fsdp: bool, batch_tokens: int | None = None) -> dict:
        train = self.recipe.train
        batch_tokens = train.batch_tokens if batch_tokens is None else batch_tokens
        return training_memory(
            self.dcfg,
            self.params,
            replace(train, batch_tokens=batch_tokens),
            row_tokens_for(batch_tokens, self.tokens["tokens_per_sample"]),
            max(1, self.mach["gpus"]),
            fsdp,
            self.spec.weight_bytes() if train.hidden == "online" else 0,
            self.spec.params["head"],
        )

    def fit_batch_tokens(self, limit: int) -> int:
        """The largest batch whose bill (the resident target of online hidden states included) fits `limit`."""
        return fitting_batch_tokens(
            lambda bt: self.memory(self.sharded, bt)["total"], self.recipe.train.batch_tokens, limit
        )


def memory_model(
    recipe: Recipe,
    folder: RunFolder | None = None,
    *,
    target: str | None = None,
    tokens_per_sample: int | None = None,
    gpus: int | None = None,
    gpu_memory_gib: float | None = None,
) -> MemoryModel:
    """The target as every stage reads it (its aux layers: the recipe's, sorted, or its family's default,
    checked against its depth), the recipe's ranges it and the method set refused as the stages would,
    and the drafter and machine the memory is billed for."""
    spec = read_target(target or recipe.target.model, recipe.target.aux_layer_ids)
    spec.target.check_fits(recipe)
    method = named(recipe.train.method)
    method.check(recipe)
    method.check_target(recipe, spec.target.vocab_size, spec.target.name)
    dcfg = method.plan_config(spec.target, recipe.train)
    mach = machine(folder.path if folder is not None else None, gpus, gpu_memory_gib)
    return MemoryModel(
        spec,
        recipe,
        expected_tokens(recipe, folder, tokens_per_sample),
        dcfg,
        drafter_parameters(dcfg, frozen_head=recipe.train.lm_head_init == "target-frozen"),
        mach,
        sharded=recipe.train.parallel == "fsdp" and mach["gpus"] > 1,
    )


@dataclass(frozen=True)
class TrainMemory:
    """The trainer's one question to the bill: does training fit the device's memory? `need_bytes` per
    device at the recipe's batch against `usable_bytes` (the memory less the headroom; None: GPUs of
    unknown memory); `fixes` what plan recommends to fit (FSDP, a smaller --batch-tokens)."""

    need_bytes: int
    usable_bytes: int | None
    text: str
    fixes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return self.usable_bytes is None or self.need_bytes <= self.usable_bytes

    @property
    def beyond_device(self) -> bool:
        """Over the device's whole memory, not only the headroom the estimate keeps."""
        return not self.fits and self.need_bytes > self.usable_bytes / MEMORY_HEADROOM


def train_memory(recipe: Recipe, folder: RunFolder | None = None, **where) -> TrainMemory:
    """plan's training-memory check of `recipe` on this machine (or `where`: memory_model's target,
    tokens_per_sample, gpus, gpu_memory_gib), without the rest of the plan."""
    check, fixes = _check_memory(memory_model(recipe, folder, **where))
    return TrainMemory(check["need_bytes"], check["usable_bytes"], check["text"], tuple(r["do"] for r in fixes))


def make_plan(
    recipe: Recipe,
    folder: RunFolder | None = None,
    *,
    target: str | None = None,
    tokens_per_sample: int | None = None,
    gpus: int | None = None,
    gpu_memory_gib: float | None = None,
    calibration: str = "off",
) -> dict:
    """The bill. `calibration`: "measure" times the work on this CPU where the target's weights are here
    (cached), "cached" uses a calibration already cached, "off" bills by FLOPs alone."""
    model = memory_model(
        recipe, folder, target=target, tokens_per_sample=tokens_per_sample, gpus=gpus, gpu_memory_gib=gpu_memory_gib
    )
    spec, tokens, dcfg, params, mach = model.spec, model.tokens, model.dcfg, model.params, model.mach
    aux = spec.target.aux_layer_ids
    store_dtype = recipe.extract.store_dtype  # bf16, or fp8 with a per-row scale
    n_states = len(aux) + 1
    # extract's own bytes: the states, and (on disk) each token's id and loss mask
    per_token = bytes_per_token(n_states, spec.hidden_size, store_dtype)
    hidden_bytes = tokens["tokens"] * disk_bytes_per_token(n_states, spec.hidden_size, store_dtype)
    n_gpus = mach["gpus"]
    row_tokens = row_tokens_for(recipe.train.batch_tokens, tokens["tokens_per_sample"])
    online = recipe.train.hidden == "online"
    # A recipe that shards over several GPUs is billed sharded; one that does not is told what sharding saves.
    mem = model.memory(fsdp=model.sharded)
    stages = folder.manifest().get("stages", {}) if folder is not None else {}
    cal = machine_calibration(recipe, spec.target, folder, calibration) if not n_gpus else None
    times = time_table(recipe, spec, tokens, params["parts"], stages, n_gpus, cal)
    plan = {
        "recipe": recipe.name,
        "computed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": spec.describe(),
        "aux_layer_ids": aux,
        "aux_layer_ids_source": "recipe target.aux_layer_ids"
        if recipe.target.aux_layer_ids
        else "default (2, L//2, L-3)",
        "hidden": {
            "mode": recipe.train.hidden,
            "store_dtype": store_dtype,
            "states_per_token": n_states,
            "bytes_per_token": per_token,
            "record_bytes_per_token": TOKEN_BYTES,
            "disk_bytes": (
                0 if online else recipe.train.served_scratch_bytes if recipe.train.hidden == "served" else hidden_bytes
            ),
            "disk_bytes_if_disk": hidden_bytes,
            # Shards already extracted take no more free disk than they have.
            "on_disk_bytes": (size_of(folder.hidden) or 0) if folder is not None else 0,
        },
        "tokens": tokens,
        "drafter": {"method": recipe.train.method, "config": dcfg.to_dict(), **params},
        "train_memory": {
            "per_gpu": mem,
            "row_tokens": row_tokens,
            "activation": activation_bytes(
                dcfg, recipe.train.batch_tokens, row_tokens, named(recipe.train.method).queries(recipe.train)
            ),
            "device": "gpu" if n_gpus else "cpu",
            "fsdp": model.sharded,
        },
        "time": times,
        "total_seconds": round(sum(r["seconds"] for r in times), 1),
        "machine": mach,
        "calibration": cal.to_dict() if cal is not None else None,
    }
    if recipe.train.hidden == "served":
        plan["served"] = served_bill(recipe, spec, tokens, mach, model.fit_batch_tokens, mem["total"])
    checks, recs = _check_disk(plan, recipe, spec, tokens)
    memory_check, fixes = _check_memory(model)
    plan["checks"], plan["recommendations"] = [*checks, memory_check], recs + fixes
    return plan


def _check_disk(plan: dict, recipe: Recipe, spec: TargetSpec, tokens: dict) -> tuple[list, list]:
    mach = plan["machine"]
    checks, recs = [], []
    free = mach["disk_free_bytes"]
    need = max(0, plan["hidden"]["disk_bytes"] - plan["hidden"]["on_disk_bytes"])
    usable = int(free * DISK_HEADROOM)
    checks.append(
        {
            "check": "disk",
            "ok": need <= usable,
            "need_bytes": need,
            "usable_bytes": usable,
            "text": f"hidden states still to write {human_bytes(need)} vs {human_bytes(usable)} usable of "
            f"{human_bytes(free)} free on {mach['disk_path']} ({DISK_HEADROOM:.0%})",
        }
    )
    if need > usable:
        recs.append(
            {
                "do": "--set train.hidden=served",
                "why": f"writes no hidden/: a vLLM server computes the states as the trainer needs them, "
                f"through a scratch folder of train.served_scratch_bytes "
                f"({human_bytes(recipe.train.served_scratch_bytes)}); it recomputes them every epoch "
                f"({recipe.train.epochs} epochs) unless train.served_cache keeps them",
            }
        )
        recs.append(
            {
                "do": "--set train.hidden=online",
                "why": f"writes nothing: saves {human_bytes(need)}; the target ({human_bytes(spec.weight_bytes())} "
                f"of weights) runs beside the trainer and repeats its forward every epoch "
                f"({recipe.train.epochs} epochs)",
            }
        )
        if recipe.extract.store_dtype != "fp8_e4m3":
            fp8 = tokens["tokens"] * disk_bytes_per_token(
                plan["hidden"]["states_per_token"], spec.hidden_size, "fp8_e4m3"
            )
            recs.append(
                {
                    "do": "--set extract.store_dtype=fp8_e4m3",
                    "why": f"{human_bytes(fp8)} instead of {human_bytes(need)} "
                    f"({'fits' if fp8 <= usable else 'still does not fit'}); its effect on tau is "
                    f"measured by bench/fp8_tau.py, not assumed",
                }
            )
        per_token = plan["hidden"]["bytes_per_token"] + plan["hidden"]["record_bytes_per_token"]
        fitting = int(usable // (tokens["tokens_per_sample"] * per_token))
        recs.append(
            {
                "do": f"--num-train {fitting}",
                "why": f"{fitting:,} samples of ~{tokens['tokens_per_sample']:,.0f} tokens fit "
                f"{human_bytes(usable)} (of {tokens['samples']:,} planned)",
            }
        )
    return checks, recs


def _check_memory(model: MemoryModel) -> tuple[dict, list]:
    """The training-memory check and what fits where it fails (FSDP, a smaller batch)."""
    mach, recs = model.mach, []
    n_gpus = mach["gpus"]
    mem = model.memory(model.sharded)
    if n_gpus and mach["gpu_memory_bytes"] is None:
        # --gpus on a machine without (that many) GPUs: nothing to read their memory from.
        return {
            "check": "train memory",
            "ok": None,
            "need_bytes": mem["total"],
            "usable_bytes": None,
            "text": f"training {human_bytes(mem['total'])} per device over {n_gpus} GPU(s) of unknown memory "
            f"(none detected here): give --gpu-memory-gib (141 for an H200) to check it",
        }, recs
    if n_gpus:
        limit = int(mach["gpu_memory_bytes"] * MEMORY_HEADROOM)
        where = f"{n_gpus} GPU(s) of {human_bytes(mach['gpu_memory_bytes'])}"
    else:
        limit = int((mach["ram_bytes"] or 0) * MEMORY_HEADROOM)
        where = f"CPU RAM {human_bytes(mach['ram_bytes'] or 0)}"
    check = {
        "check": "train memory",
        "ok": mem["total"] <= limit,
        "need_bytes": mem["total"],
        "usable_bytes": limit,
        "text": f"training {human_bytes(mem['total'])} per device vs {human_bytes(limit)} usable ({where})",
    }
    if mem["total"] > limit and n_gpus > 1 and not model.sharded:
        sharded = model.memory(fsdp=True)
        recs.append(
            {
                "do": f"FSDP over {n_gpus} GPUs (torchrun)",
                "why": f"weights, grads and AdamW states sharded: {human_bytes(sharded['total'])} per GPU "
                f"({'fits' if sharded['total'] <= limit else 'still over'} {human_bytes(limit)})",
                "per_gpu_bytes": sharded["total"],
            }
        )
    if mem["total"] > limit:
        fit = model.fit_batch_tokens(limit)
        if fit:
            recs.append(
                {
                    "do": f"--batch-tokens {fit}",
                    "why": f"the largest batch whose training memory fits {human_bytes(limit)}",
                }
            )
    return check, recs


def _tensor_parallel(vllm_args: list[str], gpus: int) -> int:
    """The states server's tensor parallelism: extract.vllm_args' --tensor-parallel-size (-tp), else 1."""
    for i, arg in enumerate(vllm_args):
        if arg in ("--tensor-parallel-size", "-tp") and i + 1 < len(vllm_args):
            return int(vllm_args[i + 1])
        if arg.startswith("--tensor-parallel-size="):
            return int(arg.split("=", 1)[1])
    return 1


def served_bill(recipe: Recipe, spec: TargetSpec, tokens: dict, mach: dict, fit_batch_tokens, train_bytes: int) -> dict:
    """What train.hidden = "served" costs besides time: the scratch disk, the trainer's host memory for
    the states it holds, and where the states server and the trainer fit on the GPUs."""
    cfg = recipe.train
    n_states = len(spec.target.aux_layer_ids) + 1
    longest = min(recipe.render.max_length, max(1, round(tokens["tokens_per_sample"])))
    file_bytes = state_file_bytes(
        longest, n_states, spec.hidden_size, recipe.extract.dtype if recipe.extract.dtype != "auto" else "bfloat16"
    )
    ahead = max(1, cfg.served_ahead) * max(1, len(cfg.served_endpoints))
    out = {
        "scratch_cap_bytes": cfg.served_scratch_bytes,
        "sample_file_bytes": file_bytes,
        "scratch_ok": file_bytes <= cfg.served_scratch_bytes,
        "in_flight_at_cap": min(ahead, cfg.served_scratch_bytes // max(1, file_bytes)),
        "cache": cfg.served_cache,
        "cache_bytes": cfg.served_cache_bytes if cfg.served_cache == "memory" else 0,
        "host_memory_bytes": ahead * memory_bytes(longest, n_states, spec.hidden_size)
        + (cfg.served_cache_bytes if cfg.served_cache == "memory" else 0),
        "passes": round(served_passes(recipe, tokens, spec.hidden_size, n_states), 3),
        "endpoints": cfg.served_endpoints or ["started by train on loopback"],
    }
    gpus, gpu_bytes = mach["gpus"], mach["gpu_memory_bytes"]
    if gpus and gpu_bytes:
        out["topology"] = _topology(
            recipe,
            spec,
            gpus,
            gpu_bytes,
            ahead * longest * n_states * spec.hidden_size * 2,
            fit_batch_tokens,
            train_bytes,
        )
    return out


def _topology(
    recipe: Recipe,
    spec: TargetSpec,
    gpus: int,
    gpu_bytes: int,
    state_cache_bytes: int,
    fit_batch_tokens,
    train_bytes: int,
) -> dict:
    """Where the states server (tensor parallel over `tp` GPUs, the target's weights split over them, plus
    the hidden-state cache of the requests in flight) and the trainer go on `gpus` GPUs: beside each other
    on the same GPUs, or the trainer on GPUs of its own; which fits, and by how much."""
    tp = _tensor_parallel(recipe.extract.vllm_args, gpus)
    usable = int(gpu_bytes * MEMORY_HEADROOM)
    server = spec.weight_bytes() // tp + state_cache_bytes // tp
    left = usable - server
    beside_fits = left >= train_bytes
    topo = {
        "tensor_parallel": tp,
        "server_per_gpu_bytes": server,
        "left_per_gpu_bytes": left,
        "trainer_per_gpu_bytes": train_bytes,
        "beside_fits": beside_fits,
        "beside_batch_tokens": fit_batch_tokens(left) if left > 0 else 0,
        "own_gpus": gpus - tp,
        "own_fits": gpus > tp and usable >= train_bytes,
    }
    what = (
        f"vLLM holds the target with TP = {tp}: {human_bytes(server)} per GPU (weights "
        f"{human_bytes(spec.weight_bytes() // tp)} + the in-flight states' cache), {human_bytes(left)} left of "
        f"{human_bytes(usable)} usable"
    )
    if beside_fits:
        verdict = (
            f"the trainer fits beside it on the same GPUs ({human_bytes(train_bytes)} per GPU, "
            f"{human_bytes(left - train_bytes)} to spare): start vLLM with --gpu-memory-utilization "
            f"{math.floor(100 * (usable - train_bytes) / gpu_bytes) / 100:.2f} (in extract.vllm_args), "
            f"the rest of each GPU left to the trainer"
        )
    elif topo["beside_batch_tokens"]:
        verdict = (
            f"the trainer needs {human_bytes(train_bytes)} per GPU at train.batch_tokens = "
            f"{recipe.train.batch_tokens:,}: {human_bytes(train_bytes - left)} over; beside vLLM it fits at "
            f"--batch-tokens {topo['beside_batch_tokens']:,}"
        )
    else:
        verdict = f"the trainer does not fit beside it ({human_bytes(train_bytes)} per GPU needed)"
    if topo["own_gpus"] > 0:
        own = (
            f"on its own {topo['own_gpus']} GPU(s) it "
            + ("fits" if topo["own_fits"] else "does not fit")
            + " (FSDP then spans those GPUs only)"
        )
    else:
        own = f"no GPU is left for a trainer of its own: TP = {tp} takes all {gpus} " + (
            f"(TP = {tp // 2} would need {human_bytes(spec.weight_bytes() // (tp // 2))} of weights per GPU: "
            + ("fits" if spec.weight_bytes() // (tp // 2) <= usable else "does not fit")
            + ")"
            if tp > 1
            else ""
        )
    topo["text"] = f"{what}; {verdict}; {own}"
    return topo


def machine_calibration(recipe: Recipe, target: Target, folder: RunFolder | None, how: str) -> Calibration | None:
    """This CPU's calibration for the recipe (see make_plan's `calibration`), None where there is none."""
    if how == "off" or not has_weights(target):
        return None
    cache = folder.calibration if folder is not None else default_cache()
    return calibrate(recipe, target, cache) if how == "measure" else cached(recipe, target, cache)


def record(folder: RunFolder, plan: dict) -> None:
    """Keep the plan in the run's manifest: STATUS.md reads the target and the time left from it. Each
    phase's last estimate made before its stage ran is kept in `planned` (later plans replace a finished
    stage's estimate by what it measured): STATUS.md sets it against the seconds measured."""
    m = folder.manifest()
    m["plan"] = plan
    planned = m.setdefault("planned", {})
    for r in plan["time"]:
        if not r["source"].startswith("measured"):
            planned[r["phase"]] = {"seconds": r["seconds"], "source": r["source"], "computed": plan["computed"]}
    folder.save_manifest(m)


# --- text ----------------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def human_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:,.1f} h"
    if s >= 60:
        return f"{s / 60:,.1f} min"
    return f"{s:,.0f} s"


# --- sizing a run to a time budget ---------------------------------------------------------------


@dataclass(frozen=True)
class Shrinkable:
    """A recipe field that costs time, and the least it may be shrunk to."""

    field: str  # section.name
    floor: int


# What the demo may shrink, all by one factor, each no lower than its floor. Training data and answer
# length shrink least far: the recipe's 448 answers of 128 tokens gave tau 1.45, and nothing
# below half of that has been measured, so half is the floor; eval keeps 16 prompts for a tau worth
# reading. Epochs and the drafter's shape stay: fewer steps on less data would learn less.
DEMO_SHRINK = (
    Shrinkable("data.num_train", 224),
    Shrinkable("gen.max_new_tokens", 96),
    Shrinkable("eval.num_prompts", 16),
)


def plan_seconds(recipe: Recipe, spec: TargetSpec, cal: Calibration, prompt_tokens: float | None = None) -> float:
    """The calibrated seconds of gen, extract, train and eval for a recipe not yet run."""
    parts = drafter_parameters(
        named(recipe.train.method).plan_config(spec.target, recipe.train),
        frozen_head=recipe.train.lm_head_init == "target-frozen",
    )["parts"]
    rows = calibrated_rows(recipe, spec, expected_tokens(recipe, None, None), parts, cal, prompt_tokens=prompt_tokens)
    return sum(r["seconds"] for r in rows)


def _scaled(recipe: Recipe, scale: float, fields=DEMO_SHRINK) -> Recipe:
    from copy import deepcopy

    out = deepcopy(recipe)
    for f in fields:
        section, name = f.field.split(".")
        value = getattr(getattr(recipe, section), name)
        setattr(getattr(out, section), name, max(min(f.floor, value), round(value * scale)))
    return out


def size_to_budget(
    recipe: Recipe, spec: TargetSpec, cal: Calibration, budget_s: float, fields=DEMO_SHRINK
) -> tuple[Recipe, dict]:
    """The recipe with `fields` shrunk by the largest common factor whose calibrated plan fits `budget_s`
    (each field no lower than its floor), and what was chosen and why."""
    prompt = mean_prompt_tokens(recipe, spec.target)

    def seconds(r: Recipe) -> float:
        return plan_seconds(r, spec, cal, prompt)

    full = seconds(recipe)
    choice = {
        "budget_seconds": round(budget_s),
        "planned_seconds": round(full),
        "machine": cal.machine,
        "dtype": cal.dtype,
        "scale": 1.0,
        "changed": {},
    }
    if full <= budget_s:
        return recipe, choice
    lo, hi = 0.0, 1.0  # bisection on the factor: the plan's seconds grow with every field
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if seconds(_scaled(recipe, mid, fields)) <= budget_s else (lo, mid)
    sized = _scaled(recipe, lo, fields)
    for f in fields:
        section, name = f.field.split(".")
        before, after = getattr(getattr(recipe, section), name), getattr(getattr(sized, section), name)
        if before != after:
            choice["changed"][f.field] = [before, after]
    choice.update(scale=round(lo, 3), sized_seconds=round(seconds(sized)))
    choice["fits"] = choice["sized_seconds"] <= budget_s
    return sized, choice
