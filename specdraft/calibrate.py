"""calibrate: a few timed steps of each stage's real work on this machine, for plan's CPU time table.

A FLOP count scaled from another machine's throughput missed the demo's stages by 0.4x to 3.4x on a
2-core AVX2 CPU: the ratio of compute to memory traffic, the dtype the CPU really multiplies
in, and the fixed costs per call differ from machine to machine. So plan times the work itself, with
the real target at the stages' dtype and the recipe's shapes, for a few seconds:

- forward: the target over a batch of tokens with its hidden states (extract; prefills)
- batched decode: greedy `generate` steps at gen.batch_size (gen)
- batch-1 decode and batch-1 forwards over the verify widths (eval: chain and tree)
- drafter training steps of the recipe's TTT shape, backward and optimizer included (train)
- the target's full-vocab top token of stored states (train's pass before its first step)

Results are cached (a run's folder, else the user cache) under a key of the machine, the target, the
dtypes and the recipe fields they depend on: status and plan rerun after every stage and redo nothing.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specdraft import environment
from specdraft.config import Recipe
from specdraft.files import FileError, read_json
from specdraft.targets import Target, cache_dir, resolve_dtype

# Shapes of the timed work: large enough that per-call overheads are amortised as in the stages, small
# enough that the whole calibration takes seconds on a 2-core CPU.
FORWARD_TOKENS = 512
FORWARD_ROW = 256
PROMPT_TOKENS = 64
DECODE_STEPS = 4
TRAIN_TOKENS = 256
TRAIN_STEPS = 1
TOP_TOKENS = 512
# Repeats of each timing; the median is kept (a shared machine's other jobs make single timings noisy).
REPEATS = 2


@dataclass
class Calibration:
    """Seconds and rates measured on this machine (CPU), each for the work the name says."""

    machine: str
    target: str
    dtype: str  # gen and extract's
    eval_dtype: str
    train_dtype: str
    forward_tokens_per_s: float  # target forward with hidden states, rows of FORWARD_ROW tokens
    decode_step_s: float  # one greedy step of gen.batch_size rows
    decode_batch: int
    eval_step_s: float  # one greedy step at batch 1 (eval's autoregressive decode)
    verify_step_s: dict  # batch-1 forward over n new tokens (str(n) -> s): chain K+1, tree tree_tokens
    train_tokens_per_s: float  # drafter TTT steps: forward, backward, optimizer
    top_tokens_per_s: float  # full-vocab argmax of stored last states
    seconds: float  # what calibrating took

    def to_dict(self) -> dict:
        return asdict(self)


def has_weights(target: Target) -> bool:
    """Whether the target's weights are here to time (a config alone is billed by FLOPs instead)."""
    return any(target.path.glob("*.safetensors"))


def key(recipe: Recipe, target: Target) -> str:
    """What a calibration depends on: the machine, the target, the dtypes and the recipe's shapes."""
    fields = {
        "machine": environment.hardware_line(),
        "target": target.fingerprint(),
        "dtypes": _dtypes(recipe),
        "gen_batch": recipe.gen.batch_size,
        "train": [
            recipe.train.draft_vocab_size,
            recipe.train.ttt_steps,
            recipe.train.optimizer,
            recipe.train.loss,
            recipe.train.gradient_checkpointing,
            target.aux_layer_ids,
        ],
        "eval": [recipe.eval.draft_tokens, recipe.eval.tree_tokens],
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _dtypes(recipe: Recipe) -> dict:
    return {
        "extract": resolve_dtype(recipe.extract.dtype, "cpu"),
        "eval": recipe.eval.dtype,
        "train": resolve_dtype(recipe.train.autocast_dtype, "cpu"),
    }


def default_cache() -> Path:
    """Where a calibration made without a run folder (plan of a recipe) is kept."""
    return cache_dir() / "calibration.json"


def calibrate(recipe: Recipe, target: Target, cache: Path) -> Calibration:
    """The cached calibration for this machine, target and recipe, measured when there is none."""
    found = cached(recipe, target, cache)
    if found is not None:
        return found
    result = measure(recipe, target)
    entries = _entries(cache)
    entries[key(recipe, target)] = result.to_dict()
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + ".tmp")
    tmp.write_text(json.dumps(entries, indent=2) + "\n")
    tmp.replace(cache)
    return result


def cached(recipe: Recipe, target: Target, cache: Path) -> Calibration | None:
    """The cached calibration, None where this machine, target and recipe have none yet."""
    found = _entries(cache).get(key(recipe, target))
    if not found:
        return None
    try:
        return Calibration(**found)
    except TypeError:  # a stale entry of another specdraft's fields
        raise FileError(f"{cache}: its entry for this machine and recipe is not a calibration; {CACHE_FIX}") from None


# The calibration cache is only ever a cache: a damaged one is removed and measured again.
CACHE_FIX = "remove it (plan measures this machine again)"


def _entries(cache: Path) -> dict:
    """The cached calibrations {key: fields}, none when there is no cache yet."""
    if not cache.exists():
        return {}
    entries = read_json(cache, fix=CACHE_FIX)
    if not all(isinstance(v, dict) for v in entries.values()):
        raise FileError(f"{cache}: not a calibration cache (its entries are not objects); {CACHE_FIX}")
    return entries


