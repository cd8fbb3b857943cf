"""gen: the target answers the prompts itself, so the drafter learns what the target really says.

Two ways to ask it, one record format:
- servers (`gen.endpoints`): any OpenAI-compatible chat server (vLLM, SGLang, llama.cpp), asked
  asynchronously through `client.ServerPool`; multi-turn conversations are replayed turn by turn, each
  answer given the target's own earlier answers; `self_instruct` lets the target write the prompts too.
- in-process: batched `generate` with transformers, for small targets and tests.
With `gen.answers = "source"` nobody is asked: the same prompts keep the data source's own first answer
(the ablation against regenerated answers); those records carry no `token_ids`, so render tokenizes the
text through the target's template.

Record (one JSON line per finished conversation; render reads it):
    {"id", "split", "messages": [..., {"role": "assistant", "content", "reasoning", "reasoning_source",
     "token_ids"}], "finish_reason", "prompt_tokens", "generator": {"kind", ...}}
`token_ids` are the ids the target produced for that turn (reasoning included, eos included when it
stopped; absent when a server gave none): re-tokenizing generated text changes the tokens of ~15 % of
answers (docs/engine-facts.md), and render trains on these ids. Lines are appended and flushed one by one (in-process,
after every `generate` call, fsynced); a rerun skips the ids already written and drops a line torn by
`kill -9`. Failures go to gen_errors.jsonl. A server that refuses the key (401/403; gen.api_key_env names
the environment variable it is read from) stops the run at once.

A conversation's tool definitions (`tools`) size its prompts and travel in its record (docs/data.md). A
pre-rendered source (input_ids + loss_mask rows) has nothing to generate: gen says so in one line and
records itself done with no conversations; render takes the rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from collections import Counter, deque
from pathlib import Path

from specdraft.config import ConfigError, GenConfig, Recipe, field_choices
from specdraft.data.client import Auth, RequestFailed, ServerPool, ServerRefused
from specdraft.data.prompts import select_prompts
from specdraft.data.sources import DataError, prompts, source_is_rendered
from specdraft.files import FileError, read_jsonl
from specdraft.run import RunFolder, atomic_path
from specdraft.targets import Target, resolve_device, resolve_dtype

REASONING_FIELDS = ("reasoning", "reasoning_content")  # vLLM >= 0.10 says `reasoning`; older vLLM, SGLang the other
# Magpie samples the user turn: greedy decoding would write the same prompt every time.
SELF_INSTRUCT_TEMPERATURE = 1.0
# A self-instruct run gives up when this many user turns per wanted sample came back unusable (duplicate,
# empty or cut off): the target keeps writing the same few prompts.
SELF_INSTRUCT_ATTEMPTS_PER_SAMPLE = 4
# The ids of conversations whose user turn the target wrote (magpie_id).
MAGPIE_PREFIX = "magpie-"
# gen.answers: ask the target, or keep the source's own answers.
ANSWERS = field_choices(GenConfig, "answers")
# Stands in for the user's text while finding where the template's user-turn prefix ends.
_USER_SENTINEL = "\u2063SPECDRAFT-USER\u2063"


class GenStopped(RuntimeError):
    """The run stopped itself: too many failures, or answers without the reasoning they should have."""


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


def _records(path: Path):
    """The records already in the conversations file (after repairing a torn last line)."""
    _repair_tail(path)
    if not path.exists():
        return
    fix = "remove the line (gen answers its prompt again) or start over in a new run folder"
    try:
        for lineno, record in read_jsonl(path, fix=fix, kind=None):
            if not isinstance(record, dict) or "id" not in record:
                raise DataError(f"{path}:{lineno}: not a conversation record; {fix}")
            yield record
    except FileError as e:
        raise DataError(str(e)) from None


def finished_ids(path: Path) -> set[str]:
    """Ids already in the conversations file."""
    return {r["id"] for r in _records(path)}


def answers_on_disk(path: Path) -> set[str]:
    """Whose answers ("target" / "source") the records already in the conversations file hold."""
    return {"source" if (r.get("generator") or {}).get("kind") == "source" else "target" for r in _records(path)}


def num_samples(recipe: Recipe) -> int | None:
    """Conversations to save: gen.num_samples, else data.num_train; None (both 0) means every usable one."""
    return recipe.gen.num_samples or recipe.data.num_train or None


def split_reasoning(message: dict, markers: tuple[str, str] | None) -> tuple[str, str, str]:
    """(answer, reasoning, where the reasoning was) from a chat response message, whatever the server calls it.

    A client that read only `reasoning_content` while vLLM filled `reasoning` saved 388 answers without
    their reasoning (docs/engine-facts.md); both fields are read, then `<think>…</think>` left inline in the content.
    An answer that starts inside the reasoning (the template opened the marker in the generation prompt)
    has only the end marker.
    """
    content = message.get("content") or ""
    for name in REASONING_FIELDS:
        if message.get(name):
            return content, message[name], name
    if markers:
        start, end = markers
        head, sep, tail = content.partition(end)
        if sep:
            before, opened, reasoning = head.partition(start)
            if opened and before.strip():
                return content, "", "none"  # a marker quoted mid-answer, not a reasoning span
            return tail.lstrip("\n"), (reasoning if opened else head).strip("\n"), "inline"
    return content, "", "none"


def expects_reasoning(cfg, markers: tuple[str, str] | None) -> bool:
    value = cfg.expect_reasoning.lower()
    if value in ("true", "yes", "on", "1"):
        return True
    if value in ("false", "no", "off", "0"):
        return False
    if value != "auto":
        raise ConfigError(f"gen.expect_reasoning: expected auto / true / false, got {cfg.expect_reasoning!r}")
    return markers is not None and cfg.chat_template_kwargs.get("enable_thinking", True) is not False


def magpie_id(text: str) -> str:
    """A self-instruct conversation's id: its user turn's text, case and spacing aside, so a prompt the
    target writes twice is one conversation."""
    return MAGPIE_PREFIX + hashlib.sha256(" ".join(text.lower().split()).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# in-process


def generate_batch(model, batch_ids: list[list[int]], eos_id: int, pad_id: int, cfg) -> list[tuple[list[int], str]]:
    """Left-padded batched generate; returns (answer ids incl. eos when reached, finish reason) per row."""
    import torch

    width = max(len(ids) for ids in batch_ids)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch_ids])
    attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch_ids])
    sampling = (
        {"do_sample": False}
        if cfg.temperature == 0
        else {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p}
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention.to(model.device),
            max_new_tokens=cfg.max_new_tokens,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            **sampling,
        )
    results = []
    for row in out[:, width:].tolist():
        if eos_id in row:
            results.append((row[: row.index(eos_id) + 1], "stop"))
        else:
            results.append((row, "length"))
    return results


def _assistant_message(target: Target, ids: list[int], finish: str) -> dict:
    """The assistant message of an in-process answer, split like a server's would be."""
    tok = target.tokenizer
    text_ids = ids[:-1] if finish == "stop" else ids
    markers = target.thinking_markers
    # Thinking markers are often special tokens: keep them in the text only to find the reasoning span.
    raw = tok.decode(text_ids, skip_special_tokens=markers is None)
    content, reasoning, source = split_reasoning({"content": raw}, markers)
    if markers is not None:
        for special in tok.all_special_tokens:
            content = content.replace(special, "")
    return {
        "role": "assistant",
        "content": content,
        "reasoning": reasoning,
        "reasoning_source": source,
        "token_ids": ids,
    }


