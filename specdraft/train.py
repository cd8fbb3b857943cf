"""train: the EAGLE-3 drafter with training-time test (TTT), from the extracted hidden states.

Alignment (T tokens x_0..x_{T-1}, target aux states h_t, final-norm states z_t): at drafting step i
the drafter at position t reads token x_{t+1+i} and, at step 0, fc(h_t) (later: its own output of
step i-1 at t). It predicts x_{t+2+i}, whose target distribution is softmax(lm_head(z_{t+1+i})),
restricted to the draft vocabulary. The loss counts where x_{t+2+i} is an assistant token and the
target's top token is inside the draft vocabulary (EAGLE-3's rule: elsewhere the drafter cannot be
right). Step i runs at rotary positions t+i, as it does when drafting, and is weighted decay^i.

The trainer sees tensors only (token ids, masks, hidden states) plus the target's embedding and
lm_head weights; it never loads the target model.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .config import Recipe, TrainConfig, to_dict
from .drafter import vocab
from .drafter.model import DrafterConfig, Eagle3Drafter
from .hidden.store import HiddenStore, token_batches
from .run import Run, write_json
from .targets import Target

CHECKPOINTS = "checkpoints"
FINAL = "final"
# Rows of target logits computed at once: the full-vocab logits are only needed for their argmax.
LOGIT_CHUNK = 1024


def collate(store: HiddenStore, batch: list[int], tops: list[torch.Tensor]) -> dict:
    """Right-padded batch tensors: ids/mask/valid/top [B, T], aux [B, T, n_aux*H], last [B, T, H]."""
    items = [store[i] for i in batch]
    T = max(it["input_ids"].numel() for it in items)
    B = len(items)
    aux = torch.zeros(B, T, items[0]["aux"].shape[-1], dtype=items[0]["aux"].dtype)
    last = torch.zeros(B, T, items[0]["last"].shape[-1], dtype=items[0]["last"].dtype)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    valid = torch.zeros(B, T, dtype=torch.bool)
    top = torch.zeros(B, T, dtype=torch.long)
    for r, (i, it) in enumerate(zip(batch, items)):
        n = it["input_ids"].numel()
        aux[r, :n], last[r, :n] = it["aux"], it["last"]
        ids[r, :n] = it["input_ids"].long()
        mask[r, :n] = it["loss_mask"].bool()
        valid[r, :n] = True
        top[r, :n] = tops[i]
    return {"aux": aux, "last": last, "input_ids": ids, "loss_mask": mask, "valid": valid, "top": top}


@torch.no_grad()
def target_top_tokens(store: HiddenStore, head: torch.Tensor) -> list[torch.Tensor]:
    """The target's top token (over its full vocab) at every position of every sample.

    Computed once before training: the full-vocab logits cost ~10x the draft-vocab ones and are only
    needed for this argmax, which does not change from epoch to epoch.
    """
    head = head.to(torch.bfloat16)
    tops = []
    for i in range(len(store)):
        last = store[i]["last"].to(torch.bfloat16)
        tops.append(torch.cat([(rows @ head.T).argmax(-1) for rows in last.split(LOGIT_CHUNK)]))
    return tops


@torch.no_grad()
def target_distribution(last: torch.Tensor, draft_head: torch.Tensor) -> torch.Tensor:
    """The target's next-token distribution restricted to the draft vocab [B, T, Vd], from its
    final-norm states [B, T, H] and the draft vocab's rows of its lm_head [Vd, H]."""
    return torch.softmax(last.float() @ draft_head.T, dim=-1)


