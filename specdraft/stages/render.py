"""render: conversations -> input_ids + loss_mask through the target's own chat template.

The drafter must see exactly the tokens the target sees when served. Each assistant turn is placed
where the target generated it: after the template's generation prompt for the conversation so far
(earlier turns rendered the way the template renders history at that moment), followed by the
tokens the target produced for the turn — its own ids when gen kept them, else the turn as the
template renders it, reasoning included. The loss mask covers the turn's reasoning, answer and
end-of-turn token, nothing else.

Templates that rewrite earlier turns (Qwen3, DeepSeek-R1, Kimi-K2 and gpt-oss drop the reasoning of
finished turns) make a later prompt that no longer extends the tokens built so far. The turn is then
trained in its own sample, whose context is the template's rewritten history (unmasked): every
assistant turn is trained once, in the copy the target generated, in the context it was generated in.

Reasoning goes in the message field the template reads (probed: `reasoning_content` for Qwen3,
`thinking` for gpt-oss); a template that reads none gets it wrapped in the target's thinking markers.
Every turn is verified against the template (the generation prompt must be a prefix of the rendered
turn) and, with `render.verify_endpoint`, against a vLLM server's own tokenization; mismatches are
reported with the first differing token.

Tool definitions go to the template as `tools=`; a turn's tool calls are trained where the template writes
them, and kept as context, untrained, where it does not (SmolLM2's writes neither). Pre-rendered rows
(data.source of input_ids + loss_mask) are not rendered: checked, written as they are, and recorded as
trusted in the manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdraft.config import Recipe
from specdraft.data.client import REFUSED, Auth
from specdraft.data.sources import (
    DataError,
    is_token_id,
    read_conversations,
    read_rendered,
    source_is_rendered,
    split_of,
)
from specdraft.files import save_safetensors
from specdraft.run import RunFolder, staged_files
from specdraft.targets import Target, tokenizer_thinking_markers

# Fields templates read an assistant turn's reasoning from, probed in this order: Qwen3, DeepSeek and
# Kimi templates read `reasoning_content`, gpt-oss reads `thinking`, vLLM >= 0.31 passes `reasoning`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Stands for an answer while locating a turn's end in the rendered text: private-use characters that
# no template strips or rewrites and no real answer contains.
PLACEHOLDER = "\ue000specdraft\ue001"
PROBE_REASONING = "\ue002specdraft-reasoning\ue003"
# A function name no real tool has: found in the text when the template writes tools or tool calls.
PROBE_TOOL = "specdraft_probe_tool"
# The fields of a message besides role and content that a template reads for tool use.
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")
# How reasoning is laid out between markers by templates that read no reasoning field: the layout
# DeepSeek-R1 and Qwen3 models generate (`<think>\n...\n</think>\n\n` then the answer).
WRAP_AFTER_START = "\n"
WRAP_BEFORE_END = "\n"
WRAP_AFTER_END = "\n\n"
# Mismatch examples kept in the manifest (the counts cover all of them).
MAX_EXAMPLES = 20
VERIFY_TIMEOUT_S = 60.0
# Connection attempts per /tokenize request: a server busy starting or restarting refuses a few.
VERIFY_CONNECT_RETRIES = 3


class RenderError(DataError):
    """A conversation the template cannot render as its target generated it."""


class TemplateMismatch(RenderError):
    """A turn whose rendering disagrees with the template, with no target ids to fall back on."""


@dataclass
class Mismatch:
    """Two token sequences that should agree, and where they first differ."""

    conversation: str
    turn: int
    kind: str  # "prefix" | "end" | "retokenized" | "vllm_prompt"
    position: int
    ours: str
    theirs: str

    def __str__(self) -> str:
        return (
            f"conversation {self.conversation} turn {self.turn}: {self.kind} mismatch at token "
            f"{self.position}: ours {self.ours} vs {self.theirs}"
        )


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where a and b differ (the shorter length if one extends the other)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class Turn:
    prompt: list[int]  # the template's generation prompt for the conversation before the turn
    body: list[int]  # what the target generates: reasoning + answer + end-of-turn token
    after: list[int]  # what the template puts after the end-of-turn token (e.g. "\n"), not generated
    end_id: int | None  # the end-of-turn token, when the template ends turns with one
    mismatch: tuple[str, int, list[int], list[int]] | None = None  # (kind, position, ours, template's)


class ChatTemplate:
    """A tokenizer's chat template, with what render needs to know about it.

    `markers` are the target's thinking markers; None looks them up in the tokenizer.
    `template_kwargs` pass to the template as the server passed them (e.g. enable_thinking).
    """

    def __init__(self, tokenizer, markers: tuple[str, str] | None = None, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        if markers is None:
            markers = tokenizer_thinking_markers(tokenizer)
        self.markers = tuple(markers) if markers else None
        self.special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        self.reasoning_field = self._probe_reasoning_field()
        self.writes_tools, self.writes_tool_calls = self._probe_tools()

    @classmethod
    def of_target(cls, target: Target, template_kwargs: dict | None = None) -> ChatTemplate:
        return cls(target.tokenizer, target.thinking_markers, template_kwargs)

    @property
    def sha256(self) -> str:
        return hashlib.sha256((self.tokenizer.chat_template or "").encode()).hexdigest()[:16]

    def describe(self) -> dict:
        return {
            "reasoning": self.reasoning_field or ("wrapped" if self.markers else "unsupported"),
            "tools": "written" if self.writes_tools else "ignored",
            "tool_calls": "written" if self.writes_tool_calls else "ignored",
            "thinking_markers": list(self.markers) if self.markers else None,
            "template_kwargs": self.template_kwargs,
            "chat_template_sha256": self.sha256,
        }

    def text(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **self.template_kwargs
        )

    def encode(self, text: str) -> list[int]:
        # The template writes the special tokens itself (bos included), as apply_chat_template does.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode_at(self, ids: list[int], i: int) -> str:
        return f"{self.tokenizer.decode([ids[i]])!r} ({ids[i]})" if i < len(ids) else "<end>"

    def _probe_reasoning_field(self) -> str | None:
        """The assistant-message field this template renders reasoning from, if any.

        transformers (5.2x) copies any of these fields into the others before rendering, so every one
        probes alike there; the one the template's source names is the one it reads, and the one to
        pass where no copying happens (older transformers, other renderers).
        """
        from jinja2 import TemplateError

        rendered = []
        for name in REASONING_FIELDS:
            probe = [
                {"role": "user", "content": "?"},
                {"role": "assistant", "content": PLACEHOLDER, name: PROBE_REASONING},
            ]
            try:
                if PROBE_REASONING in self.text(probe, add_generation_prompt=False):
                    rendered.append(name)
            except TemplateError:  # a template may reject a field it does not know (raise_exception)
                continue
        source = self.tokenizer.chat_template or ""
        named = [name for name in rendered if re.search(rf"\b{name}\b", source)]
        return (named or rendered or [None])[0]

    def _probe_tools(self) -> tuple[bool, bool]:
        """Whether the template writes the tool definitions passed as `tools=`, and an assistant turn's
        `tool_calls`, into the text (SmolLM2's writes neither: it renders role and content only)."""
        from jinja2 import TemplateError

        tools = [
            {
                "type": "function",
                "function": {
                    "name": PROBE_TOOL,
                    "description": "probe",
                    "parameters": {"type": "object", "properties": {}},
                },
            }
        ]
        call = {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": PROBE_TOOL, "arguments": {}}}],
        }
        user = [{"role": "user", "content": "?"}]
        found = []
        for messages, with_tools, prompt in ((user, tools, True), (user + [call], None, False)):
            try:
                found.append(PROBE_TOOL in self.text(messages, prompt, with_tools))
            except TemplateError:  # a template may reject what it does not know (raise_exception)
                found.append(False)
        return found[0], found[1]

    def message(self, m: dict) -> dict:
        """A record's message as the template takes it: role, content, the reasoning field it reads and
        the tool-use fields the message has."""
        out = {"role": m["role"], "content": m["content"], **{k: m[k] for k in TOOL_FIELDS if k in m}}
        if m["role"] == "assistant" and m.get("reasoning") and self.reasoning_field:
            out[self.reasoning_field] = m["reasoning"]
        return out

    def history(self, messages: list[dict]) -> list[dict]:
        return [self.message(m) for m in messages]

    def prompt_ids(self, before: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.encode(self.text(self.history(before), add_generation_prompt=True, tools=tools))

    def _wrap(self, head: str, reasoning: str) -> str:
        """`head` (the rendered turn up to its answer) with the reasoning in the thinking markers."""
        start, end = self.markers
        laid_out = WRAP_AFTER_START + reasoning.strip("\n") + WRAP_BEFORE_END
        empty = re.search(re.escape(start) + r"(\s*)" + re.escape(end) + r"(\s*)$", head)
        if empty:
            # The template writes an empty think block before the answer (Kimi-K2 writes `<think></think>`):
            # fill it in place, with the reasoning laid out as tightly as the empty block is.
            inner = laid_out if empty.group(1) else reasoning
            return head[: empty.start()] + start + inner + end + empty.group(2)
        return head + start + laid_out + end + WRAP_AFTER_END

    def turn(self, before: list[dict], m: dict, tools: list[dict] | None = None) -> Turn:
        """Assistant message `m` after `before` (with the tool definitions `tools`), as the target generated
        it, checked against the template."""
        history = self.history(before)
        prompt_text = self.text(history, add_generation_prompt=True, tools=tools)
        prompt = self.encode(prompt_text)
        reasoning = m.get("reasoning") or ""
        # Without its tool calls, which templates write after the content: the tail is then the turn's end.
        shell = {k: v for k, v in self.message(m).items() if k != "tool_calls"} | {"content": PLACEHOLDER}
        shell_text = self.text(history + [shell], add_generation_prompt=False, tools=tools)
        if shell_text.count(PLACEHOLDER) != 1:
            raise RenderError("the chat template does not render an assistant answer once, as it is given")
        head, tail = shell_text.split(PLACEHOLDER)
        # A prompt that opens the think block (DeepSeek-R1) makes the target write one, even an empty one.
        opens_thinking = bool(self.markers) and prompt_text.rstrip().endswith(self.markers[0])
        if (reasoning or opens_thinking) and not self.reasoning_field:
            if not self.markers:
                raise RenderError(
                    "the turn has reasoning, but the chat template ignores it and the target "
                    "has no thinking markers to wrap it in"
                )
            full_text = self._wrap(head, reasoning) + m["content"] + tail
        else:
            full_text = self.text(history + [self.message(m)], add_generation_prompt=False, tools=tools)
        tail_ids = self.encode(tail)
        end_id = tail_ids[0] if tail_ids and tail_ids[0] in self.special else None
        after = tail_ids[1:] if end_id is not None else tail_ids
        mismatch = None
        if not full_text.startswith(prompt_text):
            full = self.encode(full_text)
            pos = first_difference(full[: len(prompt)], prompt)
            mismatch = ("prefix", len(prompt) if pos is None else pos, full, prompt)
            generated = full_text[len(prompt_text) :]
        elif not full_text.endswith(tail):
            generated = full_text[len(prompt_text) :]
            ours = prompt + self.encode(generated)
            mismatch = ("end", len(ours), ours, ours + tail_ids)
        else:
            generated = full_text[len(prompt_text) : len(full_text) - len(tail)]
        # The served target reads the prompt's tokens and generates after them, so the turn is
        # tokenized on its own, not merged with the prompt's last characters.
        body = self.encode(generated) + ([end_id] if end_id is not None else [])
        return Turn(prompt, body, after, end_id, mismatch)


@dataclass
class Rendered:
    """One conversation's samples and what rendering it found."""

    samples: list[tuple[list[int], list[int]]] = field(default_factory=list)
    turns: int = 0
    reasoning_turns: int = 0
    turns_with_ids: int = 0
    retokenized_differs: int = 0
    tool_call_turns: int = 0
    untrained_tool_calls: int = 0  # tool-calling turns whose calls the template does not write
    mismatches: list[Mismatch] = field(default_factory=list)


def own_token_ids(record: dict, messages: list[dict], i: int) -> list[int] | None:
    """The ids the target produced for assistant turn i: the turn's `token_ids`, or (older records)
    the record-level `answer_token_ids` of the last assistant turn."""
    ids = messages[i].get("token_ids")
    if ids:
        return list(ids)
    last = max(j for j, m in enumerate(messages) if m["role"] == "assistant")
    if i == last and record.get("answer_token_ids"):
        return list(record["answer_token_ids"])
    return None


def check_token_ids(record: dict, where: str, vocab_size: int) -> None:
    """Refuse a record whose target ids (a turn's `token_ids`, the record's `answer_token_ids`) are not ids
    of the target's vocabulary: they would be written as they are and crash extract, or train on another
    tokenizer's ids."""
    lists = [(f"message {j} token_ids", m.get("token_ids")) for j, m in enumerate(record["messages"])]
    lists.append(("answer_token_ids", record.get("answer_token_ids")))
    for name, ids in lists:
        if ids is None:
            continue
        if not isinstance(ids, list):
            raise DataError(f"{where}: {name} is not a list of token ids, got {ids!r:.80}")
        bad = next((t for t in ids if not (is_token_id(t) and t < vocab_size)), None)
        if bad is not None:
            raise DataError(
                f"{where}: {name} holds {bad!r}, outside the target's vocabulary [0, {vocab_size}) "
                f"(generated by another target?); rerun `specdraft gen` with this recipe's target"
            )


def render_conversation(template: ChatTemplate, record: dict, max_length: int) -> Rendered:
    """Samples (input_ids, loss_mask) of one conversation; usually one, more when the template rewrites
    earlier turns (see the module docstring)."""
    messages, tools = record["messages"], record.get("tools")
    cid = record["id"]
    out = Rendered()
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            turn = template.turn(messages[:i], m, tools)
        except RenderError as e:
            raise RenderError(f"conversation {cid} turn {i}: {e}") from None
        out.turns += 1
        out.reasoning_turns += bool(m.get("reasoning"))
        out.tool_call_turns += bool(m.get("tool_calls"))
        # A template that drops the calls leaves no copy of what the target would say: context only.
        untrained = bool(m.get("tool_calls")) and not template.writes_tool_calls
        out.untrained_tool_calls += untrained
        own = own_token_ids(record, messages, i)
        if turn.mismatch:
            kind, pos, ours, theirs = turn.mismatch
            out.mismatches.append(
                Mismatch(
                    cid, i, kind, pos, template.decode_at(ours, pos), "template " + template.decode_at(theirs, pos)
                )
            )
            if own is None:
                # Without the target's own ids there is no trustworthy copy of this turn.
                raise TemplateMismatch(str(out.mismatches[-1]))
        body = turn.body
        if own is not None:
            out.turns_with_ids += 1
            stopped = turn.end_id is not None and own[-1] == turn.end_id
            # A turn cut at max_new_tokens never produced its end token; its text re-tokenizes without it.
            retokenized = body if stopped or turn.end_id is None else body[:-1]
            pos = first_difference(own, retokenized)
            if pos is not None:
                out.retokenized_differs += 1
                out.mismatches.append(
                    Mismatch(
                        cid,
                        i,
                        "retokenized",
                        pos,
                        template.decode_at(own, pos),
                        "re-tokenized " + template.decode_at(retokenized, pos),
                    )
                )
            body = own
            after = turn.after if stopped else []
        else:
            after = turn.after
        if ids and turn.prompt[: len(ids)] != ids:
            # The template renders the turns so far differently now (reasoning dropped, or the target's
            # own ids differ from how the server re-tokenizes its history): they keep their own sample.
            out.samples.append((ids, mask))
            ids, mask = [], []
        mask += [0] * (len(turn.prompt) - len(ids))
        ids = turn.prompt + body + after
        mask += [int(not untrained)] * len(body) + [0] * len(after)
    out.samples.append((ids, mask))
    out.samples = [(s[:max_length], k[:max_length]) for s, k in out.samples]
    return out


def verify_client(auth: Auth | None = None):
    """The client of render.verify_endpoint, carrying gen's key and headers (`auth`) on every request."""
    import httpx

    return httpx.Client(
        timeout=VERIFY_TIMEOUT_S,
        transport=httpx.HTTPTransport(retries=VERIFY_CONNECT_RETRIES),
        headers=(auth or Auth()).headers,
    )


def verify_with_server(
    template: ChatTemplate, record: dict, url: str, model: str | None = None, client=None, auth: Auth | None = None
) -> list[Mismatch]:
    """Compare each assistant turn's generation prompt with the server's own tokenization of it
    (vLLM's `/tokenize` with `messages`; it passes an assistant message's `reasoning` to the template).
    `auth` is what `client` sends (it makes the client when none is given); a 401/403 raises ServerRefused."""
    auth = auth or Auth()
    client = client or verify_client(auth)
    messages = record["messages"]
    found = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        sent = [
            {
                "role": x["role"],
                "content": x["content"],
                **{k: x[k] for k in TOOL_FIELDS if k in x},
                **({"reasoning": x["reasoning"]} if x["role"] == "assistant" and x.get("reasoning") else {}),
            }
            for x in messages[:i]
        ]
        body = {
            "messages": sent,
            "add_generation_prompt": True,
            **({"tools": record["tools"]} if record.get("tools") else {}),
        }
        if model:
            body["model"] = model
        if template.template_kwargs:
            body["chat_template_kwargs"] = template.template_kwargs
        response = client.post(url.rstrip("/") + "/tokenize", json=body)
        if response.status_code in REFUSED:
            raise auth.refused(f"{url.rstrip('/')}/tokenize", response.status_code)
        if response.status_code != 200:
            raise RenderError(f"{url}/tokenize answered {response.status_code}: {auth.scrub(response.text[:300])}")
        theirs = response.json()["tokens"]
        ours = template.prompt_ids(messages[:i], record.get("tools"))
        pos = first_difference(ours, theirs)
        if pos is not None:
            found.append(
                Mismatch(
                    record["id"],
                    i,
                    "vllm_prompt",
                    pos,
                    template.decode_at(ours, pos),
                    "vLLM " + template.decode_at(theirs, pos),
                )
            )
    return found


def _template_kwargs(recipe: Recipe) -> dict:
    """What gen asked the template for (e.g. enable_thinking), so render sees the same template."""
    kwargs = getattr(recipe.gen, "chat_template_kwargs", None) or {}
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    return dict(kwargs)


# What the manifest's render entry counts (tokens and loss_tokens follow once they are written).
COUNTS = (
    "conversations",
    "samples",
    "turns",
    "reasoning_turns",
    "turns_with_token_ids",
    "retokenized_differs",
    "tool_call_turns",
    "untrained_tool_calls",
    "template_mismatches",
    "skipped_mismatch",
    "skipped_no_answer",
    "vllm_checked",
    "vllm_mismatches",
)


@dataclass
class Tally:
    """What rendering the conversations found: the manifest's counts and the first mismatches."""

    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    examples: list[str] = field(default_factory=list)

    def keep(self, found: list) -> None:
        self.examples.extend(str(x) for x in found[: MAX_EXAMPLES - len(self.examples)])

    def rendered(self, r: Rendered) -> None:
        for key, value in (
            ("turns", r.turns),
            ("reasoning_turns", r.reasoning_turns),
            ("turns_with_token_ids", r.turns_with_ids),
            ("retokenized_differs", r.retokenized_differs),
            ("tool_call_turns", r.tool_call_turns),
            ("untrained_tool_calls", r.untrained_tool_calls),
        ):
            self.counts[key] += value
        self.counts["template_mismatches"] += sum(x.kind in ("prefix", "end") for x in r.mismatches)
        self.keep([x for x in r.mismatches if x.kind != "retokenized"])

    def metrics(self) -> dict:
        c = self.counts
        with_ids = c["turns_with_token_ids"]
        return {
            # Re-tokenizing SmolLM2's own answers changes 12 to 19 % of them (docs/engine-facts.md); the
            # ids avoid it.
            "retokenized_differs_share": round(c["retokenized_differs"] / with_ids, 4) if with_ids else None,
            "template_mismatch_share": round(c["template_mismatches"] / c["turns"], 4) if c["turns"] else None,
            "vllm_mismatch_share": (round(c["vllm_mismatches"] / c["vllm_checked"], 4) if c["vllm_checked"] else None),
        }


@dataclass
class Packed:
    """Every sample end to end, as tokens.safetensors stores them: sample i is ids[offsets[i]:offsets[i + 1]]."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])
    names: list[str] = field(default_factory=list)

    def add(self, conversation: str, samples: list[tuple[list[int], list[int]]]) -> int:
        """Append a conversation's samples (the k-th after its first named `id#k`); returns how many had no
        loss token and were left out."""
        empty = 0
        for k, (ids, mask) in enumerate(samples):
            if sum(mask) == 0:
                empty += 1
                continue
            self.ids += ids
            self.mask += mask
            self.offsets.append(len(self.ids))
            self.names.append(conversation if k == 0 else f"{conversation}#{k}")
        return empty

    def save(self, out: Path, template: ChatTemplate, target: Target) -> dict:
        """Write tokens.safetensors and index.json into `out`; returns the index."""
        import torch

        index = {
            "ids": self.names,
            "num_samples": len(self.names),
            "num_tokens": len(self.ids),
            "num_loss_tokens": int(sum(self.mask)),
            "chat_template_sha256": template.sha256,
            "template": template.describe(),
            "target": target.describe(),
        }
        # The tokens and their index renamed in together: the last good pair stays until both are written.
        with staged_files(out / "tokens.safetensors", out / "index.json") as (tokens, index_json):
            save_safetensors(
                {
                    "input_ids": torch.tensor(self.ids, dtype=torch.int32),
                    "loss_mask": torch.tensor(self.mask, dtype=torch.uint8),
                    "offsets": torch.tensor(self.offsets, dtype=torch.int64),
                },
                tokens,
            )
            index_json.write_text(json.dumps(index, indent=2) + "\n")
        return index


def render_record(
    template: ChatTemplate, record: dict, cfg, tally: Tally, client, src: Path, auth: Auth | None = None
) -> Rendered | None:
    """One conversation of the conversations file `src` rendered, checked against `client`'s server when
    there is one, and tallied; None when a template mismatch without the target's ids skips it."""
    tally.counts["conversations"] += 1
    try:
        r = render_conversation(template, record, cfg.max_length)
    except TemplateMismatch as e:
        tally.counts["skipped_mismatch"] += 1
        tally.counts["template_mismatches"] += 1
        tally.keep([e])
        return None
    except RenderError as e:
        raise RenderError(f"{src}: {e}") from None
    tally.rendered(r)
    if client is not None:
        found = verify_with_server(template, record, cfg.verify_endpoint, client=client, auth=auth)
        tally.counts["vllm_checked"] += r.turns
        tally.counts["vllm_mismatches"] += len(found)
        tally.keep(found)
    return r


def takes_rendered_rows(recipe: Recipe, folder: RunFolder) -> bool:
    """Whether render takes data.source's pre-rendered rows: gen said so (it had nothing to generate), or
    has not run and the source's first row is pre-rendered."""
    gen = folder.stage("gen") or {}
    if gen.get("state") == "done":
        return bool(gen.get("skipped"))
    return source_is_rendered(recipe.data)


def run_rendered(recipe: Recipe, folder: RunFolder, target: Target, template: ChatTemplate, t_start: float) -> dict:
    """Pre-rendered rows written as extract reads them, trusted: checked to be ids of the target's
    vocabulary and cut at render.max_length, not re-rendered through nor compared with the template (there
    is no conversation to render); the manifest says so. Rows of the eval split (data.eval_fraction, by
    id, as for conversations) are left out: eval drafts their prompts."""
    from tqdm import tqdm

    cfg, d = recipe.render, recipe.data
    packed, counts = Packed(), {"rows": 0, "held_out_for_eval": 0, "cut_at_max_length": 0, "skipped_no_loss": 0}
    for where, row in tqdm(read_rendered(d), desc="render (pre-rendered)", unit="row"):
        if split_of(row["id"], d.eval_fraction, d.split_seed) == "eval":
            counts["held_out_for_eval"] += 1
            continue
        top = max(row["input_ids"])
        if top >= target.vocab_size:
            raise DataError(
                f"{where}: token id {top} is outside the target's vocabulary [0, {target.vocab_size}): "
                f"rendered for another tokenizer?"
            )
        counts["rows"] += 1
        counts["cut_at_max_length"] += len(row["input_ids"]) > cfg.max_length
        sample = (row["input_ids"][: cfg.max_length], row["loss_mask"][: cfg.max_length])
        counts["skipped_no_loss"] += packed.add(row["id"], [sample])
    if not packed.names:
        raise DataError(f"{d.source}: no row with a loss token within render.max_length = {cfg.max_length}")
    index = packed.save(folder.tokens, template, target)
    counts.update(samples=len(packed.names), tokens=len(packed.ids), loss_tokens=index["num_loss_tokens"])
    trusted = (
        f"{counts['rows']} pre-rendered rows of {d.source} taken as they are ({d.input_ids_field} + "
        f"{d.loss_mask_field}), not re-rendered through the chat template"
    )
    print(
        f"render: {trusted}; {counts['samples']} samples, {counts['loss_tokens']:,} loss tokens, "
        f"{counts['cut_at_max_length']} cut at {cfg.max_length} tokens, {counts['held_out_for_eval']} rows "
        f"held out for eval\nnext: specdraft extract --run {folder.path}"
    )
    return folder.record(
        "render",
        state="done",
        config=cfg,
        counts=counts,
        seconds=time.time() - t_start,
        extra={"trusted": trusted, "template": template.describe()},
    )


def preflight(recipe: Recipe) -> None:
    """Before the run folder is written (cli): --verify-endpoint is asked with gen's key and headers, so
    their variables must be set (a key pasted in a name's place is refused before it is recorded)."""
    if recipe.render.verify_endpoint:
        Auth.from_env(recipe.gen.api_key_env, recipe.gen.headers)


def run(recipe: Recipe, folder: RunFolder) -> dict:
    from tqdm import tqdm

    cfg = recipe.render
    t_start = time.time()
    rendered = takes_rendered_rows(recipe, folder)
    if not rendered:
        folder.require("gen")
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)
    target.check_fits(recipe)
    template = ChatTemplate.of_target(target, _template_kwargs(recipe))
    if rendered:
        return run_rendered(recipe, folder, target, template, t_start)
    src = folder.conversations
    tally, packed = Tally(), Packed()
    counts, examples = tally.counts, tally.examples
    # The server gen asked, or one like it: gen's key and headers (gen.api_key_env, gen.headers).
    auth = Auth.from_env(recipe.gen.api_key_env, recipe.gen.headers) if cfg.verify_endpoint else None
    client = verify_client(auth) if cfg.verify_endpoint else None
    for where, record in tqdm(read_conversations(src), desc="render", unit="conv"):
        check_token_ids(record, where, target.vocab_size)
        r = render_record(template, record, cfg, tally, client, src, auth)
        if r is not None:
            counts["skipped_no_answer"] += packed.add(record["id"], r.samples)
    if not packed.names:
        raise DataError(
            f"{src}: no conversation with assistant tokens to render"
            + (f" (first problem: {examples[0]})" if examples else "")
        )
    counts["samples"] = len(packed.names)
    index = packed.save(folder.tokens, template, target)
    counts.update({"tokens": len(packed.ids), "loss_tokens": index["num_loss_tokens"]})
    for line in examples[:5]:
        print(f"render: {line}")
    if counts["untrained_tool_calls"]:
        print(
            f"render: {counts['untrained_tool_calls']} of {counts['tool_call_turns']} tool-calling turns are kept "
            f"as context, not trained: the target's chat template does not write tool calls"
        )
    print(
        f"render: {counts['samples']} samples from {counts['conversations']} conversations, "
        f"{counts['loss_tokens']:,} loss tokens; re-tokenization differs on "
        f"{counts['retokenized_differs']}/{counts['turns_with_token_ids']} turns with the target's ids; "
        f"{counts['template_mismatches']} template and {counts['vllm_mismatches']} vLLM mismatches"
    )
    print(f"next: specdraft extract --run {folder.path}")
    return folder.record(
        "render",
        state="done",
        config=cfg,
        counts=counts,
        metrics=tally.metrics(),
        seconds=time.time() - t_start,
        extra={"mismatches": examples, "template": template.describe()},
    )