def generate_rows(
    model, rows: list[list[int]], eos_id: int, pad_id: int, cfg, stats: Counter, on_call=None
) -> list[tuple[list[int], str]]:
    """Every prompt answered, in the order given: sorted by length and cut into `generate` calls of at most
    cfg.batch_size rows and cfg.batch_tokens rows x (longest prompt + max_new_tokens); a call that runs out
    of GPU memory is halved and retried (stats["oom_splits"]), down to one row. After each call,
    `on_call(indices, answers)` sees the rows it answered (indices into `rows`), so they can be saved."""
    import torch

    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    results: list = [None] * len(rows)
    pending: list[list[int]] = []
    start = 0
    while start < len(order):
        n = 1
        while (
            start + n < len(order)
            and n < cfg.batch_size
            and (
                not cfg.batch_tokens or (n + 1) * (len(rows[order[start + n]]) + cfg.max_new_tokens) <= cfg.batch_tokens
            )
        ):
            n += 1
        pending.append(order[start : start + n])
        start += n
    while pending:
        call = pending.pop(0)
        try:
            answers = generate_batch(model, [rows[i] for i in call], eos_id, pad_id, cfg)
        except torch.OutOfMemoryError:
            if len(call) == 1:
                raise
            torch.cuda.empty_cache()
            stats["oom_splits"] += 1
            half = len(call) // 2
            pending[:0] = [call[:half], call[half:]]
            continue
        stats["generate_calls"] += 1
        for i, answer in zip(call, answers):
            results[i] = answer
        if on_call is not None:
            on_call(call, answers)
    return results


def answer_turns(
    model,
    target: Target,
    convs: list[dict],
    cfg,
    max_length: int,
    bar=None,
    after_call=None,
    stats: Counter | None = None,
) -> Counter:
    """Answer each conversation's user turns in order, batched across conversations: the next turn of
    every conversation that still has one is answered together (generate_rows), its prompt the target's
    template over the conversation so far (its own earlier answers as text, as a server would be sent
    them). A conversation ends at `cfg.max_turns` (0: all), at its last user turn, or when the next prompt
    plus an answer would pass `max_length` (render's cut: tokens beyond it never reach training).

    Appends each answer to conv["messages"]; a conversation resumes from conv["turn"] (user turns answered
    so far) and conv["turn_prompt_ids"] when it has them. After each `generate` call, `after_call(finished,
    moved_on)` sees the conversations that call ended and those it moved on to their next turn, so a caller
    can save each as soon as its answer exists. Returns `stats` (a new Counter when none is given) with
    generated_tokens, answers, generate_seconds, generate_calls and oom_splits added."""
    stats = Counter() if stats is None else stats
    for c in convs:
        c.setdefault("turn", 0)
        c.setdefault("turn_prompt_ids", c["prompt_ids"])
        c.setdefault("finish_reason", None)
    active = list(convs)
    while active:
        still: list[dict] = []
        clock = [time.time()]  # generate's own time, without the saving in between

        def settle(call: list[int], answers: list, active=active, still=still, clock=clock) -> None:
            stats["generate_seconds"] += time.time() - clock[0]
            finished, moved = [], []
            for i, (ids, finish) in zip(call, answers):
                c = active[i]
                c["messages"].append(_assistant_message(target, ids, finish))
                c["finish_reason"] = finish
                stats["generated_tokens"] += len(ids)
                stats["answers"] += 1
                turn = c["turn"]
                c["turn"] = turn + 1
                if turn < len(c["later_users"]) and (not cfg.max_turns or turn + 1 < cfg.max_turns):
                    nxt = c["messages"] + [{"role": "user", "content": c["later_users"][turn]}]
                    ids_next = target.chat_ids(
                        [_as_history(m) for m in nxt], add_generation_prompt=True, tools=c.get("tools")
                    )
                    if len(ids_next) + cfg.max_new_tokens <= max_length:
                        c["messages"], c["turn_prompt_ids"] = nxt, ids_next
                        moved.append(c)
                        continue
                finished.append(c)
            still.extend(moved)
            if after_call is not None:
                after_call(finished, moved)
            if bar is not None:
                bar.update(len(finished))
            clock[0] = time.time()

        generate_rows(
            model,
            [c["turn_prompt_ids"] for c in active],
            target.eos_token_id,
            target.tokenizer.pad_token_id,
            cfg,
            stats,
            on_call=settle,
        )
        active = still
    return stats