def shift_left(x: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """x[:, n:n+length], zero-padded on the right where the sequence runs out."""
    out = x[:, n:n + length]
    if out.shape[1] < length:
        pad = torch.zeros((x.shape[0], length - out.shape[1], *x.shape[2:]), dtype=x.dtype, device=x.device)
        out = torch.cat([out, pad], dim=1)
    return out


def unroll(drafter: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor, steps: int):
    """Training-time test: yield each step's logits [B, T-1, Vd] over drafter positions t = 0..T-2.

    Step i reads token x_{t+1+i} at rotary position t+i; its hidden input is fc(aux) at step 0 and the
    previous step's output after that; its queries see the step-0 keys at positions <= t and the keys
    of steps 1..i at t, exactly what drafting at inference sees (tests/test_drafter.py checks it).
    """
    B, T = ids.shape
    n = T - 1  # each drafter position needs the next token as its input
    hidden = drafter.project(aux[:, :n])  # [B, n, H]
    base, diag = None, None
    for i in range(steps):
        tokens = shift_left(ids, 1 + i, n)  # x_{t+1+i}
        positions = torch.arange(n, device=ids.device)[None, :].expand(B, n) + i
        logits, hidden, kv = drafter(hidden, tokens, positions, base=base, diag=diag)
        if i == 0:
            base, diag = kv, []
        else:
            diag = diag + [kv]
        yield logits


def ttt_loss(drafter: Eagle3Drafter, batch: dict, probs: torch.Tensor, inside: torch.Tensor,
             cfg: TrainConfig) -> tuple[torch.Tensor, list[dict]]:
    """The weighted TTT loss over `cfg.ttt_steps` unrolled steps, and per-step loss/accuracy."""
    ids, mask = batch["input_ids"], batch["loss_mask"]
    n = ids.shape[1] - 1
    total = torch.zeros((), device=ids.device)
    stats = []
    for i, logits in enumerate(unroll(drafter, batch["aux"].float(), ids, cfg.ttt_steps)):
        target = shift_left(probs, 1 + i, n)  # [B, n, Vd]: distribution of x_{t+2+i}
        where = shift_left(mask, 2 + i, n) & shift_left(inside, 1 + i, n)  # [B, n]
        count = where.sum()
        logp = F.log_softmax(logits.float(), dim=-1)
        per_pos = -(target * logp).sum(-1)  # [B, n]
        loss = (per_pos * where).sum() / count.clamp(min=1)
        total = total + cfg.step_weight_decay ** i * loss
        correct = ((logits.argmax(-1) == target.argmax(-1)) & where).sum()
        stats.append({"loss": loss.item(), "correct": correct.item(), "count": count.item()})
    return total, stats


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to zero."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def save_checkpoint(drafter: Eagle3Drafter, path: Path, meta: dict) -> None:
    """A checkpoint folder, written whole under a temporary name then renamed (a folder that exists
    is complete). The embedding is left out: it is the target's, read from there on load."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    save_file(state, str(tmp / "model.safetensors"))
    write_json(tmp / "config.json", {"drafter": drafter.config.to_dict(), **meta})
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)


def load_checkpoint(path: Path, embed: torch.Tensor | None = None) -> tuple[Eagle3Drafter, dict]:
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / "config.json").read_text())
    drafter = Eagle3Drafter(DrafterConfig(**meta["drafter"]))
    state = load_file(str(path / "model.safetensors"))
    if "embed_tokens.weight" not in state:
        if embed is None:
            raise ValueError(f"{path}: checkpoint has no embedding; pass the target's")
        state["embed_tokens.weight"] = embed
    drafter.load_state_dict(state)
    return drafter.eval(), meta


def load_trained(recipe: Recipe, run: Run) -> tuple[Eagle3Drafter, Target, torch.Tensor]:
    """The run's trained drafter, the target it was trained for (with the checkpoint's aux layers),
    and the target's embedding (which the drafter shares)."""
    entry = run.require("train")
    ckpt = run.path / entry.get("checkpoint", str(Path(CHECKPOINTS) / FINAL))
    meta = json.loads((ckpt / "config.json").read_text())
    target = Target(recipe.target.model, meta["aux_layer_ids"])
    embed = target.embed_weight()
    drafter, _ = load_checkpoint(ckpt, embed)
    return drafter, target, embed


