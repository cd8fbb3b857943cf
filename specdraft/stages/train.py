"""train: the EAGLE-3 drafter with training-time test (TTT), from the target's hidden states.

Alignment (T tokens x_0..x_{T-1} of one document, target aux states h_t, final-norm states z_t): at
drafting step i the drafter at position t reads token x_{t+1+i} and, at step 0, fc(h_t) (later: its
own output of step i-1 at t). It predicts x_{t+2+i}, whose target distribution is
softmax(lm_head(z_{t+1+i})) restricted to the draft vocabulary. The loss counts where x_{t+2+i} is an
assistant token of the same document and the target's top token is inside the draft vocabulary
(EAGLE-3's rule: elsewhere the drafter cannot be right). Step i runs at rotary positions t+i (counted
from the document's start), as it does when drafting, and is weighted decay^i.

Documents are packed into rows of `batch_tokens` tokens (no padding waste); attention and rotary
positions stay per document, so a packed row computes exactly what the documents would alone.

One optimizer step takes `micro_batches` packed rows; under torchrun they are split across ranks (DDP
or FSDP2), so a run on N processes takes the same steps as one process on the same data.

The trainer sees tensors only (token ids, masks, hidden states) plus the target's embedding and
lm_head weights; it never loads the target model.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from specdraft.billing import MEMORY_HEADROOM, make_plan
from specdraft.config import Recipe, TrainConfig, to_dict
from specdraft.drafters import vocab
from specdraft.drafters.checkpoint import COMPLETE, init_from, save_checkpoint
from specdraft.drafters.eagle3 import DrafterConfig, Eagle3Drafter
from specdraft.drafters.ttt import (
    LOGIT_CHUNK,
    LOSSES,
    PAD_DOCUMENT,
    STAT_COLUMNS,
    TTT,
    summarize,
)
from specdraft.hidden.online import open_hidden
from specdraft.run import RunFolder
from specdraft.targets import Target, resolve_dtype

HEAD_INITS = ("random", "target", "target-frozen")
OPTIMIZERS = ("adamw", "muon")


# ---------------------------------------------------------------------------------------------------
# Data: packing and batches


def pack(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Samples in `order` grouped into rows of at most `budget` tokens (a longer sample gets a row of
    its own and is cut to the budget by `collate`)."""
    rows, current, used = [], [], 0
    for i in order:
        n = min(lengths[i], budget)
        if current and used + n > budget:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        rows.append(current)
    return rows


def collate(source, rows: list[list[int]], tops: list[torch.Tensor], budget: int, fixed: bool = True) -> dict:
    """Packed rows, right-padded: input_ids / loss_mask / documents / positions / top [B, T], aux
    [B, T, n_aux*H], last [B, T, H]. Samples longer than `budget` are cut to it. `fixed` pads to the
    budget, one shape for every batch, so compiled kernels (FlexAttention, torch.compile) are built
    once; otherwise to the longest row (eager kernels take any shape, and padding is pure waste)."""
    rows_items = [[(i, source[i]) for i in row] for row in rows]
    longest = max(sum(min(it["input_ids"].numel(), budget) for _, it in row) for row in rows_items)
    B, T = len(rows), budget if fixed else longest
    first = rows_items[0][0][1]
    batch = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "documents": torch.full((B, T), PAD_DOCUMENT, dtype=torch.long),
        "positions": torch.zeros(B, T, dtype=torch.long),
        "top": torch.zeros(B, T, dtype=torch.long),
        "aux": torch.zeros(B, T, first["aux"].shape[-1], dtype=first["aux"].dtype),
        "last": torch.zeros(B, T, first["last"].shape[-1], dtype=first["last"].dtype),
    }
    for r, row in enumerate(rows_items):
        at = 0
        for doc, (i, it) in enumerate(row):
            n = min(it["input_ids"].numel(), budget)
            span = slice(at, at + n)
            batch["input_ids"][r, span] = it["input_ids"][:n].long()
            batch["loss_mask"][r, span] = it["loss_mask"][:n].bool()
            batch["documents"][r, span] = doc
            batch["positions"][r, span] = torch.arange(n)
            batch["top"][r, span] = tops[i][:n]
            batch["aux"][r, span] = it["aux"][:n]
            batch["last"][r, span] = it["last"][:n]
            at += n
    return batch


