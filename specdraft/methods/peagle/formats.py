"""P-EAGLE's engine folder, written and read: the speculators format with `speculators_model_type:
"peagle"` (what the speculators library writes for P-EAGLE), which vLLM 0.32 serves as
`{"method": "eagle3", "parallel_drafting": true}` (transformers_utils/configs/speculators/base.py) on its
EAGLE-3 Llama model (registry: PeagleLlamaForCausalLM -> Eagle3LlamaForCausalLM).

config.json: EAGLE-3's speculators fields (`transformer_layer_config` with its num_hidden_layers, draft_vocab_size,
target_hidden_size, eagle_aux_hidden_state_layer_ids, norm_before_residual, norm_before_fc) plus

- `mask_token_id`: the mask slots' token (vLLM's peagle reader makes it `pard_token`, the token
  llm_base_proposer._init_parallel_drafting_params feeds the mask slots); required;
- `para_depths`: the K it was trained for (the speculators library's name); vLLM does not read it, it
  drafts speculators_config's `speculative_tokens` (or the serve command's K) whatever was trained.

Weights: EAGLE-3's names (`layers.N.*`, fc, norm, lm_head, d2t, t2d) plus `mask_hidden` (fc's input
width, n_aux x target hidden: vLLM views it as [1, width] and refuses a folder without it when drafting
in parallel; llama_eagle3.py load_weights).

What makes a folder P-EAGLE's (`owns`): the peagle model type, or an EAGLE-3 speculators folder that
names a mask token (a P-EAGLE drafter that lost its parallel flag: vLLM would serve it one token per
forward and drop mask_hidden; `problems` says so).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdraft.drafters.common import LAYER_WEIGHTS, REEXPORT, layer_config
from specdraft.drafters.vocab import checked_t2d
from specdraft.files import load_safetensors, read_json, save_safetensors
from specdraft.methods.peagle.drafter import PEagleConfig, PEagleDrafter
from specdraft.run import atomic_path, write_json
from specdraft.targets import refuse_pickled_weights

WEIGHTS = "model.safetensors"
MODEL_TYPE = "peagle"


def weight_keys(cfg: PEagleConfig) -> tuple[str, ...]:
    """Our state-dict names, which are also the folder's (vLLM's Eagle-3 Llama names, every layer's, d2t
    and t2d included; input_norm where norm_before_fc)."""
    layers = (f"layers.{i}.{m}.weight" for i in range(cfg.num_layers) for m in LAYER_WEIGHTS)
    norm = ("input_norm.weight",) if cfg.norm_before_fc else ()
    return ("fc.weight", *layers, "norm.weight", "lm_head.weight", "mask_hidden", "d2t", "t2d", *norm)


EMBED = "embed_tokens.weight"  # written only when it differs from the target's (vLLM shares the target's)


def is_peagle(config: dict) -> bool:
    """A P-EAGLE folder's config.json (module docstring)."""
    kind = config.get("speculators_model_type")
    return kind == MODEL_TYPE or (kind == "eagle3" and "mask_token_id" in config)


def served_k(config: dict) -> int | None:
    """The K vLLM drafts for a speculators folder served from its own config (None: not written)."""
    try:
        k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    except (KeyError, IndexError, TypeError):
        return None
    return k if type(k) is int else None


def problems(config: dict) -> list[tuple[str, str]]:
    """What of a P-EAGLE folder's config.json vLLM would refuse or serve as another network, without the
    target: (problem, fix) pairs. Empty: it is served as trained."""
    found = []
    mask, trained, k = config.get("mask_token_id"), config.get("para_depths"), served_k(config)
    if type(mask) is not int or mask < 0:
        found.append(
            (
                f"mask_token_id {mask!r}: no mask token for the mask slots (vLLM refuses parallel drafting "
                "without one)",
                "write the mask token the drafter was trained with as mask_token_id",
            )
        )
    if config.get("speculators_model_type") != MODEL_TYPE:
        found.append(
            (
                f"speculators_model_type {config.get('speculators_model_type')!r}: the parallel flag is "
                "missing, so vLLM serves it one token per forward and drops mask_hidden",
                f"set speculators_model_type to {MODEL_TYPE!r} (vLLM then serves it with parallel_drafting: true)",
            )
        )
    if trained is not None and (type(trained) is not int or trained < 1):
        found.append((f"para_depths {trained!r} is not a K", "write the K it was trained for as para_depths"))
    elif type(trained) is int and k is not None and k > trained:
        found.append(
            (
                f"speculative_tokens {k} > para_depths {trained}: slots past the trained K draft from "
                "mask slots it never learnt",
                f"serve at most {trained} speculative tokens (set "
                f"speculators_config.proposal_methods[0].speculative_tokens to <= {trained})",
            )
        )
    return found


def folder_config(
    cfg: PEagleConfig, *, verifier: str, verifier_architectures: list[str], speculative_tokens: int, provenance: dict
) -> dict:
    return {
        "architectures": ["PEagleSpeculator"],
        "speculators_model_type": MODEL_TYPE,
        "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        # Written explicitly: vLLM's peagle reader takes both as False when absent.
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "mask_token_id": cfg.mask_token_id,
        "para_depths": cfg.speculative_tokens,
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "torch_dtype": "bfloat16",
        "specdraft": provenance,
    }