def _tools_of(conv: dict) -> dict:
    """The record's "tools" entry: the conversation's tool definitions, when it has some."""
    return {"tools": conv["tools"]} if conv.get("tools") else {}


def _as_history(message: dict) -> dict:
    """A message as the template is given it: an earlier answer's text, not its ids or bookkeeping."""
    return {k: v for k, v in message.items() if k in ("role", "content")}


def write_user_turns(
    model, target: Target, cfg, rows: int, system: list[dict], max_prompt_tokens: int, claimed: set[str], stats: Counter
) -> list[dict]:
    """Magpie in-process: `rows` user turns sampled from the target's own user-turn prefix (at
    SELF_INSTRUCT_TEMPERATURE, up to max_new_tokens each), as first-turn conversations for answer_turns.
    Kept: whole turns (ended by the end-of-turn token), not empty, new (their magpie_id not in `claimed`,
    which grows) and within max_prompt_tokens; the rest are counted in stats (unusable, duplicate,
    too_long)."""
    import dataclasses

    prefix = user_turn_prefix(target, cfg.system_prompt)
    sampled = generate_rows(
        model,
        [prefix] * rows,
        target.eos_token_id,
        target.tokenizer.pad_token_id,
        dataclasses.replace(cfg, temperature=SELF_INSTRUCT_TEMPERATURE),
        stats,
    )
    convs = []
    for ids, finish in sampled:
        text = target.tokenizer.decode(ids[:-1], skip_special_tokens=True).strip() if finish == "stop" else ""
        if not text:
            stats["unusable"] += 1
            continue
        conv_id = magpie_id(text)
        if conv_id in claimed:
            stats["duplicate"] += 1
            continue
        messages = system + [{"role": "user", "content": text}]
        prompt_ids = target.chat_ids(messages, add_generation_prompt=True)
        if len(prompt_ids) > max_prompt_tokens:
            stats["too_long"] += 1
            continue
        claimed.add(conv_id)
        convs.append({"id": conv_id, "messages": messages, "prompt_ids": prompt_ids, "later_users": []})
    return convs


# Conversations an in-process run has answered at least once but not finished, each line one as it stood
# after an answer (the last line of an id is how it stands): gen_in_flight.jsonl.
_IN_FLIGHT_FIELDS = ("id", "messages", "prompt_ids", "later_users", "turn", "turn_prompt_ids", "finish_reason", "tools")


def _in_flight(path: Path, done: set[str]) -> list[dict]:
    """The conversations a cut in-process run left unfinished, each as the last line it has in the in-flight
    log stands (those since saved in `done` dropped); the log is rewritten to hold just these."""
    if not path.exists():
        return []
    latest: dict[str, dict] = {}
    for state in _records(path):
        if state["id"] not in done:
            latest[state["id"]] = state
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in latest.values()), encoding="utf-8")
    return list(latest.values())


def run_inprocess(recipe: Recipe, folder: RunFolder) -> dict:
    import torch
    from tqdm import tqdm

    cfg = recipe.gen
    t_start = time.time()
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)
    target.check_fits(recipe)
    done = finished_ids(folder.conversations)
    # A cut run's unfinished conversations go on from the turn they reached.
    flight_path = folder.gen_in_flight
    resumed = _in_flight(flight_path, done)
    claimed = done | {c["id"] for c in resumed}
    fresh, wanted, counts = _inprocess_prompts(recipe, target, done, resumed)
    pending = resumed + fresh
    stats: Counter = Counter()
    device = resolve_device(cfg.device, "gen.device")
    dtype = resolve_dtype(cfg.dtype, device)
    generator = {
        "kind": "inprocess",
        "target": target.describe()["fingerprint"],
        "sampling": _inprocess_sampling(cfg, dtype),
    }
    if pending or wanted:
        model = target.load_model(dtype, device)
        torch.manual_seed(cfg.seed)
        bar = tqdm(total=len(pending) + wanted, desc="gen", unit="conv")
        group = cfg.group_size or max(1, len(pending))
        with (
            open(folder.conversations, "a", encoding="utf-8") as out,
            open(flight_path, "a", encoding="utf-8") as flight,
        ):
            save = _CallSaver(out, flight, generator, target.eos_token_id, bar, stats)
            for start in range(0, len(pending), group):
                answer_turns(
                    model, target, pending[start : start + group], cfg, recipe.render.max_length, bar, save, stats
                )
            wanted = _self_instruct_inprocess(model, target, recipe, wanted, claimed, pending, save)
        bar.close()
    flight_path.unlink(missing_ok=True)
    return _record_inprocess(recipe, folder, counts, stats, len(pending), wanted, t_start)