def measure(recipe: Recipe, target: Target) -> Calibration:
    import torch

    t0 = time.time()
    dtypes = _dtypes(recipe)
    print(f"calibrate: timing {target.path.name} ({dtypes['extract']}) on {environment.hardware_line()}", flush=True)
    model = target.load_model(dtypes["extract"], "cpu")
    vocab = target.vocab_size  # a wrapper's config (Kimi-K2.5's) has none of its own
    forward = _forward_rate(model, vocab, torch)
    decode = _decode_step(model, recipe.gen.batch_size, vocab, torch)
    if dtypes["eval"] != dtypes["extract"]:
        model = target.load_model(dtypes["eval"], "cpu")
    eval_step = _decode_step(model, 1, vocab, torch)
    widths = sorted({recipe.eval.draft_tokens + 1, recipe.eval.tree_tokens})
    verify = {str(n): _verify_step(model, n, eval_step, vocab, torch) for n in widths}
    del model
    head = target.head_weight()
    return Calibration(
        machine=environment.hardware_line(),
        target=str(target.path),
        dtype=dtypes["extract"],
        eval_dtype=dtypes["eval"],
        train_dtype=dtypes["train"],
        forward_tokens_per_s=round(forward, 2),
        decode_step_s=_sig(decode),
        decode_batch=recipe.gen.batch_size,
        eval_step_s=_sig(eval_step),
        verify_step_s={n: _sig(s) for n, s in verify.items()},
        train_tokens_per_s=round(_train_rate(recipe, target, head, dtypes["train"], torch), 2),
        top_tokens_per_s=round(_top_rate(head, target.hidden_size, torch), 2),
        seconds=round(time.time() - t0, 1),
    )


def _sig(x: float) -> float:
    """x to 4 significant digits (rounding to decimals would make a fast step 0)."""
    return float(f"{x:.4g}")


def _median_seconds(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _ids(rows: int, length: int, vocab: int, torch):
    return torch.randint(100, min(vocab, 30000), (rows, length))


def _forward_rate(model, vocab: int, torch) -> float:
    """Tokens/s of the target's decoder with its hidden states, without the lm_head: extract runs it so,
    and a prefill's logits are the last token's alone (SmolLM2's head is a fifth of its matmuls)."""
    ids = _ids(FORWARD_TOKENS // FORWARD_ROW, FORWARD_ROW, vocab, torch)
    decoder = model.get_decoder()
    with torch.inference_mode():
        s = _median_seconds(lambda: decoder(input_ids=ids, output_hidden_states=True))
    return ids.numel() / s


def _generate(model, ids, steps: int, torch) -> None:
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )


def _decode_step(model, batch: int, vocab: int, torch) -> float:
    """Seconds per greedy step at `batch` rows: the difference of two generate lengths, so the prefill
    (billed at the forward rate) is not counted in it."""
    ids = _ids(batch, PROMPT_TOKENS, vocab, torch)
    short = _median_seconds(lambda: _generate(model, ids, 1, torch), repeats=1)
    long = _median_seconds(lambda: _generate(model, ids, 1 + DECODE_STEPS, torch), repeats=1)
    # A shared machine's noise can make the difference vanish: then the whole long call per step, prefill
    # and all (an upper bound).
    return (long - short) / DECODE_STEPS if long > short else long / (1 + DECODE_STEPS)


def _verify_step(model, n: int, step_s: float, vocab: int, torch) -> float:
    """A batch-1 forward over n new tokens (a speculative verify), as the one-token decode step scaled by
    the measured cost of an n-token over a one-token forward (both after a PROMPT_TOKENS prefix)."""

    def timed(width):
        ids = _ids(1, PROMPT_TOKENS + width, vocab, torch)
        with torch.inference_mode():
            return _median_seconds(lambda: model(input_ids=ids))

    return step_s * max(1.0, timed(n) / timed(1))


def _train_rate(recipe: Recipe, target: Target, head, dtype: str, torch) -> float:
    """Tokens/s of drafter training steps (the objective's forward, backward, clip, AdamW) at the recipe's
    shapes, for the reference method's drafter (the registry's DEFAULT, which the rates are scaled from)."""
    from specdraft.methods import DEFAULT, named

    cfg, method = recipe.train, named(DEFAULT)
    dcfg = method.plan_config(target, cfg)
    drafter = dcfg.make_drafter()
    model = method.objective(drafter, head[: dcfg.draft_vocab_size].float(), cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    T, H, n_aux = TRAIN_TOKENS, target.hidden_size, len(target.aux_layer_ids)
    batch = {
        "input_ids": _ids(1, T, target.vocab_size, torch),
        "loss_mask": torch.ones(1, T, dtype=torch.bool),
        "documents": torch.zeros(1, T, dtype=torch.long),
        "positions": torch.arange(T)[None],
        "top": torch.zeros(1, T, dtype=torch.long),
        "aux": torch.randn(1, T, n_aux * H),
        "last": torch.randn(1, T, H),
    }

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss, _ = model(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return T / _median_seconds(step, repeats=TRAIN_STEPS)


def _top_rate(head, hidden_size: int, torch) -> float:
    """Tokens/s of the target's top token over its full vocab (train's pass before the first step), at
    the dtype train computes it in."""
    dtype = getattr(torch, resolve_dtype("auto", "cpu"))
    head = head.to(dtype)
    rows = torch.randn(TOP_TOKENS, hidden_size, dtype=dtype)
    with torch.inference_mode():
        s = _median_seconds(lambda: (rows @ head.T).argmax(-1), repeats=2)
    return TOP_TOKENS / s
