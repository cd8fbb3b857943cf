"""The trainer's parts that are not the loop (stages/train.py is the loop): packing the samples into
rows and batches, the target's top tokens, the learning-rate schedule and optimizers, the processes of a
torchrun, and the training log and its curves.

Documents are packed into rows of `batch_tokens` tokens (no padding waste); attention and rotary
positions stay per document, so a packed row computes exactly what the documents would alone. One
optimizer step takes `micro_batches` packed rows; under torchrun they are split across ranks (DDP or
FSDP2), so a run on N processes takes the same steps as one process on the same data.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from specdraft.config import TrainConfig
from specdraft.drafters.common import LOGIT_CHUNK, STAT_COLUMNS, collate, pack, summarize
from specdraft.files import FULL, DiskFull, FileError, read_jsonl
from specdraft.run import write_text
from specdraft.targets import resolve_dtype

if TYPE_CHECKING:
    from specdraft.methods.contract import Method


# ---------------------------------------------------------------------------------------------------
# Data: packing and batches


@torch.no_grad()
def target_top_tokens(
    source, head: torch.Tensor, indices=None, device: torch.device | None = None
) -> dict[int, torch.Tensor]:
    """The target's top token (over its full vocab) at every position of the given samples.

    Computed once before training, on the training device: the full-vocab logits cost ~10x the
    draft-vocab ones and are only needed for this argmax, which does not change from epoch to epoch.
    """
    from tqdm import tqdm

    device = device or torch.device("cpu")
    head = top_head(head, device)
    indices = range(len(source)) if indices is None else indices
    return {
        i: top_tokens(source.last(i, device), head)
        for i in tqdm(indices, desc="target top tokens", unit="sample", leave=False)
    }


def top_head(head: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The lm_head weight as the top tokens are computed with it: on `device`, in bf16 where the device
    multiplies it (emulated bf16 on AVX2 CPUs took 1-2.5 s a sample)."""
    return head.to(device, getattr(torch, resolve_dtype("auto", device.type)))