def _inprocess_prompts(
    recipe: Recipe, target: Target, done: set[str], resumed: list[dict]
) -> tuple[list[dict], int, dict]:
    """(the source's prompts still to answer, self-instruct conversations still wanted, the manifest's
    counts so far) of an in-process run that has `done` saved and `resumed` in flight."""
    cfg = recipe.gen
    resumed_ids = {c["id"] for c in resumed}
    if cfg.self_instruct:  # the target writes every prompt, round by round
        wanted = max(0, num_samples(recipe) - len(done) - len(resumed))
        return [], wanted, {"already_done": len(done), "resumed_in_flight": len(resumed)}
    chosen, too_long = select_prompts(recipe, target, "train", num_samples(recipe))
    fresh = [c for c in chosen if c["id"] not in done and c["id"] not in resumed_ids]
    # Similar lengths in one group keep its turns' prompts alike too.
    fresh.sort(key=lambda c: len(c["prompt_ids"]))
    counts = {
        "prompts": len(chosen),
        "skipped_too_long": too_long,
        "already_done": sum(c["id"] in done for c in chosen),
        "resumed_in_flight": len(resumed),
    }
    # gen.self_instruct_samples: written and answered once the source's prompts are.
    wanted = max(0, cfg.self_instruct_samples - sum(i.startswith(MAGPIE_PREFIX) for i in done | resumed_ids))
    return fresh, wanted, counts


def _inprocess_sampling(cfg, dtype: str) -> dict:
    """How in-process answers are generated (stored in the manifest and each record)."""
    sampling = {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
        "dtype": dtype,
        "max_turns": cfg.max_turns,
    }
    if cfg.self_instruct or cfg.self_instruct_samples:
        sampling["user_turn_temperature"] = SELF_INSTRUCT_TEMPERATURE
    return sampling


class _CallSaver:
    """answer_turns' `after_call` for a gen run, after every `generate` call: appends the conversations it
    ended to `out` (the conversations file), then the ones it moved on to their next turn, as they now
    stand, to `flight` (the in-flight log), each flushed and fsynced. A kill loses at most the call in
    flight, and a saved conversation is always whole. Counts the saved turns (stats["turns"]) and those
    that ended with the end-of-sequence token (stats["finished_with_eos"])."""

    def __init__(self, out, flight, generator: dict, eos_id: int, bar, stats: Counter):
        self.out, self.flight, self.generator = out, flight, generator
        self.eos_id, self.bar, self.stats = eos_id, bar, stats

    def __call__(self, finished: list[dict], moved: list[dict]) -> None:
        for conv in finished:
            answers = [m for m in conv["messages"] if m["role"] == "assistant"]
            record = {
                "id": conv["id"],
                "split": "train",
                "messages": conv["messages"],
                "finish_reason": conv["finish_reason"],
                "prompt_tokens": len(conv["prompt_ids"]),
                "generator": self.generator,
                **_tools_of(conv),
            }
            self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.stats["turns"] += len(answers)
            self.stats["finished_with_eos"] += sum(m["token_ids"][-1:] == [self.eos_id] for m in answers)
        if finished:
            self.out.flush()
            os.fsync(self.out.fileno())
        if moved:
            self.flight.write(
                "".join(json.dumps({k: c.get(k) for k in _IN_FLIGHT_FIELDS}, ensure_ascii=False) + "\n" for c in moved)
            )
            self.flight.flush()
            os.fsync(self.flight.fileno())
        stats = self.stats
        self.bar.set_postfix(
            tok_s=f"{stats['generated_tokens'] / max(stats['generate_seconds'], 1e-9):.0f}", answers=stats["answers"]
        )


def _self_instruct_inprocess(
    model, target: Target, recipe: Recipe, wanted: int, claimed: set[str], pending: list[dict], save: _CallSaver
) -> int:
    """Self-instruct in-process: write user turns and answer the new ones (appended to `pending`) until
    `wanted` are saved or the attempts (SELF_INSTRUCT_ATTEMPTS_PER_SAMPLE per wanted conversation) run
    out; returns how many are still wanted."""
    import torch

    cfg, stats = recipe.gen, save.stats
    attempts = wanted * SELF_INSTRUCT_ATTEMPTS_PER_SAMPLE
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    while wanted and attempts:
        # twice the rows still wanted: some come back cut off or written before
        rows = min(attempts, cfg.batch_size, 2 * wanted)
        attempts -= rows
        stats["user_turns_written"] += rows
        # a seed of its own per round and per resumed run, so no round repeats an earlier one
        torch.manual_seed(cfg.seed + len(claimed) + attempts)
        convs = write_user_turns(model, target, cfg, rows, system, recipe.data.max_prompt_tokens, claimed, stats)[
            :wanted
        ]
        answer_turns(model, target, convs, cfg, recipe.render.max_length, save.bar, save, stats)
        wanted -= len(convs)
        pending.extend(convs)
    return wanted