@torch.no_grad()
def target_top_tokens(source, head: torch.Tensor, indices=None, device: torch.device | None = None
                      ) -> dict[int, torch.Tensor]:
    """The target's top token (over its full vocab) at every position of the given samples.

    Computed once before training, on the training device: the full-vocab logits cost ~10x the
    draft-vocab ones and are only needed for this argmax, which does not change from epoch to epoch.
    """
    from tqdm import tqdm

    device = device or torch.device("cpu")
    head = head.to(device, torch.bfloat16)
    indices = range(len(source)) if indices is None else indices
    tops = {}
    for i in tqdm(indices, desc="target top tokens", unit="sample", leave=False):
        last = source.last(i, device).to(torch.bfloat16)
        tops[i] = torch.cat([(rows @ head.T).argmax(-1) for rows in last.split(LOGIT_CHUNK)]).cpu()
    return tops


# ---------------------------------------------------------------------------------------------------
# Training-time test


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine (or linear) decay to zero, as a factor of cfg.lr."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------------
# Checkpoints


# ---------------------------------------------------------------------------------------------------
# Distributed


def distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device); under torchrun the process group is started here (NCCL on GPUs,
    gloo on the CPU)."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def wrap(model: TTT, parallel: str, world: int, device: torch.device) -> nn.Module:
    if world == 1:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.drafter.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    raise ValueError(f"train.parallel = {parallel!r}: expected 'ddp' or 'fsdp'")


