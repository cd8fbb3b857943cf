"""Targets: load one (HF folder, GGUF file, a bundled one: SmolLM2, Qwen2.5-Coder) and describe it.

What differs between model families is data in `FAMILIES`, not code: where the decoder layers and
the final norm live, and which default aux layers EAGLE-3 uses. The chat template always comes from
the target's own tokenizer.

A target is described from its config alone: `Target` reads no weights until asked for tensors, so a
folder holding only config.json, or a config.json by any name (the published configs of
tests/data/configs), is a target too, and `plan` bills from the same description the stages use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdraft.bundled import BUNDLED, BundleError, bundled_gguf
from specdraft.config import check_target_limits
from specdraft.environment import cache_dir
from specdraft.files import FileError, open_safetensors, read_json


def refuse_pickled_weights(folder: Path) -> None:
    """Refuse a folder whose weights are pytorch_model*.bin (a target's or a drafter's) in one line giving the
    command that converts them: a .bin is a pickle, and reading one runs whatever code it holds (torch's
    weights_only guard has been bypassed before, CVE-2025-32434), so specdraft never opens one."""
    if any(Path(folder).glob("pytorch_model*.bin")):
        raise ValueError(
            f"{folder}: its weights are pytorch_model*.bin, a pickle, which specdraft never loads "
            f"(unpickling runs any code the file holds); where you trust the file, convert them to "
            f"model.safetensors and rerun: {bin_to_safetensors_command(folder)}"
        )


def bin_to_safetensors_command(folder: Path) -> str:
    """A shell command (torch + safetensors, no specdraft) writing `folder`'s pytorch_model*.bin tensors
    to model.safetensors: copies, so tensors that shared storage in the pickle can be saved."""
    # % rather than an f-string: the code has braces of its own.
    code = (
        "import glob, torch; from safetensors.torch import save_file; "  # noqa: UP031
        "save_file({k: v.contiguous().clone() for f in sorted(glob.glob(%s)) "
        "for k, v in torch.load(f, map_location=\"cpu\", weights_only=True).items()}, %s)"
        % (json.dumps(str(Path(folder) / "pytorch_model*.bin")), json.dumps(str(Path(folder) / "model.safetensors")))
    )
    return f"python -c {shlex.quote(code)}"


class TargetError(ValueError):
    """A target that cannot be found or loaded."""


# What to do about a target's file that cannot be read: the model folder is the user's (or, for a bundled
# target, a conversion cached under ~/.cache/specdraft/targets, made again when its folder is removed).
TARGET_FIX = (
    "copy the model folder again from where it came (a bundled target: remove its folder under "
    "the cache's targets/ and it is converted again)"
)


def eagle3_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers, (2, L//2, L-3): what vLLM and SGLang assume when a drafter names
    none, and what the published drafters of every family below use (Kimi-K2: [2, 30, 58] of 61)."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass(frozen=True)
class Family:
    decoder: str = "model"  # attribute path of the decoder without lm_head (returns final-norm states)
    layers: str = "model.layers"  # attribute path of the decoder layer list
    norm: str = "model.norm"  # the final norm, applied before lm_head
    embed: str = "model.embed_tokens.weight"  # tensor names in the checkpoint
    head: str = "lm_head.weight"
    # The final norm's weight in the checkpoint, and what its scale is: Gemma-style norms store w and
    # multiply by (1 + w), so a pre-norm state normalised with w alone is off by the whole residual.
    norm_weight: str = "model.norm.weight"
    norm_offset: float = 0.0
    # The transformers auto class that loads the full model (multimodal wrappers are not causal LMs).
    auto_class: str = "AutoModelForCausalLM"
    # "mla" (DeepSeek's low-rank latent attention), "gqa", or "gqa+sliding" (alternating windows).
    attention: str = "gqa"
    # The config field giving the drafter's attention head width: a Llama-style drafter layer cannot copy
    # MLA's split rope/no-rope heads, so MLA families use the value head width (128: the published
    # Kimi-K2 drafter's 64 heads x 128).
    drafter_head_dim: str = "head_dim"
    # The config field counting multi-token-prediction layers stored after the decoder layers (DeepSeek's,
    # GLM-4.5's, MiMo's `num_nextn_predict_layers`); transformers skips them, aux ids never reach them.
    mtp_field: str = "num_nextn_predict_layers"
    # Whether the serving engine can capture aux states from this family and run an EAGLE-3 drafter on it
    # (vLLM: the model class implements SupportsEagle3, checked in vllm 0.32; SGLang: it implements
    # set_eagle3_layers_to_capture).
    vllm_eagle3: bool = False
    sglang_eagle3: bool = False
    aux_layers: Callable[[int], list[int]] = eagle3_aux_layers
    # (start, end) of the reasoning span when the tokenizer's added tokens do not show them.
    thinking: tuple[str, str] | None = None


_SERVED = {"vllm_eagle3": True, "sglang_eagle3": True}
_MLA = {"attention": "mla", "drafter_head_dim": "v_head_dim"}

# model_type -> Family; families absent here use the Llama layout, which most HF decoders share. A
# multimodal wrapper is looked up by its own model_type first, then by its text model's.
FAMILIES: dict[str, Family] = {
    "llama": Family(**_SERVED),
    "mistral": Family(**_SERVED),
    # Checked on the real Qwen2.5-Coder-0.5B-Instruct (tests/test_qwen_coder.py): vLLM 0.32's Qwen2Model
    # takes aux id k after k layers, residual added, defaults (2, L//2, L-3) as for Llama; its q/k/v
    # biases stay in the target (the drafter layer has none); ties its head per checkpoint (the bundled
    # GGUF stores a separate output.weight, so its config says untied); no reasoning markers.
    "qwen2": Family(**_SERVED),
    "qwen3": Family(**_SERVED),
    "qwen3_moe": Family(**_SERVED),
    "deepseek_v2": Family(**_MLA, **_SERVED),
    "deepseek_v3": Family(**_MLA, **_SERVED),
    # Kimi-K2.5: a vision tower and projector around a DeepSeek-V3 text model. transformers loads it as
    # model.language_model (decoder) + lm_head; the published checkpoint names its tensors
    # language_model.model.* and language_model.lm_head.* (transformers renames them on load and save).
    "kimi_k25": Family(
        decoder="model.language_model",
        layers="model.language_model.layers",
        norm="model.language_model.norm",
        embed="language_model.model.embed_tokens.weight",
        head="language_model.lm_head.weight",
        norm_weight="language_model.model.norm.weight",
        auto_class="AutoModelForImageTextToText",
        **_MLA,
        **_SERVED,
    ),
    "gpt_oss": Family(attention="gqa+sliding", **_SERVED),
    # (1 + w) final norm. vLLM 0.32 captures no EAGLE-3 aux states from Gemma 3; SGLang unchecked, so
    # marked not served rather than guessed.
    "gemma3_text": Family(norm_offset=1.0),
}

# Config fields naming the same quantity in different families (DeepSeek, Qwen3-MoE, gpt-oss).
_ROUTED_EXPERTS = ("n_routed_experts", "num_experts", "num_local_experts")
_TOP_K = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token")
_MLA_RANKS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _first(config, names: tuple[str, ...]):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def family_of(config, text_config) -> Family:
    """The family of a config: its own model_type's, else its text model's; an unlisted model with
    DeepSeek's latent attention (its config gives kv_lora_rank) is MLA all the same, so its drafter
    takes the value head width as the listed ones do (engine support unchecked: not marked served)."""
    family = FAMILIES.get(config.model_type) or FAMILIES.get(text_config.model_type)
    if family is None:
        family = Family(**_MLA) if getattr(text_config, "kv_lora_rank", None) else Family()
    return family


# Reasoning markers around a thinking model's reasoning, (start, end), most common first: as added
# tokens in its tokenizer (Qwen3, DeepSeek-R1, Kimi-K2: <think>) or as its chat template writes them
# (Kimi-VL-Thinking's ◁think▷, gpt-oss's analysis channel, whose start is two pieces of text).
THINKING_MARKERS = [
    ("<think>", "</think>"),
    ("<thinking>", "</thinking>"),
    ("◁think▷", "◁/think▷"),
    ("<|channel|>analysis", "<|end|>"),
]


def tokenizer_thinking_markers(tokenizer) -> tuple[str, str] | None:
    """The first THINKING_MARKERS pair the tokenizer has as added tokens, or None."""
    added = set(tokenizer.get_added_vocab())
    for start, end in THINKING_MARKERS:
        if start in added and end in added:
            return start, end
    return None


def template_thinking_markers(template: str | None) -> list[tuple[str, str]]:
    """The THINKING_MARKERS pairs a chat template's text writes (without loading the tokenizer)."""
    return [(start, end) for start, end in THINKING_MARKERS if template and start in template]