def _record_inprocess(
    recipe: Recipe, folder: RunFolder, counts: dict, stats: Counter, generated: int, wanted: int, t_start: float
) -> dict:
    """The manifest's gen entry; a self-instruct run that ran out of attempts with conversations still
    `wanted` is recorded failed and stops, as the server path does."""
    cfg = recipe.gen
    if cfg.self_instruct or cfg.self_instruct_samples:
        counts.update({k: stats[k] for k in ("user_turns_written", "unusable", "duplicate", "too_long")})
    counts.update(
        {
            "generated": generated,
            "turns": stats["turns"],
            "records": len(finished_ids(folder.conversations)),
            "generated_tokens": stats["generated_tokens"],
            "finished_with_eos": stats["finished_with_eos"],
            "generate_calls": stats["generate_calls"],
            "oom_splits": stats["oom_splits"],
        }
    )
    gen_seconds = stats["generate_seconds"]
    metrics = {"tokens_per_s": round(stats["generated_tokens"] / gen_seconds, 1) if gen_seconds else None}
    if wanted:
        stop = (
            f"self-instruct gave up: {stats['unusable']} unusable, {stats['duplicate']} duplicate and "
            f"{stats['too_long']} too long user turns, {wanted} conversations still wanted"
        )
        folder.record(
            "gen",
            state="failed",
            config=cfg,
            counts=counts,
            metrics=metrics,
            seconds=time.time() - t_start,
            extra={"stopped": stop},
        )
        raise GenStopped(f"gen stopped: {stop} ({counts['records']} saved in {folder.conversations})")
    return folder.record("gen", state="done", config=cfg, counts=counts, metrics=metrics, seconds=time.time() - t_start)


# ---------------------------------------------------------------------------------------------------------
# the source's own answers


def run_source(recipe: Recipe, folder: RunFolder) -> dict:
    """The prompts in-process gen would ask, each with the source's own first answer; no model loaded.

    Records go out in selection order, each flushed as written; a rerun skips the ids on disk, like
    in-process gen. Prompts whose source has no answer right after them are skipped and counted.
    """
    from tqdm import tqdm

    cfg, d = recipe.gen, recipe.data
    t_start = time.time()
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)  # the tokenizer, for max_prompt_tokens
    out_path = folder.conversations
    done = finished_ids(out_path)
    chosen, too_long = select_prompts(recipe, target, "train", num_samples(recipe))
    answered = [c for c in chosen if c["source_answer"] is not None]
    pending = [c for c in answered if c["id"] not in done]
    with open(out_path, "a", encoding="utf-8") as f:
        for conv in tqdm(pending, desc="gen (source answers)", unit="conv"):
            record = {
                "id": conv["id"],
                "split": "train",
                "messages": conv["messages"] + conv["source_answer"],
                "finish_reason": None,  # nobody generated it: no stop or length to report
                "prompt_tokens": len(conv["prompt_ids"]),
                "generator": {"kind": "source", "source": d.source},
                **_tools_of(conv),
            }
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
        os.fsync(f.fileno())
    counts = {
        "prompts": len(chosen),
        "skipped_too_long": too_long,
        "skipped_no_answer": len(chosen) - len(answered),
        "already_done": len(answered) - len(pending),
        "written": len(pending),
        "records": len(finished_ids(out_path)),
    }
    print(
        f"gen: {counts['records']} conversations with the source's own answers in {out_path} "
        f"({counts['skipped_no_answer']} prompts without one skipped)\nnext: specdraft render --run {folder.path}"
    )
    return folder.record("gen", state="done", config=cfg, counts=counts, seconds=time.time() - t_start)


# ---------------------------------------------------------------------------------------------------------
# servers


def user_turn_prefix(target: Target, system_prompt: str) -> list[int]:
    """The token ids the target's own template puts before a user's words (Magpie's prompt)."""
    tok = target.tokenizer
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": _USER_SENTINEL}
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    return tok.encode(text[: text.index(_USER_SENTINEL)], add_special_tokens=False)


def _conversation_prompts(recipe: Recipe, target: Target, counts: Counter):
    """Source conversations as (id, leading system messages, user turns), first turn within max_prompt_tokens."""
    d, cfg = recipe.data, recipe.gen
    for conv in prompts(d.source, "train", d.eval_fraction, d.split_seed, data=d):
        if conv.get("tools"):
            raise DataError(
                f"data source {d.source!r}: conversation {conv['id']} has tools, which gen does not "
                f"send to servers yet: answer it in-process (no gen.endpoints) or keep the source's "
                f"answers (gen.answers = \"source\")"
            )
        system = [{"role": "system", "content": m["content"]} for m in conv["messages"][:1] if m["role"] == "system"]
        if not system and cfg.system_prompt:
            system = [{"role": "system", "content": cfg.system_prompt}]
        users = [m["content"] for m in conv["messages"] if m["role"] == "user"]
        if cfg.max_turns:
            users = users[: cfg.max_turns]
        first = system + [{"role": "user", "content": users[0]}]
        if len(target.chat_ids(first, add_generation_prompt=True)) > d.max_prompt_tokens:
            counts["skipped_too_long"] += 1
            continue
        yield {"id": conv["id"], "system": system, "users": users}