def all_sum(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


# ---------------------------------------------------------------------------------------------------
# The stage


def split_holdout(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices: a seeded random `fraction` is held out (at least one sample
    when fraction > 0 and there are two or more)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    k = min(n - 1, max(1, round(n * fraction))) if fraction > 0 and n > 1 else 0
    return sorted(order[k:]), sorted(order[:k])


def epoch_rows(train_idx: list[int], lengths: list[int], cfg: TrainConfig, epoch: int) -> list[list[int]]:
    """The packed rows of one epoch, in a seeded order that depends only on (seed, epoch): a resumed
    run sees the same rows in the same order."""
    order = list(train_idx)
    random.Random(cfg.seed * 1_000_003 + epoch).shuffle(order)
    rows = pack(order, lengths, cfg.batch_tokens)
    usable = len(rows) - len(rows) % cfg.micro_batches  # whole optimizer steps only
    return rows[:usable] if usable else rows


def epoch_steps(train_idx: list[int], lengths: list[int], cfg: TrainConfig) -> int:
    """Optimizer steps per epoch: the fewest of any epoch. Packing each epoch's shuffle gives a slightly
    different number of rows (328 in one epoch, 327 in the twelfth of the smollm2-h200 run), and the step
    count must be one number for the schedule and for resuming; an epoch with more rows drops its last."""
    return min(len(epoch_rows(train_idx, lengths, cfg, e)) for e in range(cfg.epochs)) // cfg.micro_batches


def fixed_shape(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether batches keep one shape: what compiled kernels (CUDA FlexAttention, torch.compile) need."""
    return cfg.compile or device.type == "cuda"


class PackedRows(torch.utils.data.Dataset):
    """Packed rows as batches of one row each, built in DataLoader workers (reading and packing the
    hidden states overlaps the training step)."""

    def __init__(self, source, rows: list[list[int]], tops, budget: int, fixed: bool):
        self.source, self.rows, self.tops, self.budget, self.fixed = source, rows, tops, budget, fixed

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, k: int) -> dict:
        return collate(self.source, [self.rows[k]], self.tops, self.budget, self.fixed)


def step_batches(source, tops, train_idx, lengths, cfg: TrainConfig, step: int, steps_per_epoch: int,
                 rank: int, world: int, device: torch.device):
    """(epoch, this process's packed batches of the step) for every step from `step` to the end: each
    step takes `micro_batches` consecutive rows of the epoch's order, this rank every world-th of them."""
    workers = 0 if cfg.hidden == "online" else cfg.loader_workers  # an online target stays in this process
    for epoch in range(step // steps_per_epoch, cfg.epochs):
        first = step - epoch * steps_per_epoch if epoch == step // steps_per_epoch else 0
        rows = epoch_rows(train_idx, lengths, cfg, epoch)
        mine = [row for s in range(first, steps_per_epoch)
                for row in rows[s * cfg.micro_batches:(s + 1) * cfg.micro_batches][rank::world]]
        loader = torch.utils.data.DataLoader(PackedRows(source, mine, tops, cfg.batch_tokens, fixed_shape(cfg, device)), batch_size=None,
                                             num_workers=workers, pin_memory=device.type == "cuda")
        it = iter(loader)
        for _ in range(first, steps_per_epoch):
            yield epoch, [next(it) for _ in range(cfg.micro_batches // world)]


def autocast_for(cfg: TrainConfig, device: torch.device) -> tuple[str, torch.autocast]:
    """The dtype train.autocast_dtype means on `device` ("auto" resolved) and its autocast context."""

    dtype = resolve_dtype(cfg.autocast_dtype, device.type)
    return dtype, torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


@torch.no_grad()
def evaluate(model: TTT, source, rows, tops, cfg, device, autocast) -> dict:
    model.eval()
    total = torch.zeros(cfg.ttt_steps, len(STAT_COLUMNS), device=device)
    for row in rows:
        batch = to_device(collate(source, [row], tops, cfg.batch_tokens, fixed_shape(cfg, device)), device)
        with autocast:
            _, stats = model(batch)
        total += stats
    model.train()
    return summarize(total.cpu())


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def plot_curves(log_path: Path, png: Path) -> None:
    """The loss and held-out tau curves as a PNG beside the checkpoints."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in log_path.read_text().splitlines() if line]
    train = [r for r in records if r["kind"] == "train"]
    held = [r for r in records if r["kind"] == "eval"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i in range(len(train[0]["loss"]) if train else 0):
        axes[0].plot([r["step"] for r in train], [r["loss"][i] for r in train], label=f"step {i}")
        axes[1].plot([r["step"] for r in train], [r["acc"][i] for r in train], label=f"step {i}")
    axes[2].plot([r["step"] for r in held], [r["tau"] for r in held], marker="o")
    for ax, title in zip(axes, ("train loss per TTT step", "train top-1 accuracy", "held-out simulated tau")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


class TrainMemoryError(RuntimeError):
    """The plan's training memory does not fit the device at all."""


def check_memory(recipe: Recipe, folder: RunFolder) -> None:
    """Refuse a training that the plan's memory model puts over the device's whole memory: the
    out-of-memory kill would come at the first long batch, lose the steps since the last checkpoint and
    name no cause. Over the plan's headroom but within the memory, only a warning: the model is an
    estimate. Either way the message names the batch that fits."""

    try:
        plan = make_plan(recipe, folder)
    except Exception as e:  # noqa: BLE001 - a target the plan cannot read still trains, unchecked
        print(f"train: warning: memory not checked ({type(e).__name__}: {e})", file=sys.stderr)
        return
    check = next(c for c in plan["checks"] if c["check"] == "train memory")
    if check["ok"]:
        return
    fixes = [r["do"] for r in plan["recommendations"] if r["do"].startswith(("--batch-tokens", "FSDP"))]
    text = (f"{check['text']} at train.batch_tokens = {recipe.train.batch_tokens:,}; "
            + (f"fits with: {' or '.join(fixes)}" if fixes else "no batch size fits (specdraft plan)"))
    if check["need_bytes"] > check["usable_bytes"] / MEMORY_HEADROOM:
        raise TrainMemoryError(f"train: {text}")
    print(f"train: warning: {text}", file=sys.stderr)


def run(recipe: Recipe, folder: RunFolder) -> dict:
    from tqdm import tqdm

    cfg = recipe.train
    if cfg.loss not in LOSSES:
        raise ValueError(f"train.loss = {cfg.loss!r}: expected one of {', '.join(LOSSES)}")
    if cfg.lm_head_init not in HEAD_INITS:
        raise ValueError(f"train.lm_head_init = {cfg.lm_head_init!r}: expected one of {', '.join(HEAD_INITS)}")
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"train.optimizer = {cfg.optimizer!r}: expected one of {', '.join(OPTIMIZERS)}")
    if cfg.optimizer == "muon" and cfg.parallel == "fsdp":
        # Muon orthogonalises whole matrices; FSDP holds each rank's shard only.
        raise ValueError("train.optimizer = 'muon' needs whole weight matrices: use train.parallel = 'ddp'")
    t_start = time.time()
    if cfg.hidden == "disk":
        folder.require("extract")
    check_memory(recipe, folder)
    rank, world, device = distributed()
    if cfg.micro_batches % world:
        raise ValueError(f"train.micro_batches = {cfg.micro_batches} must be a multiple of the "
                         f"{world} torchrun processes")
    torch.manual_seed(cfg.seed)
    source = open_hidden(recipe, folder)
    target = Target(recipe.target.model, source.aux_layer_ids)
    samples = [source.tokens(i) for i in range(len(source))]
    lengths = [len(ids) for ids, _ in samples]
    train_idx, held_idx = split_holdout(len(source), cfg.holdout, cfg.seed)
    if cfg.max_samples:
        train_idx = train_idx[:cfg.max_samples]
    counts = vocab.token_counts([samples[i] for i in train_idx], target.vocab_size)
    dcfg = DrafterConfig.from_target(target, cfg.draft_vocab_size)  # its size: 0 and oversize resolved
    d2t, t2d = vocab.build(counts, dcfg.draft_vocab_size)
    coverage = vocab.coverage(counts, t2d)
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
        t2d = drafter.t2d.clone()
        coverage = vocab.coverage(counts, t2d)
    head = target.head_weight()
    if cfg.lm_head_init.startswith("target") and not cfg.init_from:
        drafter.lm_head.weight.data.copy_(head[t2d].float())
        drafter.norm.weight.data.copy_(target.final_norm_weight())
        # Frozen, the head is the target's own reading of a hidden state: the one layer learns to write
        # states it reads right, rather than Vd x H more parameters from few answer tokens.
        drafter.lm_head.weight.requires_grad_(cfg.lm_head_init == "target")
    # Where a run's wall time goes, printed at its end: the steps are not all of it (bench/ablations.md).
    phase = {"start-up": time.time() - t_start}
    t_phase = time.time()
    tops = target_top_tokens(source, head, train_idx + held_idx, device)
    phase["top tokens"] = time.time() - t_phase
    model = TTT(drafter, head[t2d].float(), cfg.ttt_steps, cfg.step_weight_decay, cfg.loss,
                cfg.gradient_checkpointing, cfg.hidden_noise).to(device)
    if cfg.compile:
        model.drafter.compile()
    wrapped = wrap(model, cfg.parallel, world, device)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    optimizers = make_optimizers(wrapped, cfg)
    steps_per_epoch = epoch_steps(train_idx, lengths, cfg)
    total_steps = cfg.epochs * steps_per_epoch
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, total_steps, cfg)) for o in optimizers]
    autocast_dtype, autocast = autocast_for(cfg, device)
    held_rows = pack(held_idx, lengths, cfg.batch_tokens)

    ckpt_dir = folder.checkpoints
    log_path = folder.train_log
    meta = {"train": to_dict(cfg), "autocast": autocast_dtype, "aux_layer_ids": source.aux_layer_ids,
            "target": target.describe(), "vocab_coverage": round(coverage, 4), "holdout_samples": held_idx}
    state = {"step": 0, "tokens": 0, "seconds": 0.0, "best_tau": None}
    # A stopped run (its stage not recorded done) continues from `latest`; a finished one is retrained.
    previous = folder.stage("train")
    resumed = (cfg.resume and (folder.checkpoint("latest") / COMPLETE).exists()
               and (previous is None or previous["state"] != "done"))
    if world > 1:
        torch.distributed.barrier()  # every rank has decided before rank 0 rewrites the manifest
    if resumed:
        resume_from(folder.checkpoint("latest"), cfg, wrapped, optimizers, schedulers, state)
    if rank == 0:
        if not resumed:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        folder.record("train", state="partial", config=cfg)
        keep_log_until(log_path, state["step"])
        print(f"train: {len(train_idx)} samples (+{len(held_idx)} held out), draft vocab "
              f"{dcfg.draft_vocab_size} (covers {coverage:.1%} of answer tokens), {n_trainable / 1e6:.2f} M "
              f"trainable parameters, {total_steps} steps on {world} process(es)"
              + (f", resumed at step {state['step']}" if resumed else ""))
    writer = tensorboard(folder.tensorboard, rank)

    def checkpoint(name: str, metrics: dict | None = None):
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
        save = Eagle3Drafter(dcfg)
        save.load_state_dict({k.removeprefix("drafter."): v for k, v in model_state.items()})
        save_checkpoint(save, folder.checkpoint(name), {**meta, "step": state["step"], "metrics": metrics}, extra)

    bar = tqdm(total=total_steps, initial=state["step"], desc="train", unit="step", disable=rank != 0)
    last_eval = None
    phase.update({"steps": 0.0, "held-out": 0.0, "checkpoints": 0.0})
    t_loop, seconds_before = time.time(), state["seconds"]  # state["seconds"] sums the steps (from resume)
    for epoch, micro in step_batches(source, tops, train_idx, lengths, cfg, state["step"], steps_per_epoch,
                                     rank, world, device):
        t0 = time.time()
        step_stats = torch.zeros(cfg.ttt_steps, len(STAT_COLUMNS), device=device)
        tokens = 0
        for m, batch in enumerate(micro):
            tokens += int((batch["documents"] != PAD_DOCUMENT).sum())
            batch = to_device(batch, device)
            sync = m == len(micro) - 1
            ctx = wrapped.no_sync() if (not sync and hasattr(wrapped, "no_sync")) else _null()
            with ctx:
                with autocast:
                    loss, stats = wrapped(batch)
                (loss / len(micro)).backward()
            step_stats += stats
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        for optimizer, scheduler in zip(optimizers, schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        step_tokens = all_sum(torch.tensor(float(tokens), device=device), world)
        all_sum(step_stats, world)
        state["step"] += 1
        state["tokens"] += int(step_tokens.item())
        state["seconds"] += time.time() - t0
        if rank == 0:
            s = summarize(step_stats.cpu())
            weighted = sum(cfg.step_weight_decay ** i * x for i, x in enumerate(s["loss"]))
            record = {"kind": "train", "step": state["step"], "epoch": epoch, "lr": schedulers[0].get_last_lr()[0],
                      "weighted_loss": round(weighted, 6), **s}
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if writer and state["step"] % cfg.log_every == 0:
                writer.add_scalar("train/loss", weighted, state["step"])
                for i in range(cfg.ttt_steps):
                    writer.add_scalar(f"train/loss_{i}", s["loss"][i], state["step"])
                    writer.add_scalar(f"train/acc_{i}", s["acc"][i], state["step"])
                    writer.add_scalar(f"train/cond_accept_{i}", s["cond_accept"][i], state["step"])
                writer.add_scalar("train/lr", record["lr"], state["step"])
            bar.update(1)
            bar.set_postfix(loss=f"{weighted:.3f}", acc0=f"{s['acc'][0]:.2f}",
                            tok_s=f"{state['tokens'] / max(state['seconds'], 1e-9):,.0f}")
        done = state["step"] == total_steps
        t_phase = time.time()
        if held_rows and (state["step"] % cfg.eval_every == 0 or done):
            # `model` is the unwrapped module under DDP (no gradient hooks needed) and the sharded one under FSDP.
            last_eval = evaluate(model, source, held_rows, tops, cfg, device, autocast)
            if rank == 0:
                with open(log_path, "a") as f:
                    f.write(json.dumps({"kind": "eval", "step": state["step"], **last_eval}) + "\n")
                if writer:
                    writer.add_scalar("heldout/tau", last_eval["tau"], state["step"])
                    for i, a in enumerate(last_eval["cond_accept"]):
                        writer.add_scalar(f"heldout/cond_accept_{i}", a, state["step"])
                tqdm.write(f"step {state['step']}: held-out tau {last_eval['tau']:.3f}, conditional "
                           f"acceptance {' / '.join(f'{a:.3f}' for a in last_eval['cond_accept'])}")
            phase["held-out"] += time.time() - t_phase
            t_phase = time.time()
            if state["best_tau"] is None or last_eval["tau"] > state["best_tau"]:
                state["best_tau"] = last_eval["tau"]
                checkpoint("best", last_eval)
        if state["step"] % cfg.checkpoint_every == 0 or done:
            checkpoint("latest", last_eval)
        phase["checkpoints"] += time.time() - t_phase
    bar.close()
    t_phase = time.time()
    checkpoint("final", last_eval)
    phase["checkpoints"] += time.time() - t_phase
    phase["steps"] = state["seconds"] - seconds_before
    # What the loop spent neither stepping, scoring nor saving: waiting for the loader's next batch.
    phase["data wait"] = time.time() - t_loop - phase["steps"] - phase["held-out"] - phase["checkpoints"]
    if writer:
        writer.close()
    if rank != 0:
        return {}
    if log_path.exists() and log_path.stat().st_size:
        plot_curves(log_path, folder.curves)
    # The export stage reads `best` when held-out data chose one, else the final weights.
    chosen = "best" if (folder.checkpoint("best") / COMPLETE).exists() else "final"
    metrics = {"tokens_per_s": round(state["tokens"] / state["seconds"], 1) if state["seconds"] else None,
               "heldout": last_eval, "best_tau": state["best_tau"], "vocab_coverage": round(coverage, 4)}
    counts_out = {"steps": state["step"], "epochs": cfg.epochs, "samples": len(train_idx),
                  "heldout_samples": len(held_idx), "trainable_params": n_trainable, "processes": world}
    phase = {k: round(v, 1) for k, v in phase.items()}
    print(f"train: {time.time() - t_start:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in phase.items()))
    metrics["phase_seconds"] = phase
    print(f"next: specdraft export --run {folder.path}")
    return folder.record("train", state="done", config=cfg, counts=counts_out, metrics=metrics,
                      seconds=time.time() - t_start, extra={"checkpoint": str(folder.checkpoint(chosen).relative_to(folder.path))})


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def tensorboard(logdir: Path, rank: int):
    if rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(logdir))


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


# Fields that fix the data order, the schedule or the shapes: a resumed run must keep them.
RESUME_FIXED = ("seed", "batch_tokens", "micro_batches", "epochs", "holdout", "draft_vocab_size", "ttt_steps",
                "lr", "warmup_steps", "schedule", "norm_before_fc", "fc_norm", "norm_output", "norm_before_residual",
                "lm_head_init", "optimizer")


def make_optimizers(wrapped, cfg: TrainConfig) -> list:
    """AdamW over every trainable parameter; or Muon over the weight matrices of fc and the layer with
    AdamW over the rest (lm_head's rows are per-token classifiers, not a map Muon should orthogonalise,
    and the norms are vectors)."""
    named = [(n, p) for n, p in wrapped.named_parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW([p for _, p in named], lr=cfg.lr, weight_decay=cfg.weight_decay)]
    to_muon = {n: p.ndim == 2 and "lm_head" not in n for n, p in named}
    matrices = [p for n, p in named if to_muon[n]]
    rest = [p for n, p in named if not to_muon[n]]
    out = [torch.optim.Muon(matrices, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")]
    return out + ([torch.optim.AdamW(rest, lr=cfg.lr, weight_decay=cfg.weight_decay)] if rest else [])


def resume_from(path: Path, cfg: TrainConfig, wrapped, optimizers: list, schedulers: list, state: dict) -> None:
    """Load model, optimizer, scheduler, data position and RNG from a complete checkpoint."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = json.loads((path / "config.json").read_text())["train"]
    defaults = TrainConfig()  # a field newer than the checkpoint had its default then
    changed = [f"{k}: {saved.get(k, getattr(defaults, k))!r} -> {getattr(cfg, k)!r}" for k in RESUME_FIXED
               if saved.get(k, getattr(defaults, k)) != getattr(cfg, k)]
    if changed:
        raise ValueError(f"{path}: cannot resume with a changed train config ({'; '.join(changed)}); restore "
                         "those fields, or start over with --set train.resume=false (checkpoints are replaced)")

    extra = torch.load(path / "trainer.pt", weights_only=False)
    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(wrapped, extra["model"], options=full)
    set_optimizer_state_dict(wrapped, optimizers, extra["optimizer"], options=full)
    saved_schedulers = extra["scheduler"] if isinstance(extra["scheduler"], list) else [extra["scheduler"]]
    for scheduler, saved_state in zip(schedulers, saved_schedulers, strict=True):
        scheduler.load_state_dict(saved_state)
    state.update(extra["state"])
    torch.set_rng_state(extra["rng"]["torch"])
    random.setstate(extra["rng"]["python"])
    if extra["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(extra["rng"]["cuda"])


def keep_log_until(log_path: Path, step: int) -> None:
    """Drop log records past `step` (written by a run killed after its last checkpoint), so a resumed
    run's log has each step once."""
    if not log_path.exists():
        log_path.write_text("")
        return
    kept = [line for line in log_path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    tmp = log_path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.rename(log_path)
