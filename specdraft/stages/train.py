"""train: the drafter of train.method from the target's hidden states. What differs between methods
(the drafter, its objective, its statistics, the fields a resumed run keeps) comes from the method's
package (specdraft/methods/); the loop, the data, the checkpoints and resuming are one. The loop's parts
(packing, the schedule, the processes of a torchrun, the log and its curves) are specdraft/training.py.

The trainer sees tensors only (token ids, masks, hidden states) plus the target's embedding and
lm_head weights; it never loads the target model.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch

from specdraft import training
from specdraft.billing import train_memory
from specdraft.config import ConfigError, Recipe, TrainConfig, to_dict
from specdraft.drafters import vocab
from specdraft.drafters.checkpoint import (
    COMPLETE,
    RESTART,
    check_trainer_state,
    load_training,
    save_training,
)
from specdraft.drafters.common import PAD_DOCUMENT, STAT_COLUMNS, pack, summarize
from specdraft.files import FileError, read_json
from specdraft.hidden.online import open_hidden
from specdraft.methods import named
from specdraft.run import RunFolder
from specdraft.targets import Target

# ---------------------------------------------------------------------------------------------------
# Checks before training


def check_choices(recipe: Recipe) -> None:
    """The choices that rule each other out and the method's ranges, checked before anything is loaded
    (each field's own choices are its Literal's, checked when the recipe loads)."""
    cfg = recipe.train
    if cfg.optimizer == "muon" and cfg.parallel == "fsdp":
        # Muon orthogonalises whole matrices; FSDP holds each rank's shard only.
        raise ValueError("train.optimizer = 'muon' needs whole weight matrices: use train.parallel = 'ddp'")
    named(cfg.method).check(recipe)


def preflight(recipe: Recipe) -> None:
    """Before the run folder is written (cli): what train would refuse of the recipe."""
    check_choices(recipe)


class TrainMemoryError(RuntimeError):
    """The plan's training memory does not fit the device at all."""


def check_memory(recipe: Recipe, folder: RunFolder) -> None:
    """Refuse a training that the plan's memory model puts over the device's whole memory: the
    out-of-memory kill would come at the first long batch, lose the steps since the last checkpoint and
    name no cause. Over the plan's headroom but within the memory, only a warning: the model is an
    estimate. Either way the message names the batch that fits."""
    try:
        memory = train_memory(recipe, folder)
    except ConfigError:
        raise  # a range the target or the method sets: refused here as plan refuses it
    except Exception as e:  # noqa: BLE001 - a target the plan cannot read still trains, unchecked
        print(f"train: warning: memory not checked ({type(e).__name__}: {e})", file=sys.stderr)
        return
    if memory.fits:
        return
    text = f"{memory.text} at train.batch_tokens = {recipe.train.batch_tokens:,}; " + (
        f"fits with: {' or '.join(memory.fixes)}" if memory.fixes else "no batch size fits (specdraft plan)"
    )
    if memory.beyond_device:
        raise TrainMemoryError(f"train: {text}")
    print(f"train: warning: {text}", file=sys.stderr)


# Fields that fix the data order, the schedule or the shapes: a resumed run must keep them, and its
# method's own (Method.resume_fixed).
RESUME_FIXED = (
    "method",
    "seed",
    "batch_tokens",
    "micro_batches",
    "epochs",
    "holdout",
    "draft_vocab_size",
    "lr",
    "warmup_steps",
    "schedule",
    "lm_head_init",
    "optimizer",
)


def check_resumable(path: Path, cfg: TrainConfig) -> None:
    """Refuse to resume the checkpoint at `path` with a config that changes a RESUME_FIXED field or one
    of its method's."""
    saved = read_json(path / "config.json", fix=RESTART).get("train")
    if not isinstance(saved, dict):
        raise FileError(f"{path / 'config.json'}: no 'train' config to resume with; {RESTART}")
    defaults = TrainConfig()  # a field newer than the checkpoint had its default then
    fixed = RESUME_FIXED + named(cfg.method).resume_fixed
    changed = [
        f"{k}: {saved.get(k, getattr(defaults, k))!r} -> {getattr(cfg, k)!r}"
        for k in fixed
        if saved.get(k, getattr(defaults, k)) != getattr(cfg, k)
    ]
    if changed:
        raise ValueError(
            f"{path}: cannot resume with a changed train config ({'; '.join(changed)}); restore "
            "those fields, or start over with --set train.resume=false (checkpoints are replaced)"
        )