def run(recipe: Recipe, run: Run) -> dict:
    from tqdm import tqdm

    cfg = recipe.train
    t_start = time.time()
    run.require("extract")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    store = HiddenStore(run.path)
    target = Target(recipe.target.model, store.aux_layer_ids)
    samples = [store.tokens(i) for i in range(len(store))]
    counts = vocab.token_counts(samples, target.vocab_size)
    d2t, t2d = vocab.build(counts, cfg.draft_vocab_size)
    coverage = vocab.coverage(counts, t2d)
    drafter = Eagle3Drafter(DrafterConfig.from_target(target, cfg.draft_vocab_size))
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    drafter.embed_tokens.weight.data.copy_(target.embed_weight().float())
    head = target.head_weight()
    draft_head = head[t2d].float()  # [Vd, H]: the draft vocab's rows of the target's lm_head
    tops = target_top_tokens(store, head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params)
    print(f"train: {len(store)} samples, draft vocab {drafter.config.draft_vocab_size} "
          f"(covers {coverage:.1%} of answer tokens), {n_trainable / 1e6:.2f} M trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    lengths = [len(ids) for ids, _ in samples]
    order = sorted(range(len(store)), key=lambda i: lengths[i])
    batches = token_batches(order, lengths, cfg.batch_tokens)
    total_steps = cfg.epochs * len(batches)
    autocast = torch.autocast("cpu" if not torch.cuda.is_available() else "cuda", dtype=torch.bfloat16,
                              enabled=cfg.autocast_dtype == "bfloat16")
    log_path = run.path / CHECKPOINTS / "train_log.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("")
    step, tokens_seen, train_seconds = 0, 0, 0.0
    epoch_stats = []
    bar = tqdm(total=total_steps, desc="train", unit="step")
    for epoch in range(cfg.epochs):
        rng.shuffle(batches)
        sums = [[0.0, 0, 0] for _ in range(cfg.ttt_steps)]  # loss*count, correct, count
        for batch_ids in batches:
            t0 = time.time()
            batch = collate(store, batch_ids, tops)
            probs = target_distribution(batch["last"], draft_head)
            inside = t2d[batch["top"]]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total_steps, cfg)
            with autocast:
                loss, stats = ttt_loss(drafter, batch, probs, inside, cfg)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            train_seconds += time.time() - t0
            tokens_seen += int(batch["valid"].sum())
            for s, st in zip(sums, stats):
                s[0] += st["loss"] * st["count"]
                s[1] += st["correct"]
                s[2] += st["count"]
            if step % cfg.log_every == 0:
                with open(log_path, "a") as f:
                    f.write(json.dumps({"step": step, "epoch": epoch, "loss": loss.item(),
                                        "acc": [st["correct"] / max(1, st["count"]) for st in stats]}) + "\n")
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{stats[0]['correct'] / max(1, stats[0]['count']):.2f}")
        acc = [round(s[1] / max(1, s[2]), 4) for s in sums]
        epoch_stats.append({"epoch": epoch, "loss": [round(s[0] / max(1, s[2]), 4) for s in sums], "acc": acc})
        tqdm.write(f"epoch {epoch}: step accuracy {' / '.join(f'{a:.3f}' for a in acc)}")
    bar.close()
    meta = {"train": to_dict(cfg), "aux_layer_ids": store.aux_layer_ids, "target": target.describe(),
            "vocab_coverage": round(coverage, 4), "epochs": epoch_stats, "steps": step}
    save_checkpoint(drafter, run.path / CHECKPOINTS / FINAL, meta)
    metrics = {"tokens_per_s": round(tokens_seen / train_seconds, 1) if train_seconds else None,
               "final_step_accuracy": epoch_stats[-1]["acc"] if epoch_stats else None,
               "vocab_coverage": round(coverage, 4)}
    counts_out = {"steps": step, "epochs": cfg.epochs, "samples": len(store), "trainable_params": n_trainable}
    return run.record("train", state="done", config=cfg, counts=counts_out, metrics=metrics,
                      seconds=time.time() - t_start, extra={"checkpoint": str(Path(CHECKPOINTS) / FINAL)})