class ServerGen:
    """One server-side gen run: ask, replay, check, save; stop early when the answers cannot be right."""

    def __init__(self, recipe: Recipe, folder: RunFolder, target: Target):
        self.recipe, self.cfg, self.target = recipe, recipe.gen, target
        self.out_path = folder.conversations
        self.err_path = folder.gen_errors
        self.markers = target.thinking_markers
        self.expect_reasoning = expects_reasoning(self.cfg, self.markers)
        self.counts: Counter[str] = Counter()
        self.recent_failed: deque[bool] = deque(maxlen=self.cfg.error_window)
        self.recent_empty: deque[bool] = deque(maxlen=self.cfg.empty_reasoning_window)
        self.tokens = 0
        self.model = self.cfg.model
        # Read from the environment now; the recipe and the manifest hold only the variable's name.
        self.auth = Auth.from_env(self.cfg.api_key_env, self.cfg.headers)

    def sampling(self) -> dict:
        """What every chat request asks for besides the messages (stored in the manifest and each record)."""
        c = self.cfg
        body = {"max_tokens": c.max_new_tokens, "temperature": c.temperature, "top_p": c.top_p, "seed": c.seed}
        if c.chat_template_kwargs:
            body["chat_template_kwargs"] = c.chat_template_kwargs
        if c.reasoning_effort:
            body["reasoning_effort"] = c.reasoning_effort
        if c.return_token_ids:
            body["return_token_ids"] = True
        return body

    async def _chat(self, pool: ServerPool, messages: list[dict]) -> tuple[dict, str | None, int | None, str]:
        """One answer: (assistant message, finish reason, prompt tokens, endpoint)."""
        wire = [{"role": m["role"], "content": m["content"]} for m in messages]
        body, endpoint = await pool.post(
            "/v1/chat/completions", {"model": self.model, "messages": wire, **self.sampling()}
        )
        try:
            choice = body["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise RequestFailed(f"malformed chat response: {json.dumps(body)[:300]}", endpoint=endpoint) from None
        content, reasoning, source = split_reasoning(message, self.markers)
        out = {"role": "assistant", "content": content, "reasoning": reasoning, "reasoning_source": source}
        if choice.get("token_ids"):
            out["token_ids"] = choice["token_ids"]
        usage = body.get("usage") or {}
        self.tokens += usage.get("completion_tokens") or len(out.get("token_ids", []))
        return out, choice.get("finish_reason"), usage.get("prompt_tokens"), endpoint

    async def _self_instruct_prompt(self, pool: ServerPool, attempt: int, prefix: list[int]) -> str | None:
        """A user turn written by the target itself, or None when it came back unusable."""
        body, _ = await pool.post(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": prefix,
                "max_tokens": self.cfg.max_new_tokens,
                "temperature": SELF_INSTRUCT_TEMPERATURE,
                "top_p": self.cfg.top_p,
                "seed": self.cfg.seed + attempt,
            },
        )
        choice = (body.get("choices") or [{}])[0]
        text = (choice.get("text") or "").strip()
        # Cut off at max_tokens, the user turn never ended: not a prompt anyone wrote.
        if not text or choice.get("finish_reason") != "stop":
            return None
        return text

    async def _conversation(self, pool: ServerPool, item: dict) -> dict:
        """Replay one conversation turn by turn; return its record (raise RequestFailed on failure)."""
        messages = list(item["system"])
        finish, prompt_tokens, endpoints = None, None, []
        for turn, user in enumerate(item["users"]):
            messages.append({"role": "user", "content": user})
            answer, finish, turn_prompt_tokens, endpoint = await self._chat(pool, messages)
            endpoints.append(endpoint)
            prompt_tokens = turn_prompt_tokens if prompt_tokens is None else prompt_tokens
            if self.expect_reasoning:
                self.recent_empty.append(not answer["reasoning"])
                if not answer["reasoning"]:
                    self.counts["empty_reasoning"] += 1
                    raise RequestFailed(f"empty reasoning at turn {turn} (expect_reasoning)", endpoint=endpoint)
            messages.append(answer)
        return {
            "id": item["id"],
            "split": "train",
            "messages": messages,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "generator": {
                "kind": "server",
                "endpoint": ",".join(dict.fromkeys(endpoints)),
                "model": self.model,
                "sampling": self.sampling(),
            },
        }

    async def _task(self, pool: ServerPool, item: dict, prefix: list[int] | None, claimed: set[str]):
        try:
            if "attempt" in item:  # self-instruct: the target writes the user turn first
                text = await self._self_instruct_prompt(pool, item["attempt"], prefix)
                if text is None:
                    return "skip", "unusable", item
                conv_id = magpie_id(text)
                if conv_id in claimed:
                    return "skip", "duplicate", item
                claimed.add(conv_id)
                item = {"id": conv_id, "system": item["system"], "users": [text]}
            return "ok", await self._conversation(pool, item), item
        except RequestFailed as e:
            return "error", e, item
        except ServerRefused as e:
            return "refused", e, item

    def _failure_check(self, target_n: int) -> str | None:
        """Why the run must stop now, or None."""
        c = self.cfg
        need = min(c.empty_reasoning_window, target_n)
        if self.expect_reasoning and len(self.recent_empty) >= need:
            empty = sum(self.recent_empty)
            if empty > c.empty_reasoning_share * len(self.recent_empty):
                return (
                    f"{empty} of the last {len(self.recent_empty)} answers came back without reasoning "
                    f"(threshold {c.empty_reasoning_share:.0%}), but this target is expected to reason. Likely "
                    f"causes: the server was started without a reasoning parser (vLLM: --reasoning-parser "
                    f"NAME; then the reasoning stays inline or is dropped), thinking is disabled in the chat "
                    f"template (chat_template_kwargs {{\"enable_thinking\": true}}), or the server's reasoning "
                    f"field is one this client does not know. Fix the server, or set "
                    f"gen.expect_reasoning=false if the answers are meant to have none."
                )
        need = min(c.error_window, target_n)
        if len(self.recent_failed) >= need:
            failed = sum(self.recent_failed)
            if failed > c.max_error_share * len(self.recent_failed):
                return (
                    f"{failed} of the last {len(self.recent_failed)} conversations failed after retries "
                    f"(threshold {c.max_error_share:.0%}); see {self.err_path} for the reasons"
                )
        return None

    async def run(self, target_n: int, done: set[str], items=None, self_instruct: bool | None = None) -> str | None:
        """Save conversations until `target_n` are on disk; return why it stopped early (None when complete).

        `items` ({"id", "system", "users"} each) replaces the recipe's data source (benchmarks use it);
        `self_instruct` (default gen.self_instruct) has the target write the user turns instead.
        """
        from tqdm import tqdm

        cfg = self.cfg
        self_instruct = cfg.self_instruct if self_instruct is None else self_instruct
        items, prefix = self._work(target_n, done, items, self_instruct)
        saved, claimed, stop = len(done), set(done), None
        t0 = time.time()
        bar = tqdm(total=target_n, initial=saved, desc="gen", unit="conv", dynamic_ncols=True)
        async with ServerPool(
            cfg.endpoints,
            concurrency=cfg.concurrency,
            timeout_s=cfg.timeout_s,
            max_retries=cfg.max_retries,
            backoff_s=cfg.backoff_s,
            backoff_max_s=cfg.backoff_max_s,
            seed=cfg.seed,
            auth=self.auth,
        ) as pool:
            if not self.model:
                listed = await pool.get("/v1/models")
                self.model = listed["data"][0]["id"]
            in_flight: set[asyncio.Task] = set()
            with self._appending() as (out, err):
                try:
                    while saved < target_n and stop is None:
                        # Never more in flight than slots, nor than conversations still wanted: the count is exact.
                        while (
                            len(in_flight) < min(pool.slots, target_n - saved)
                            and (item := next(items, None)) is not None
                        ):
                            in_flight.add(asyncio.create_task(self._task(pool, item, prefix, claimed)))
                        if not in_flight:
                            stop = self._ran_out(saved, target_n, self_instruct)
                            break
                        finished, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                        for task in finished:
                            kind, value, item = task.result()
                            if kind == "refused":  # 401/403: no request can succeed with this key
                                raise value
                            if self._keep(kind, value, item, out, err):
                                saved += 1
                                bar.update(1)
                        stop = stop or self._failure_check(target_n)
                        self._show(bar, pool, time.time() - t0)
                finally:
                    for task in in_flight:
                        task.cancel()
                    await asyncio.gather(*in_flight, return_exceptions=True)
                    out.flush()
                    os.fsync(out.fileno())
        bar.close()
        self.counts["saved_this_run"] = saved - len(done)
        self.counts["requests"] = pool.requests
        self.retries = dict(pool.retries)
        return stop

    def _work(self, target_n: int, done: set[str], items, self_instruct: bool) -> tuple:
        """(what to ask for, one item at a time; the user-turn prefix the target writes prompts from, or
        None): the source's conversations not yet `done`, or target_n times the attempts at writing one."""
        if not self_instruct:
            source = items if items is not None else _conversation_prompts(self.recipe, self.target, self.counts)
            return (it for it in source if it["id"] not in done), None
        prompt = self.cfg.system_prompt
        system = [{"role": "system", "content": prompt}] if prompt else []
        attempts = range(target_n * SELF_INSTRUCT_ATTEMPTS_PER_SAMPLE)
        return ({"attempt": a, "system": system} for a in attempts), user_turn_prefix(self.target, prompt)

    @contextlib.contextmanager
    def _appending(self):
        """The conversations file and the errors file, opened for appending (local files, opened once
        before any request is in flight: nothing waits on them)."""
        with open(self.out_path, "a", encoding="utf-8") as out, open(self.err_path, "a", encoding="utf-8") as err:
            yield out, err

    def _keep(self, kind: str, value, item: dict, out, err) -> bool:
        """File one finished task (_task's result): True when a conversation was saved; a failure goes to
        the errors file, an unusable or duplicate self-instruct prompt is counted."""
        if kind == "skip":
            self.counts[value] += 1
            return False
        if kind == "ok":
            out.write(json.dumps(value, ensure_ascii=False) + "\n")
            out.flush()
            self.recent_failed.append(False)
            return True
        err.write(
            json.dumps(
                {
                    "id": item.get("id"),
                    "reason": value.reason,
                    "status": value.status,
                    "attempts": value.attempts,
                    "endpoint": value.endpoint,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                }
            )
            + "\n"
        )
        err.flush()
        self.counts["failed"] += 1
        self.recent_failed.append(True)
        return False

    def _ran_out(self, saved: int, target_n: int, self_instruct: bool) -> str:
        """Why the run stops with nothing left to ask."""
        if not self_instruct:
            return f"the source ran out: {saved} of {target_n} conversations saved"
        return (
            f"self-instruct gave up: {self.counts['duplicate'] + self.counts['unusable']} "
            f"unusable or duplicate user turns for {saved} saved"
        )

    def _show(self, bar, pool: ServerPool, elapsed: float) -> None:
        bar.set_postfix(
            failed=self.counts["failed"],
            retries=sum(pool.retries.values()),
            err=f"{sum(self.recent_failed) / max(len(self.recent_failed), 1):.1%}",
            tok_s=f"{self.tokens / max(elapsed, 1e-9):.0f}",
        )

    def requested(self) -> dict:
        """What the run asked the servers for, as the manifest records it."""
        cfg = self.cfg
        return {
            "endpoints": cfg.endpoints,
            "model": self.model,
            "sampling": self.sampling(),
            # the key's variable and the headers' names; never their values
            "auth": {
                "api_key_env": cfg.api_key_env,
                "key_sent": self.auth.key_set,
                "headers": sorted(k for k in self.auth.headers if k != "Authorization"),
            },
            "system_prompt": cfg.system_prompt,
            "self_instruct": cfg.self_instruct,
            "self_instruct_samples": cfg.self_instruct_samples,
            "expect_reasoning": self.expect_reasoning,
            "thinking_markers": self.markers,
        }