# ---------------------------------------------------------------------------------------------------
# The stage


class Trainer:
    """One run of the stage. Setting it up (the constructor) loads the samples, builds the drafter and
    its optimizers and resumes from `latest` where a stopped run left one; `train` is the loop. Every
    process of a torchrun makes one; rank 0 alone writes the run folder."""

    def __init__(self, recipe: Recipe, folder: RunFolder, servers: list | None = None):
        self.t_start = time.time()
        self.recipe, self.folder, self.cfg = recipe, folder, recipe.train
        self.servers = servers  # states servers handed over for train.hidden = "served" (ServedHidden)
        if self.cfg.hidden == "disk":
            folder.require("extract")
        check_memory(recipe, folder)
        self.rank, self.world, self.device = training.distributed()
        if self.cfg.micro_batches % self.world:
            raise ValueError(
                f"train.micro_batches = {self.cfg.micro_batches} must be a multiple of the "
                f"{self.world} torchrun processes"
            )
        self.resuming = self.will_resume()
        torch.manual_seed(self.cfg.seed)
        counts = self.load_samples()
        try:
            self.set_up(counts)
        except BaseException:
            self.close()
            raise

    def set_up(self, counts: torch.Tensor) -> None:
        """The drafter, the target's top tokens, the model and its optimizers, resumed or fresh."""
        head = self.build_drafter(counts)
        # Where a run's wall time goes, printed at its end: the steps are not all of it (bench/ablations.md).
        self.phase = {"start-up": time.time() - self.t_start}
        t_phase = time.time()
        if self.cfg.hidden == "served":
            self.tops = {}
            self.source.on_arrival = training.TopsOnArrival(head, self.device, self.tops)
            self.source.held_out(self.held_idx)
        else:
            self.tops = training.target_top_tokens(self.source, head, self.train_idx + self.held_idx, self.device)
        self.phase["top tokens"] = time.time() - t_phase
        self.build_model(head)
        self.resume_or_start()
        self.writer = training.tensorboard(self.folder.tensorboard, self.rank)
        self.last_eval = None

    def load_samples(self) -> torch.Tensor:
        """The hidden states' source, its lengths and train / held-out split; returns the training
        samples' answer-token counts, which choose the draft vocabulary."""
        cfg = self.cfg
        self.source = self.open_source()
        self.target = Target(self.recipe.target.model, self.source.aux_layer_ids)
        self.target.check_fits(self.recipe)  # before the draft vocabulary is chosen from it
        named(cfg.method).check_target(self.recipe, self.target.vocab_size, self.target.name)
        samples = [self.source.tokens(i) for i in range(len(self.source))]
        self.lengths = [len(ids) for ids, _ in samples]
        self.train_idx, self.held_idx = training.split_holdout(len(self.source), cfg.holdout, cfg.seed)
        if cfg.max_samples:
            self.train_idx = self.train_idx[: cfg.max_samples]
        return vocab.token_counts([samples[i] for i in self.train_idx], self.target.vocab_size)

    def open_source(self):
        """open_hidden; under torchrun a states server that train starts is started once, by rank 0, and the
        other ranks ask it (each for its own rows of every step)."""
        if self.cfg.hidden != "served" or self.world == 1 or self.cfg.served_endpoints or self.servers:
            return open_hidden(self.recipe, self.folder, self.servers)
        import dataclasses

        import torch.distributed as dist

        source = open_hidden(self.recipe, self.folder) if self.rank == 0 else None
        url = [source.endpoints[0].url if source is not None else None]
        dist.broadcast_object_list(url, src=0)
        if source is not None:
            return source
        recipe = dataclasses.replace(self.recipe, train=dataclasses.replace(self.cfg, served_endpoints=url))
        return open_hidden(recipe, self.folder)

    def build_drafter(self, counts: torch.Tensor) -> torch.Tensor:
        """The method's drafter for the target, its draft vocabulary chosen from `counts`; returns the
        target's lm_head weight."""
        self.method = named(self.cfg.method)
        self.drafter = self.method.build(self.cfg, self.target, counts)
        self.dcfg, self.t2d = self.drafter.config, self.drafter.t2d.clone()
        self.coverage = vocab.coverage(counts, self.t2d)
        self.positions = self.method.positions(self.cfg)
        return self.target.head_weight()

    def build_model(self, head: torch.Tensor) -> None:
        """The method's objective module (wrapped for DDP / FSDP under torchrun), its optimizers and
        schedules, and the held-out rows."""
        cfg = self.cfg
        self.model = self.method.objective(self.drafter, head[self.t2d].float(), cfg).to(self.device)
        if cfg.compile:
            self.model.drafter.compile()
        self.wrapped = training.wrap(self.model, cfg.parallel, self.world, self.device)
        self.params = [p for p in self.wrapped.parameters() if p.requires_grad]
        self.n_trainable = sum(p.numel() for p in self.drafter.parameters() if p.requires_grad)
        self.optimizers = training.make_optimizers(self.wrapped, cfg)
        self.steps_per_epoch = training.epoch_steps(self.train_idx, self.lengths, cfg)
        total_steps = self.total_steps = cfg.epochs * self.steps_per_epoch
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, lambda s: training.lr_factor(s, total_steps, cfg))
            for o in self.optimizers
        ]
        self.autocast_dtype, self.autocast = training.autocast_for(cfg, self.device)
        self.held_rows = pack(self.held_idx, self.lengths, cfg.batch_tokens)

    def will_resume(self) -> bool:
        """Whether this run continues from `latest`: a stopped run left it (its stage not recorded done, or
        a retraining stopped after it moved the last good one's checkpoints aside, to which the good record
        then points); else it starts over, and a finished run is retrained. A checkpoint it cannot resume
        from (another config, a trainer state saved as a pickle) is refused here, before the set-up's long
        parts."""
        cfg, folder = self.cfg, self.folder
        previous = folder.stage("train")
        stopped = (
            previous is None
            or previous["state"] != "done"
            or previous.get("checkpoint", "").startswith(f"{folder.previous_checkpoints.name}/")
        )
        resuming = cfg.resume and (folder.checkpoint("latest") / COMPLETE).exists() and stopped
        if resuming:
            check_resumable(folder.checkpoint("latest"), cfg)
            check_trainer_state(folder.checkpoint("latest"))
        return resuming

    def resume_or_start(self) -> None:
        """Continue from `latest` (will_resume), else start over."""
        cfg, folder, resumed = self.cfg, self.folder, self.resuming
        self.meta = {
            "method": cfg.method,
            "train": to_dict(cfg),
            "autocast": self.autocast_dtype,
            "aux_layer_ids": self.source.aux_layer_ids,
            "target": self.target.describe(),
            "vocab_coverage": round(self.coverage, 4),
            "holdout_samples": self.held_idx,
        }
        self.state = {"step": 0, "tokens": 0, "seconds": 0.0, "best_tau": None}
        if self.world > 1:
            torch.distributed.barrier()  # every rank has decided before rank 0 rewrites the manifest
        if resumed:
            self.state.update(
                load_training(folder.checkpoint("latest"), self.wrapped, self.optimizers, self.schedulers)
            )
        if self.rank == 0:
            if not resumed:
                folder.set_aside_checkpoints()  # the last good training's stay until this one succeeds
            folder.checkpoints.mkdir(parents=True, exist_ok=True)
            folder.record("train", state="partial", config=cfg)
            training.keep_log_until(folder.train_log, self.state["step"])
            print(
                f"train: {cfg.method} drafter, {len(self.train_idx)} samples (+{len(self.held_idx)} held out), "
                f"draft vocab {self.dcfg.draft_vocab_size} (covers {self.coverage:.1%} of answer tokens), "
                f"{self.n_trainable / 1e6:.2f} M trainable parameters, {self.total_steps} steps on "
                f"{self.world} process(es)" + (f", resumed at step {self.state['step']}" if resumed else "")
            )

    @contextlib.contextmanager
    def timed(self, phase: str):
        t0 = time.time()
        yield
        self.phase[phase] += time.time() - t0

    def train(self) -> dict:
        """The loop: one optimizer step and its log line per packed batch, the held-out score and the
        checkpoints when due; then the final checkpoint and the stage's record."""
        from tqdm import tqdm

        cfg, state = self.cfg, self.state
        self.bar = tqdm(
            total=self.total_steps, initial=state["step"], desc="train", unit="step", disable=self.rank != 0
        )
        self.phase.update({"steps": 0.0, "held-out": 0.0, "checkpoints": 0.0})
        t_loop, seconds_before = time.time(), state["seconds"]  # state["seconds"] sums the steps (from resume)
        batches = training.step_batches(
            self.source,
            self.tops,
            self.train_idx,
            self.lengths,
            cfg,
            state["step"],
            self.steps_per_epoch,
            self.rank,
            self.world,
            self.device,
        )
        for epoch, micro in batches:
            stats = self.train_step(micro)
            self.log(epoch, stats)
            done = state["step"] == self.total_steps
            score = bool(self.held_rows) and (state["step"] % cfg.eval_every == 0 or done)
            if score:
                with self.timed("held-out"):
                    self.evaluate_held_out()
            with self.timed("checkpoints"):
                if score:
                    self.keep_best()
                if state["step"] % cfg.checkpoint_every == 0 or done:
                    self.checkpoint("latest")
        self.bar.close()
        with self.timed("checkpoints"):
            self.checkpoint("final")
        self.phase["steps"] = state["seconds"] - seconds_before
        # What the loop spent neither stepping, scoring nor saving: waiting for the loader's next batch.
        self.phase["data wait"] = (
            time.time() - t_loop - self.phase["steps"] - self.phase["held-out"] - self.phase["checkpoints"]
        )
        return self.finish()

    def train_step(self, micro: list[dict]) -> torch.Tensor:
        """One optimizer step on this process's packed batches of the step; returns the step's
        statistics [positions, len(STAT_COLUMNS)] (TTT steps or block slots), summed over every process."""
        cfg, device, wrapped = self.cfg, self.device, self.wrapped
        t0 = time.time()
        step_stats = torch.zeros(self.positions, len(STAT_COLUMNS), device=device)
        tokens = 0
        for m, batch in enumerate(micro):
            tokens += int((batch["documents"] != PAD_DOCUMENT).sum())
            batch = training.to_device(batch, device)
            # DDP reduces the gradients once, at the step's last batch.
            sync = m == len(micro) - 1
            with wrapped.no_sync() if (not sync and hasattr(wrapped, "no_sync")) else contextlib.nullcontext():
                with self.autocast:
                    loss, stats = wrapped(batch)
                (loss / len(micro)).backward()
            step_stats += stats
        torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        step_tokens = training.all_sum(torch.tensor(float(tokens), device=device), self.world)
        training.all_sum(step_stats, self.world)
        self.state["step"] += 1
        self.state["tokens"] += int(step_tokens.item())
        self.state["seconds"] += time.time() - t0
        return step_stats

    def log(self, epoch: int, step_stats: torch.Tensor) -> None:
        """The step's line in train_log.jsonl, its tensorboard scalars (every log_every steps) and the
        progress bar."""
        if self.rank != 0:
            return
        cfg, state, writer = self.cfg, self.state, self.writer
        step = state["step"]
        s = summarize(step_stats.cpu())
        weighted = sum(w * x for w, x in zip(self.method.loss_weights(cfg), s["loss"]))
        record = {
            "kind": "train",
            "step": step,
            "epoch": epoch,
            "lr": self.schedulers[0].get_last_lr()[0],
            "weighted_loss": round(weighted, 6),
            **s,
        }
        training.append_record(self.folder.train_log, record)
        if writer and step % cfg.log_every == 0:
            writer.add_scalar("train/loss", weighted, step)
            for i in range(self.positions):
                writer.add_scalar(f"train/loss_{i}", s["loss"][i], step)
                writer.add_scalar(f"train/acc_{i}", s["acc"][i], step)
                writer.add_scalar(f"train/cond_accept_{i}", s["cond_accept"][i], step)
            writer.add_scalar("train/lr", record["lr"], step)
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{weighted:.3f}",
            acc0=f"{s['acc'][0]:.2f}",
            tok_s=f"{state['tokens'] / max(state['seconds'], 1e-9):,.0f}",
        )

    def evaluate_held_out(self) -> None:
        """The held-out samples' loss, acceptance and tau, logged and kept as the checkpoints' metrics."""
        from tqdm import tqdm

        step = self.state["step"]
        # `model` is the unwrapped module under DDP (no gradient hooks needed) and the sharded one under FSDP.
        self.last_eval = training.evaluate(
            self.model, self.source, self.held_rows, self.tops, self.cfg, self.device, self.autocast, self.positions
        )
        if self.rank != 0:
            return
        training.append_record(self.folder.train_log, {"kind": "eval", "step": step, **self.last_eval})
        if self.writer:
            self.writer.add_scalar("heldout/tau", self.last_eval["tau"], step)
            for i, a in enumerate(self.last_eval["cond_accept"]):
                self.writer.add_scalar(f"heldout/cond_accept_{i}", a, step)
        tqdm.write(
            f"step {step}: held-out tau {self.last_eval['tau']:.3f}, conditional "
            f"acceptance {' / '.join(f'{a:.3f}' for a in self.last_eval['cond_accept'])}"
        )

    def keep_best(self) -> None:
        """The `best` checkpoint, when the last held-out tau is the best so far."""
        if self.state["best_tau"] is None or self.last_eval["tau"] > self.state["best_tau"]:
            self.state["best_tau"] = self.last_eval["tau"]
            self.checkpoint("best")

    def checkpoint(self, name: str) -> None:
        """The checkpoint `name` ("latest", "best" or "final") with the last held-out metrics; every
        process takes part."""
        meta = {**self.meta, "step": self.state["step"], "metrics": self.last_eval}
        save_training(
            self.folder.checkpoint(name),
            self.wrapped,
            self.optimizers,
            self.schedulers,
            self.dcfg,
            meta,
            self.state,
            self.rank,
        )

    def finish(self) -> dict:
        """The curves, the wall-time breakdown and the stage's record in the manifest (rank 0)."""
        folder, state, cfg = self.folder, self.state, self.cfg
        if self.writer:
            self.writer.close()
        if self.rank != 0:
            return {}
        if folder.train_log.exists() and folder.train_log.stat().st_size:
            training.plot_curves(folder.train_log, folder.curves, self.method)
        # The export stage reads `best` when held-out data chose one, else the final weights.
        chosen = "best" if (folder.checkpoint("best") / COMPLETE).exists() else "final"
        metrics = {
            "tokens_per_s": round(state["tokens"] / state["seconds"], 1) if state["seconds"] else None,
            "heldout": self.last_eval,
            "best_tau": state["best_tau"],
            "vocab_coverage": round(self.coverage, 4),
        }
        counts = {
            "steps": state["step"],
            "epochs": cfg.epochs,
            "samples": len(self.train_idx),
            "heldout_samples": len(self.held_idx),
            "trainable_params": self.n_trainable,
            "processes": self.world,
        }
        phase = {k: round(v, 1) for k, v in self.phase.items()}
        busy = self.phase["steps"] + self.phase["data wait"]
        metrics["wait_share"] = round(max(0.0, self.phase["data wait"]) / busy, 4) if busy > 0 else None
        if self.cfg.hidden == "served":
            metrics["served"] = self.source.report()
        print(f"train: {time.time() - self.t_start:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in phase.items()))
        metrics["phase_seconds"] = phase
        print(f"next: specdraft export --run {folder.path}")
        entry = folder.record(
            "train",
            state="done",
            config=cfg,
            counts=counts,
            metrics=metrics,
            seconds=time.time() - self.t_start,
            extra={"checkpoint": str(folder.checkpoint(chosen).relative_to(folder.path))},
        )
        folder.drop_previous_checkpoints()
        return entry

    def close(self) -> None:
        """Stop what the source started (a states server)."""
        close = getattr(getattr(self, "source", None), "close", None)
        if close is not None:
            close()


def run(recipe: Recipe, folder: RunFolder, servers: list | None = None) -> dict:
    check_choices(recipe)
    trainer = Trainer(recipe, folder, servers)
    try:
        return trainer.train()
    finally:
        trainer.close()