def write_peagle(
    drafter: PEagleDrafter,
    out: Path,
    *,
    verifier: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    include_embed: bool,
    provenance: dict,
) -> Path:
    """The folder vLLM serves; refused, before anything is written, where `problems` finds any."""
    cfg = drafter.config
    config = folder_config(
        cfg,
        verifier=verifier,
        verifier_architectures=verifier_architectures,
        speculative_tokens=speculative_tokens,
        provenance=provenance,
    )
    found = problems(config)
    if found:
        raise ValueError("export: " + "; ".join(f"{p} ({fix})" for p, fix in found))
    keys = list(weight_keys(cfg))
    keys += [EMBED] if include_embed else []
    state = drafter.state_dict()
    tensors = {
        k: (state[k].detach().to(torch.bfloat16) if state[k].is_floating_point() else state[k]).contiguous()
        for k in keys
    }
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS) as tmp:
        save_safetensors(tensors, tmp)
    write_json(out / "config.json", config)
    return out


def read_config(folder: Path) -> dict:
    return read_json(Path(folder) / "config.json", fix=REEXPORT, what="a drafter's config")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = [folder / WEIGHTS] if (folder / WEIGHTS).exists() else sorted(folder.glob("*.safetensors"))
    if not files:
        refuse_pickled_weights(folder)
        raise ValueError(f"{folder}: no weights (*.safetensors)")
    tensors = {}
    for f in files:
        tensors.update({k.removeprefix("model."): v for k, v in load_safetensors(f, fix=REEXPORT).items()})
    return tensors


def parse_config(config: dict, where: str) -> PEagleConfig:
    """config.json -> our config (vLLM's defaults where a field is absent); refuses what the drafter
    cannot be, in one line naming `where`."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: no transformer_layer_config")
    for key in ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids"):
        if not config.get(key):
            raise ValueError(f"{where}: no {key!r}")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default" or layer.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: a rope type or activation the drafter does not implement")
    try:
        return PEagleConfig(
            hidden_size=layer["hidden_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            intermediate_size=layer["intermediate_size"],
            vocab_size=layer["vocab_size"],
            draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            mask_token_id=config.get("mask_token_id"),
            # A peer folder that does not say what K it was trained for: the K it is served with.
            speculative_tokens=config.get("para_depths") or served_k(config) or 1,
            aux_layer_ids=list(config["eagle_aux_hidden_state_layer_ids"]),
            rms_norm_eps=layer["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)),
            max_position_embeddings=layer.get("max_position_embeddings", 8192),
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            norm_before_fc=bool(config.get("norm_before_fc", False)),
            num_layers=layer.get("num_hidden_layers", 1),
        ).check(where)
    except (KeyError, TypeError, ZeroDivisionError) as e:
        raise ValueError(f"{where}: a field is missing or of the wrong kind ({e})") from None


def read_peagle(folder: Path, embed: torch.Tensor, notes: list[str] | None = None) -> PEagleDrafter:
    """A P-EAGLE folder -> our drafter (float32, eval mode), on the target's `embed` unless the folder
    ships its own; every missing or misshapen tensor named."""
    folder, notes = Path(folder), notes if notes is not None else []
    where = f"{folder}/config.json"
    config = read_config(folder)
    found = problems(config)
    if found:
        raise ValueError(f"{where}: " + "; ".join(f"{p} ({fix})" for p, fix in found))
    cfg = parse_config(config, where)
    theirs = _tensors(folder)
    keys = [k for k in weight_keys(cfg) if k not in ("d2t", "t2d")]
    missing = [k for k in keys if k not in theirs]
    if missing:
        raise ValueError(
            f"{folder}: missing tensor(s) {missing}"
            + (
                " (mask_hidden: the mask slots' hidden input; vLLM refuses parallel drafting without it)"
                if "mask_hidden" in missing
                else ""
            )
        )
    with torch.device("meta"):
        expected = PEagleDrafter(cfg).state_dict()
    state = {k: theirs[k] for k in keys}
    state["mask_hidden"] = state["mask_hidden"].reshape(-1)  # vLLM views it as [1, width]: any shape of that size
    state[EMBED] = theirs.get(EMBED, embed)
    notes.append("embed_tokens: the folder's own" if EMBED in theirs else "embed_tokens: the target's (shared)")
    d2t = theirs["d2t"].long() if "d2t" in theirs else torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "d2t" not in theirs:
        notes.append("d2t: absent; vLLM maps draft id i to target id i")
    misfits = [
        f"{k}: {list(v.shape)} given, config.json needs {list(expected[k].shape)}"
        for k, v in state.items()
        if v.shape != expected[k].shape
    ]
    if misfits:
        raise ValueError(f"{folder}: the tensors do not fit config.json: " + "; ".join(misfits))
    state["d2t"] = d2t
    state["t2d"] = checked_t2d(d2t, cfg.draft_vocab_size, cfg.vocab_size, theirs.get("t2d"), folder)
    drafter = PEagleDrafter(cfg)
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return drafter.eval()