def resolve_device(name: str, field: str = "device") -> str:
    """A torch device name; "auto" is the GPU when there is one, else the CPU. A device this machine
    does not have is one line naming the recipe's `field` ("eval.device"), not torch's assertion at the
    first tensor moved there."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise TargetError(f"{field}: {name!r} is not a torch device ({str(e).splitlines()[0]})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TargetError(f"{field}: {name!r} but torch sees no CUDA device; use \"auto\" or \"cpu\"")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise TargetError(f"{field}: {name!r} but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return name


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX). Without them torch emulates
    it: a bf16 linear layer of SmolLM2's width ran 2-4x slower than float32 there, and 2.5x faster than
    float32 where the instructions exist. SPECDRAFT_CPU_BF16=0 or 1 says it instead of the CPU."""
    forced = os.environ.get("SPECDRAFT_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    import torch

    # torch's own probes of the CPU's flags (x86); elsewhere (ARM, Apple) float32 is the safe guess.
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_dtype(name: str, device: str) -> str:
    """A torch dtype name; "auto" is bfloat16 on a GPU and on a CPU that has bf16 instructions, else
    float32 (where bf16 is emulated, float32 is the faster of the two)."""
    if name != "auto":
        return name
    return "bfloat16" if not str(device).startswith("cpu") or cpu_has_bf16() else "float32"


def _fix_special_tokens(tokenizer, config) -> None:
    """Make the tokenizer's eos/pad agree with the model config.

    Tokenizers converted from GGUF can come back with eos = <|im_start|> and no pad token (seen with transformers 5.17);
    generation would then never stop. The model config's eos_token_id is the authority.
    """
    eos_id = config.eos_token_id
    if isinstance(eos_id, list):
        eos_id = eos_id[0]
    if eos_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF file once into a bf16 safetensors HF folder (which vLLM can serve too).

    Through transformers' GGUF loader, not the gguf package's numpy dequantizer tensor by tensor: on
    Qwen2.5-Coder the two gave bit-identical tensors and the numpy path was no faster in all (it still
    needs transformers for the config and tokenizer, each a parse of the GGUF's 152 K-token metadata);
    the figures are in bench/RESULTS.md. The tokenizer is built once, here, and saved beside the weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        if getattr(model, "hf_quantizer", None) is not None:
            # save_pretrained refuses a GGUF-loaded model while the quantizer is attached.
            model.hf_quantizer.remove_quantization_config(model)
        # GGUF loading leaves architectures unset; vLLM needs it to pick the model class.
        model.config.architectures = [type(model).__name__]
        _fix_special_tokens(tokenizer, model.config)
        model.generation_config.eos_token_id = model.config.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "specdraft_source.json").write_text(json.dumps({"gguf": str(gguf), "bytes": gguf.stat().st_size}) + "\n")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve(model: str) -> Path:
    """A target name or path -> an HF folder with safetensors (converting a GGUF once, cached)."""
    if model in BUNDLED:
        try:
            gguf = bundled_gguf(model, cache_dir())
        except BundleError as e:
            raise TargetError(str(e)) from None
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise TargetError(f"target {model!r}: no such file or folder (or bundled name: {sorted(BUNDLED)})")
        if path.is_dir():
            if not (path / "config.json").exists():
                raise TargetError(f"target {path}: not an HF model folder (no config.json)")
            return path.resolve()
        if path.suffix != ".gguf":
            raise TargetError(f"target {path}: expected an HF folder or a .gguf file")
        gguf = path.resolve()
    out = cache_dir() / "targets" / f"{gguf.stem}-{gguf.stat().st_size}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out)
    return out


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load_config(config_file: Path) -> tuple[dict, object, object]:
    """(the JSON, its transformers config, the language model's config) of a config.json."""
    from transformers import AutoConfig, PretrainedConfig

    try:
        raw = read_json(config_file, fix=TARGET_FIX, what="a model's config")
    except FileError as e:
        raise TargetError(str(e)) from None
    try:
        # A folder's config.json is read through its folder (what transformers records as its name).
        config = AutoConfig.from_pretrained(
            str(config_file.parent if config_file.name == "config.json" else config_file)
        )
    except (ValueError, KeyError):
        # A wrapper transformers does not know: its language model is a known architecture under
        # text_config (as Kimi-K2.5's was before transformers had kimi_k25).
        if "text_config" not in raw:
            raise TargetError(
                f"{config_file}: model_type {raw.get('model_type')!r} is unknown to transformers "
                f"and the config has no text_config"
            ) from None
        config = PretrainedConfig(**{k: v for k, v in raw.items() if k != "text_config"})
        config.text_config = AutoConfig.for_model(**raw["text_config"])
    return raw, config, getattr(config, "text_config", None) or config


class Target:
    """A target model folder: its config, tokenizer and tensors, loaded only when asked for.

    `model` is a bundled name, an HF folder, a .gguf file, or a config.json by any name (its folder's
    tokenizer files, where it has any, are the target's)."""

    def __init__(self, model: str, aux_layer_ids: list[int] | None = None):
        self.name = model
        path = Path(model).expanduser()
        if model not in BUNDLED and path.suffix == ".json" and path.is_file():
            self.config_file, self.path = path, path.parent
        else:
            self.path = resolve(model)
            self.config_file = self.path / "config.json"
        self.raw_config, self.config, text = _load_config(self.config_file)
        self.text_config = text
        self.family = family_of(self.config, text)
        self.num_layers: int = text.num_hidden_layers
        self.hidden_size: int = text.hidden_size
        self.vocab_size: int = text.vocab_size
        # Ascending and unique: vLLM concatenates the aux states in ascending layer order whatever order
        # a config lists them in, so any other order would feed fc permuted inputs when served.
        self.aux_layer_ids = sorted(set(aux_layer_ids)) if aux_layer_ids else self.default_aux_layer_ids()
        for k in self.aux_layer_ids:
            # id k is the residual stream after k decoder layers (vLLM's convention); 0 would be the
            # embeddings and L the pre-norm output, neither of which EAGLE-3 uses as an aux layer.
            if not 1 <= k < self.num_layers:
                raise TargetError(f"aux layer id {k} outside 1..{self.num_layers - 1} for {self.path}")
        self._tokenizer = None

    def default_aux_layer_ids(self) -> list[int]:
        return self.family.aux_layers(self.num_layers)

    def check_fits(self, recipe) -> None:
        """The recipe's ranges that this target sets (config.check_target_limits): its vocabulary and,
        where its config gives one, its context length."""
        check_target_limits(
            recipe,
            vocab_size=self.vocab_size,
            target=self.name,
            max_positions=getattr(self.text_config, "max_position_embeddings", None),
        )

    @property
    def tied(self) -> bool:
        """Whether lm_head is the embedding (a wrapper may say so at its top level or in its text config)."""
        return bool(
            getattr(self.text_config, "tie_word_embeddings", False)
            or (self.config is not self.text_config and getattr(self.config, "tie_word_embeddings", False))
        )

    @property
    def mtp_layers(self) -> int:
        return int(getattr(self.text_config, self.family.mtp_field, 0) or 0)

    @property
    def drafter_head_dim(self) -> int:
        """The drafter's attention head width: the target's own, or for MLA the value head width -- a
        Llama-style drafter layer cannot copy MLA's split rope/no-rope heads, and the published drafters
        of MLA targets are 128 wide (Kimi-K2/K2.5: 64 heads x 128; DeepSeek-V3: 56 heads of 7168/56),
        not transformers' DeepSeek `head_dim`, which is the rope part alone (64)."""
        c = self.text_config
        return getattr(c, self.family.drafter_head_dim, None) or c.hidden_size // c.num_attention_heads

    @property
    def quantization_config(self) -> dict | None:
        """The checkpoint's quantization_config as written (a wrapper may keep it in its text_config)."""
        raw = self.raw_config
        return raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")

    @property
    def chat_template(self) -> str | None:
        """The chat template's text as the folder ships it, read without loading the tokenizer."""
        jinja = self.path / "chat_template.jinja"
        if jinja.exists():
            return jinja.read_text()
        tok_config = self.path / "tokenizer_config.json"
        if tok_config.exists():
            template = read_json(tok_config, fix=TARGET_FIX).get("chat_template")
            return template if isinstance(template, str) else None
        return None

    def architecture(self) -> dict:
        """What kind of model this is, for STATUS.md and plan: attention kind (with MLA ranks), experts
        (routed, shared, top-k; None for a dense model), MTP layers, quantization, tied head, final-norm
        quirk, and which engines serve an EAGLE-3 drafter for it."""
        c = self.text_config
        routed = _first(c, _ROUTED_EXPERTS)
        experts = None
        if routed:
            experts = {
                "routed": int(routed),
                "shared": int(getattr(c, "n_shared_experts", 0) or 0),
                "top_k": int(_first(c, _TOP_K)),
                "intermediate_size": getattr(c, "moe_intermediate_size", None) or c.intermediate_size,
                # DeepSeek keeps its first k layers dense.
                "dense_layers": int(getattr(c, "first_k_dense_replace", 0) or 0),
            }
        return {
            "model_type": self.config.model_type,
            "text_model_type": c.model_type,
            "multimodal_wrapper": self.config is not c,
            "layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "attention": self.family.attention,
            "attention_heads": c.num_attention_heads,
            "kv_heads": getattr(c, "num_key_value_heads", None),
            "mla": {k: getattr(c, k) for k in _MLA_RANKS} if self.family.attention == "mla" else None,
            "sliding_window": getattr(c, "sliding_window", None) if self.family.attention == "gqa+sliding" else None,
            "experts": experts,
            "mtp_layers": self.mtp_layers,
            "quantization": _quantization(self.quantization_config),
            "tied_embeddings": self.tied,
            "final_norm": "rms (1+w)" if self.family.norm_offset else "rms",
            "eagle3_serving": {"vllm": self.family.vllm_eagle3, "sglang": self.family.sglang_eagle3},
        }

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            _fix_special_tokens(self._tokenizer, self.text_config)
        return self._tokenizer

    @property
    def thinking_markers(self) -> tuple[str, str] | None:
        """The (start, end) markers around the target's reasoning, or None for a model that does not think.

        The family table wins; otherwise a tokenizer that has both markers as added tokens (Qwen3, DeepSeek-R1,
        Kimi: `<think>`/`</think>`) is a thinking model.
        """
        if self.family.thinking is not None:
            return self.family.thinking
        return tokenizer_thinking_markers(self.tokenizer)

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        """Token ids of `messages` (with the tool definitions `tools`) rendered by the target's own chat template."""
        return list(
            self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
        )

    def describe(self) -> dict:
        return {
            "name": self.name,
            "path": str(self.path),
            "model_type": self.text_config.model_type,
            "architectures": self.config.architectures,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "aux_layer_ids": self.aux_layer_ids,
            "fingerprint": self.fingerprint(),
            "architecture": self.architecture(),
        }

    def fingerprint(self) -> dict:
        """Hashes that tie artifacts to this exact target: config and tokenizer."""
        cfg = {k: v for k, v in self.raw_config.items() if k != "_name_or_path"}
        tok_file = self.path / "tokenizer.json"
        return {
            "config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16],
            "tokenizer_sha256": _sha256_file(tok_file)[:16] if tok_file.exists() else None,
        }

    def load_model(self, dtype: str = "bfloat16", device: str = "cpu", device_map: str | dict | None = None):
        """The model on `device`, or placed layer by layer by a transformers `device_map` ("auto")."""
        import torch
        import transformers

        auto = getattr(transformers, self.family.auto_class)
        # safetensors only: a pytorch_model.bin is a pickle, and transformers would unpickle it.
        if not any(self.path.glob("*.safetensors")):
            refuse_pickled_weights(self.path)
        if device_map:
            return auto.from_pretrained(
                self.path, dtype=getattr(torch, dtype), device_map=device_map, use_safetensors=True
            ).eval()
        model = auto.from_pretrained(self.path, dtype=getattr(torch, dtype), use_safetensors=True)
        return model.to(resolve_device(device)).eval()

    def read_tensor(self, name: str):
        """One tensor from the checkpoint without loading the model (embeddings, lm_head)."""
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index, fix=TARGET_FIX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise TargetError(f"{index}: no 'weight_map' object; {TARGET_FIX}")
            files = [weight_map[name]] if name in weight_map else []
        else:
            files = [p.name for p in self.path.glob("*.safetensors")]
        for fname in sorted(files):
            with open_safetensors(self.path / fname, fix=TARGET_FIX) as f:
                if name in f.keys():
                    return f.get_tensor(name)
        raise TargetError(f"{self.path}: tensor {name!r} not found")

    def head_weight(self):
        """The output projection [vocab, H]; the embedding when the target ties them."""
        try:
            return self.read_tensor(self.family.head)
        except TargetError:
            if self.tied:
                return self.read_tensor(self.family.embed)
            raise

    def embed_weight(self):
        return self.read_tensor(self.family.embed)

    def final_norm_weight(self):
        """The effective weight of the target's final RMS norm [H], float32 (offset families included)."""
        return self.read_tensor(self.family.norm_weight).float() + self.family.norm_offset

    def final_norm(self, pre_norm):
        """The target's final RMS norm applied to pre-norm states [..., H] from the checkpoint's weight,
        for engines that hand out the pre-norm residual (vLLM's aux id L), in float32."""
        import torch

        w = self.final_norm_weight()
        eps = getattr(self.text_config, "rms_norm_eps", None) or self.text_config.layer_norm_eps
        x = pre_norm.float()
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _quantization(quant: dict | None) -> dict | None:
    """The checkpoint's quantization in a few words: method, weight bits and group size where given, and
    the kind of its weights ("fp8", "mxfp4", "int4": what `billing` sizes them by)."""
    if not quant:
        return None
    weights = next(iter(quant.get("config_groups", {}).values()), {}).get("weights", {})
    method, bits = quant.get("quant_method"), weights.get("num_bits")
    out = {
        "method": method,
        "format": quant.get("format") or quant.get("fmt"),
        "bits": bits,
        "group_size": weights.get("group_size"),
        "block": quant.get("weight_block_size"),
        "kind": method if method in ("fp8", "mxfp4") else f"int{bits}" if bits else method,
    }
    return {k: v for k, v in out.items() if v is not None}


def get_attr(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def cache_argument(decoder) -> str:
    """The name the decoder's forward takes its KV cache by: `cache` from transformers 5.25 on, where
    `past_key_values` still works but warns it goes in 5.40; `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


@contextlib.contextmanager
def tap_hidden_states(model, family: Family, layer_ids: list[int]):
    """Capture the aux layers' residual stream and the final-norm output during a forward.

    Aux id k is the output of decoder layer k-1 (= transformers' output_hidden_states[k]); hooks keep
    only these layers instead of materialising all of them. The "last" state is the output of the
    final norm, i.e. exactly what lm_head sees, so the trainer computes the target's logits from it
    with the lm_head weight alone.
    """
    layers = get_attr(model, family.layers)
    captured: dict = {}
    handles = []

    def keep(key):
        def hook(_module, _inputs, output):
            captured[key] = output[0] if isinstance(output, tuple) else output

        return hook

    for k in layer_ids:
        handles.append(layers[k - 1].register_forward_hook(keep(k)))
    handles.append(get_attr(model, family.norm).register_forward_hook(keep("last")))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()
