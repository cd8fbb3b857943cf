"""gen: the target answers the prompts itself, so the drafter learns what the target really says.

In-process batched `generate` on the target. The answer's token ids are kept beside its text:
re-tokenizing generated text changes the tokens of ~15 % of answers (FACTS.md), and render uses the
ids so training data stays exactly on-policy. Records are appended and flushed batch by batch;
a rerun skips the ids already written and repairs a line torn by an interruption.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..config import Recipe
from ..run import Run
from ..targets import Target
from .sources import DataError, prompts

CONVERSATIONS = "conversations.jsonl"


def _repair_tail(path: Path) -> int:
    """Cut a last line left without its newline by an interrupted append; return bytes removed."""
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
        return len(data) - keep


def finished_ids(path: Path) -> set[str]:
    """Ids already in the conversations file (after repairing a torn last line)."""
    _repair_tail(path)
    ids = set()
    if path.exists():
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    ids.add(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError):
                    raise DataError(f"{path}:{lineno}: not a conversation record") from None
    return ids


def _prompt_messages(conv: dict) -> list[dict]:
    """The conversation up to its first user turn (keeping a leading system message)."""
    out = []
    for m in conv["messages"]:
        out.append(m)
        if m["role"] == "user":
            return out
    raise DataError(f"conversation {conv['id']}: no user turn")


def select_prompts(recipe: Recipe, target: Target, split: str, limit: int) -> tuple[list[dict], int]:
    """The first `limit` prompts of a split that fit `max_prompt_tokens`; also how many were too long."""
    d = recipe.data
    chosen, too_long = [], 0
    for conv in prompts(d.source, split, d.eval_fraction, d.split_seed):
        messages = _prompt_messages(conv)
        ids = target.chat_ids(messages, add_generation_prompt=True)
        if len(ids) > d.max_prompt_tokens:
            too_long += 1
            continue
        chosen.append({"id": conv["id"], "messages": messages, "prompt_ids": ids})
        if len(chosen) >= limit:
            break
    return chosen, too_long


def generate_batch(model, batch_ids: list[list[int]], eos_id: int, pad_id: int, cfg) -> list[tuple[list[int], str]]:
    """Left-padded batched generate; returns (answer ids incl. eos when reached, finish reason) per row."""
    import torch

    width = max(len(ids) for ids in batch_ids)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch_ids])
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch_ids])
    sampling = {"do_sample": False} if cfg.temperature == 0 else {
        "do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p}
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=cfg.max_new_tokens,
                             eos_token_id=eos_id, pad_token_id=pad_id, **sampling)
    results = []
    for row in out[:, width:].tolist():
        if eos_id in row:
            results.append((row[: row.index(eos_id) + 1], "stop"))
        else:
            results.append((row, "length"))
    return results


def run(recipe: Recipe, run: Run) -> dict:
    import torch
    from tqdm import tqdm

    cfg = recipe.gen
    t_start = time.time()
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)
    tok = target.tokenizer
    out_path = run.path / CONVERSATIONS
    done = finished_ids(out_path)
    chosen, too_long = select_prompts(recipe, target, "train", recipe.data.num_train)
    pending = [c for c in chosen if c["id"] not in done]
    # Similar lengths in one batch waste less compute on padding.
    pending.sort(key=lambda c: len(c["prompt_ids"]))
    counts = {"prompts": len(chosen), "skipped_too_long": too_long, "already_done": len(chosen) - len(pending)}
    generated_tokens = 0
    stopped = 0
    gen_seconds = 0.0
    if pending:
        model = target.load_model(cfg.dtype)
        torch.manual_seed(cfg.seed)
        bar = tqdm(total=len(pending), desc="gen", unit="conv")
        with open(out_path, "a", encoding="utf-8") as f:
            for start in range(0, len(pending), cfg.batch_size):
                batch = pending[start:start + cfg.batch_size]
                t0 = time.time()
                answers = generate_batch(model, [c["prompt_ids"] for c in batch], target.eos_token_id,
                                         tok.pad_token_id, cfg)
                gen_seconds += time.time() - t0
                for conv, (ids, finish) in zip(batch, answers):
                    text_ids = ids[:-1] if finish == "stop" else ids
                    record = {
                        "id": conv["id"],
                        "split": "train",
                        "messages": conv["messages"] + [
                            {"role": "assistant", "content": tok.decode(text_ids, skip_special_tokens=True)}],
                        "answer_token_ids": ids,
                        "finish_reason": finish,
                        "prompt_tokens": len(conv["prompt_ids"]),
                        "generator": {"kind": "inprocess", "target": target.describe()["fingerprint"],
                                      "temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens},
                    }
                    f.write(json.dumps(record, ensure_ascii=False) + "\n")
                    generated_tokens += len(ids)
                    stopped += finish == "stop"
                f.flush()
                os.fsync(f.fileno())
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{generated_tokens / max(gen_seconds, 1e-9):.0f}")
        bar.close()
    counts.update({"generated": len(pending), "records": len(finished_ids(out_path)),
                   "generated_tokens": generated_tokens, "finished_with_eos": stopped})
    metrics = {"tokens_per_s": round(generated_tokens / gen_seconds, 1) if gen_seconds else None}
    return run.record("gen", state="done", config=cfg, counts=counts, metrics=metrics,
                      seconds=time.time() - t_start)