def run_server(recipe: Recipe, folder: RunFolder) -> dict:
    cfg = recipe.gen
    t_start = time.time()
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)
    target.check_fits(recipe)
    already = finished_ids(folder.conversations)
    # gen.self_instruct_samples' conversations come after the source's and count apart from them.
    done = {i for i in already if not i.startswith(MAGPIE_PREFIX)}
    target_n = num_samples(recipe)
    gen = ServerGen(recipe, folder, target)
    items = None
    if target_n is None:
        # Every usable conversation: the count is known only once the source has been read and filtered.
        items = list(_conversation_prompts(recipe, target, gen.counts))
        target_n = len(items)
    if len(done) > target_n:
        raise DataError(
            f"{folder.conversations} already holds {len(done)} conversations, more than "
            f"gen.num_samples = {target_n}; raise it or use another run folder"
        )
    stop = asyncio.run(gen.run(target_n, done, items))
    if cfg.self_instruct_samples and stop is None:
        done = finished_ids(folder.conversations)
        written = sum(i.startswith(MAGPIE_PREFIX) for i in done)
        target_n = len(done) + max(0, cfg.self_instruct_samples - written)
        stop = asyncio.run(gen.run(target_n, done, self_instruct=True))
    return _record_server(gen, folder, target_n, len(already), stop, time.time() - t_start)