@torch.no_grad()
def top_tokens(last: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """One sample's target top tokens [T] (on the CPU) from its final-norm states [T, H]."""
    last = last.to(head.device, head.dtype)
    return torch.cat([(rows @ head.T).argmax(-1) for rows in last.split(LOGIT_CHUNK)]).cpu()


class TopsOnArrival:
    """For a served source: each sample's top tokens computed as its states arrive (in the fetching thread,
    once per sample), instead of a pass over every sample before training (that pass would be a whole
    extra epoch of requests to the server)."""

    def __init__(self, head: torch.Tensor, device: torch.device, tops: dict):
        self.head, self.tops = top_head(head, device), tops

    def __call__(self, i: int, item: dict) -> None:
        if i not in self.tops:
            self.tops[i] = top_tokens(item["last"], self.head)


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
    """Optimizer steps per epoch: the fewest of any epoch. Packing each epoch's shuffle can give a
    different number of rows, and the step count must be one number for the schedule and for resuming;
    an epoch with more rows drops its last."""
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


def step_batches(
    source,
    tops,
    train_idx,
    lengths,
    cfg: TrainConfig,
    step: int,
    steps_per_epoch: int,
    rank: int,
    world: int,
    device: torch.device,
):
    """(epoch, this process's packed batches of the step) for every step from `step` to the end: each
    step takes `micro_batches` consecutive rows of the epoch's order, this rank every world-th of them.
    One loader serves every epoch left: its workers start once, not once per epoch (a run of many
    one-step epochs otherwise waits for new workers at every step)."""
    # An online target stays in this process, and a served source's requests run ahead in its own threads.
    workers = 0 if cfg.hidden in ("online", "served") else cfg.loader_workers
    first_epoch = step // steps_per_epoch
    plan = []  # (epoch, this rank's rows of the step) for every step left
    for epoch in range(first_epoch, cfg.epochs):
        first = step - epoch * steps_per_epoch if epoch == first_epoch else 0
        rows = epoch_rows(train_idx, lengths, cfg, epoch)
        plan += [
            (epoch, rows[s * cfg.micro_batches : (s + 1) * cfg.micro_batches][rank::world])
            for s in range(first, steps_per_epoch)
        ]
    rows_of_mine = PackedRows(
        source, [row for _, mine in plan for row in mine], tops, cfg.batch_tokens, fixed_shape(cfg, device)
    )
    if cfg.hidden == "served":  # its requests follow the order the rows will be read in
        source.expect([i for row in rows_of_mine.rows for i in row])
    # Its own generator: a loader drawing its workers' seed from torch's RNG would move the stream the
    # steps draw from (hidden_noise) by one draw per loader started, and a resumed run starts one.
    loader = torch.utils.data.DataLoader(
        rows_of_mine,
        batch_size=None,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(cfg.seed + first_epoch),
        worker_init_fn=leave_signals_to_the_trainer,
    )
    it = iter(loader)
    for epoch, mine in plan:
        yield epoch, [next(it) for _ in mine]


def leave_signals_to_the_trainer(worker_id: int) -> None:
    """A loader worker ignores Ctrl-C and SIGTERM: they reach the whole process group (a terminal, `timeout`),
    and a worker that died of one made the trainer print a DataLoader traceback on its way out instead of
    stopping its workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def evaluate(model: nn.Module, source, rows, tops, cfg: TrainConfig, device, autocast, positions: int) -> dict:
    """summarize()'s loss, accuracy, conditional acceptance and tau over the packed `rows` (statistics of
    `positions` rows each), the model in eval mode."""
    model.eval()
    total = torch.zeros(positions, len(STAT_COLUMNS), device=device)
    for row in rows:
        batch = to_device(collate(source, [row], tops, cfg.batch_tokens, fixed_shape(cfg, device)), device)
        with autocast:
            _, stats = model(batch)
        total += stats
    model.train()
    return summarize(total.cpu())


# ---------------------------------------------------------------------------------------------------
# Optimization


def lr_factor(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine (or linear) decay to zero, as a factor of cfg.lr."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1 + math.cos(math.pi * progress))


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


def autocast_for(cfg: TrainConfig, device: torch.device) -> tuple[str, torch.autocast]:
    """The dtype train.autocast_dtype means on `device` ("auto" resolved) and its autocast context."""
    dtype = resolve_dtype(cfg.autocast_dtype, device.type)
    return dtype, torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


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
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def wrap(model: nn.Module, parallel: str, world: int, device: torch.device) -> nn.Module:
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
# Logs and curves


LOG_FIX = "remove the damaged line, or start over with --set train.resume=false"


def read_log(log_path: Path, torn_tail: bool = False) -> list[tuple[str, dict]]:
    """(its line, as text) and record of each line of train_log.jsonl, each checked to be a train or eval
    record of a step. `torn_tail`: a last line cut by a kill is dropped."""
    records = []
    for lineno, r in read_jsonl(log_path, fix=LOG_FIX, torn_tail=torn_tail):
        if not isinstance(r.get("step"), int) or r.get("kind") not in ("train", "eval"):
            raise FileError(f"{log_path}:{lineno}: not a training log record (a step and kind); {LOG_FIX}")
        records.append((json.dumps(r), r))
    return records


def append_record(log_path: Path, record: dict) -> None:
    line = (json.dumps(record) + "\n").encode()
    try:
        with open(log_path, "ab") as f:
            f.write(line)
    except OSError as e:  # a line cut short by a full disk is dropped on resume (read_log's torn tail)
        if e.errno in FULL:
            raise DiskFull(log_path, len(line)) from None
        raise


def tensorboard(logdir: Path, rank: int):
    if rank != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(logdir))


def plot_curves(log_path: Path, png: Path, method: Method) -> list[str]:
    """The loss and held-out tau curves as a PNG beside the checkpoints, one curve per statistic row
    named as the method names it (TTT steps, block slots); returns the axes' titles and the curves'
    labels, as drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for _, r in read_log(log_path)]
    train = [r for r in records if r["kind"] == "train"]
    held = [r for r in records if r["kind"] == "eval"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i, label in enumerate(method.position_labels(len(train[0]["loss"]) if train else 0)):
        axes[0].plot([r["step"] for r in train], [r["loss"][i] for r in train], label=label)
        axes[1].plot([r["step"] for r in train], [r["acc"][i] for r in train], label=label)
    axes[2].plot([r["step"] for r in held], [r["tau"] for r in held], marker="o")
    titles = (
        f"train loss per {method.position}",
        f"train top-1 accuracy per {method.position}",
        "held-out simulated tau",
    )
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png)
    drawn = [ax.get_title() for ax in axes] + [line.get_label() for line in axes[0].lines]
    plt.close(fig)
    return drawn


def keep_log_until(log_path: Path, step: int) -> None:
    """Drop log records past `step` (written by a run killed after its last checkpoint), so a resumed
    run's log has each step once."""
    if not log_path.exists():
        log_path.write_text("")
        return
    kept = [line for line, r in read_log(log_path, torn_tail=True) if r["step"] <= step]
    write_text(log_path, "".join(line + "\n" for line in kept))