def _record_server(
    gen: ServerGen, folder: RunFolder, target_n: int, already: int, stop: str | None, seconds: float
) -> dict:
    """The manifest's gen entry; a run that stopped early is recorded (failed when short) and stops."""
    saved = len(finished_ids(folder.conversations))
    counts = {
        "target": target_n,
        "records": saved,
        "already_done": already,
        **gen.counts,
        "retries": gen.retries,
        "generated_tokens": gen.tokens,
    }
    new = gen.counts["saved_this_run"]
    metrics = {
        "tokens_per_s": round(gen.tokens / seconds, 1) if seconds else None,
        "samples_per_s": round(new / seconds, 3) if seconds else None,
    }
    if stop is not None:
        folder.record(
            "gen",
            state="failed" if saved < target_n else "done",
            config=gen.cfg,
            counts=counts,
            metrics=metrics,
            seconds=seconds,
            extra={"requested": gen.requested(), "stopped": stop},
        )
        raise GenStopped(f"gen stopped: {stop} ({saved} of {target_n} saved in {folder.conversations})")
    entry = folder.record(
        "gen",
        state="done",
        config=gen.cfg,
        counts=counts,
        metrics=metrics,
        seconds=seconds,
        extra={"requested": gen.requested()},
    )
    print(
        f"gen: {saved} conversations in {folder.conversations} ({gen.counts['failed']} failed, "
        f"{sum(gen.retries.values())} retries)\nnext: specdraft render --run {folder.path}"
    )
    return entry


def nothing_to_generate(recipe: Recipe, folder: RunFolder) -> dict:
    """A pre-rendered source has no prompts to answer: gen records itself done with no conversations, and
    render takes the rows as they are."""
    print(
        f"gen: {recipe.data.source} holds pre-rendered rows ({recipe.data.input_ids_field} + "
        f"{recipe.data.loss_mask_field}): nothing to generate, render takes them as they are\n"
        f"next: specdraft render --run {folder.path}"
    )
    return folder.record(
        "gen",
        state="done",
        config=recipe.gen,
        counts={"records": 0},
        extra={"skipped": "pre-rendered source: nothing to generate"},
    )


def preflight(recipe: Recipe) -> None:
    """Before the run folder is written (cli): a server-side gen's key variable and header variables are set,
    so a key pasted where a variable's name belongs is refused before the recipe holding it is recorded."""
    if recipe.gen.endpoints:
        Auth.from_env(recipe.gen.api_key_env, recipe.gen.headers)


def run(recipe: Recipe, folder: RunFolder) -> dict:
    cfg = recipe.gen
    if source_is_rendered(recipe.data):
        return nothing_to_generate(recipe, folder)
    if cfg.answers not in ANSWERS:
        raise ConfigError(f"gen.answers: expected one of {ANSWERS}, got {cfg.answers!r}")
    if cfg.self_instruct and (cfg.answers == "source" or num_samples(recipe) is None):
        raise ConfigError(
            "gen.self_instruct: the target writes the prompts, so there are no source answers "
            "and no 'every conversation'; set gen.num_samples and gen.answers = \"target\""
        )
    if cfg.self_instruct_samples and (cfg.self_instruct or cfg.answers == "source"):
        raise ConfigError(
            "gen.self_instruct_samples adds conversations the target writes to the source's; with "
            "gen.self_instruct (all of them written) or gen.answers = \"source\" (no target answers) "
            "there is nothing to add them to: set it to 0"
        )
    # A resumed run that switched modes would mix both kinds of answers and spoil the ablation.
    other = answers_on_disk(folder.conversations) - {cfg.answers}
    if other:
        raise DataError(
            f"{folder.conversations} holds {other.pop()} answers, but gen.answers = "
            f"{cfg.answers!r}: use another run folder"
        )
    if cfg.answers == "source":
        return run_source(recipe, folder)
    if cfg.endpoints:
        return run_server(recipe, folder)
    return run_inprocess(recipe, folder)
