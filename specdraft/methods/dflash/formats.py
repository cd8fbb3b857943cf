"""The DFlash folder vLLM 0.32 loads for `method: "dflash"`: writer and reader.

The format is the one the published DFlash drafters use (z-lab, SpecForge): a Qwen3 config.json with
`architectures: ["DFlashDraftModel"]`, the DFlash fields under `dflash_config`, and the drafter's
tensors without the embedding or lm_head, which vLLM takes from the target (docs/dflash.md). vLLM
resolves the architecture to its `qwen3_dflash` drafter, whatever the target's family.

Every field vLLM reads is written, never left to its default:

- the target layers, twice, in the two conventions: `dflash_config.target_layer_ids` (id j = the
  output of target layer j, DFlash's convention, to which vLLM adds 1) and the top-level
  `eagle_aux_hidden_state_layer_ids` (ours and vLLM's: id k = the residual after k layers; vLLM reads
  it first). Both name the same states;
- `dflash_config.mask_token_id`: the mask slots' input is the target's embedding row of this id;
- `dflash_config.causal: false`: the block's attention is bidirectional (vLLM would also take a
  missing flag as false for full-attention layers, unless a top-level `is_causal` said otherwise);
- `block_size`, which vLLM does *not* read: it drafts `num_speculative_tokens` from the serve
  command, which must be block_size - 1 to draft as trained (the serve command says so);
- `layer_types` all full attention with no sliding window, and `is_neox_style: true` (the rotary
  layout vLLM assumes when absent; a mismatch is silent);
- `draft_vocab_size`: when smaller than the target's vocabulary the folder has its own `lm_head` and
  `d2t` (target id = i + d2t[i]); when equal, neither, and vLLM shares the target's lm_head.

Each tensor name is a literal key map (ours -> the folder's), and the reader inverts it, so an
export read back gives the same logits (tests/test_dflash.py).

The reader also takes the DFlash folder the speculators library writes (`speculators_model_type:
"dflash"`): the same tensor names, the layer shapes under `transformer_layer_config`, and the DFlash
fields at the top level, which it translates as vLLM does (`from_speculators`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdraft.drafters.common import REEXPORT, load_checked, read_tensors, write_tensors
from specdraft.drafters.vocab import checked_t2d
from specdraft.files import read_json
from specdraft.methods.dflash.drafter import DEFAULT_BLOCK_SIZE, DFlashConfig, DFlashDrafter
from specdraft.run import write_json

ARCHITECTURE = "DFlashDraftModel"

# Our names, which are the folder's too. vLLM prefixes each with `model.` on load (all but lm_head and d2t).
TOP_KEYS = ("fc.weight", "hidden_norm.weight", "norm.weight")
# One decoder layer's tensors ({i}: the layer's index); vLLM stacks q/k/v into qkv_proj and
# gate/up into gate_up_proj itself.
LAYER_KEYS = tuple(
    f"layers.{{i}}.{name}.weight"
    for name in (
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
)
# Only with a draft vocabulary smaller than the target's: the drafter's own lm_head and the map of its
# ids to the target's (vLLM renames d2t to draft_id_to_target_id and skips t2d).
DRAFT_VOCAB_KEYS = ("lm_head.weight", "d2t", "t2d")


def keys_for(cfg: DFlashConfig) -> dict[str, str]:
    """The key map of a drafter of this shape: ours -> the folder's."""
    names = [*TOP_KEYS, *(k.format(i=i) for i in range(cfg.num_layers) for k in LAYER_KEYS)]
    return {k: k for k in names + ([] if cfg.shares_lm_head else list(DRAFT_VOCAB_KEYS))}


def problems(cfg: DFlashConfig, target_num_layers: int) -> list[str]:
    """What would make vLLM refuse the folder, or serve it as another network, one line each."""
    out = []
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        out.append(f"mask_token_id {cfg.mask_token_id} outside the target's vocabulary 0..{cfg.vocab_size - 1}")
    outside = [k for k in cfg.aux_layer_ids if not 1 <= k < target_num_layers]
    if not cfg.aux_layer_ids:
        out.append("no target layers (aux_layer_ids is empty)")
    elif outside:
        out.append(
            f"target layers {outside} outside 1..{target_num_layers - 1} for a target of "
            f"{target_num_layers} layers (id k = the residual after k layers)"
        )
    elif list(cfg.aux_layer_ids) != sorted(set(cfg.aux_layer_ids)):
        out.append(
            f"target layers {cfg.aux_layer_ids} not strictly ascending (vLLM concatenates them in ascending order)"
        )
    if cfg.block_size < 2:
        out.append(
            f"block_size {cfg.block_size}: a block is the anchor plus at least one drafted token "
            "(vLLM needs num_speculative_tokens = block_size - 1 >= 1)"
        )
    if cfg.hidden_size != cfg.target_hidden_size:
        out.append(
            f"hidden_size {cfg.hidden_size} differs from the target's {cfg.target_hidden_size}: vLLM "
            "gives the drafter the target's embedding and lm_head, which have the target's width"
        )
    return out


def config_json(cfg: DFlashConfig, *, target_num_layers: int, provenance: dict) -> dict:
    """config.json of the DFlash folder (module docstring: why each field is there)."""
    ids = list(cfg.aux_layer_ids)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "is_neox_style": True,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "num_target_layers": target_num_layers,
        "block_size": cfg.block_size,
        # vLLM reads this list first: id k = the residual stream after k target layers (ours).
        "eagle_aux_hidden_state_layer_ids": ids,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            # DFlash's convention: id j = the output of target layer j (vLLM adds 1).
            "target_layer_ids": [k - 1 for k in ids],
            "causal": False,
            "use_aux_hidden_state": True,
        },
        "torch_dtype": "bfloat16",
        "specdraft": provenance,
    }


def write_dflash(drafter: DFlashDrafter, out: Path, *, target_num_layers: int, provenance: dict) -> Path:
    """The folder vLLM loads for method "dflash"; refuses a drafter it would not load or would serve
    as another network (`problems`), writing nothing."""
    cfg = drafter.config
    found = problems(cfg, target_num_layers)
    if found:
        raise ValueError("export dflash: " + "; ".join(found))
    out = Path(out)
    write_tensors(drafter, out, keys_for(cfg))
    write_json(out / "config.json", config_json(cfg, target_num_layers=target_num_layers, provenance=provenance))
    return out


def _target_layer_ids(config: dict, where: str) -> list[int]:
    """Our aux ids from either list vLLM reads (the top-level one first, as vLLM does); both present
    must name the same layers."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("dflash_config") or {}).get("target_layer_ids")
    from_nested = [j + 1 for j in nested] if nested else None
    if top and from_nested and list(top) != from_nested:
        raise ValueError(
            f"{where}: eagle_aux_hidden_state_layer_ids {list(top)} (residual after k layers) and "
            f"dflash_config.target_layer_ids {list(nested)} (output of layer j, k = j + 1) name "
            "different layers"
        )
    ids = list(top) if top else from_nested
    if not ids:
        raise ValueError(f"{where}: no target layers (dflash_config.target_layer_ids)")
    return ids


# What vLLM 0.32 takes for a field a DFlash config.json leaves out: it reads the folder as transformers'
# Qwen3Config (5.19 in its venv), whose defaults these are (measured with vLLM's own get_config: no
# rope_theta gives 10,000, so vLLM's 1,000,000 default for DFlash never applies; no head_dim gives 128,
# not hidden_size / heads; no num_key_value_heads gives 32, not num_attention_heads).
VLLM_DEFAULTS = {
    "head_dim": 128,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
}
# Fields vLLM refuses to load as null (transformers' strict config fields); a null num_key_value_heads
# means num_attention_heads there.
NOT_NULL = ("head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta")


def _refusals(config: dict, dflash: dict, where: str) -> None:
    """The folders our drafter would run as another network than vLLM does: refused, with the reason."""
    if config.get("is_causal") or dflash.get("causal"):
        raise ValueError(f"{where}: causal block attention; this drafter's block attention is bidirectional")
    if dflash.get("use_swa") or "sliding_attention" in (config.get("layer_types") or []):
        raise ValueError(f"{where}: sliding-window layers; this drafter implements full attention only")
    if config.get("attention_bias") or dflash.get("attention_sink_bias") or dflash.get("attention_value_scale"):
        raise ValueError(f"{where}: attention biases, sinks or a value scale, which this drafter does not have")
    if config.get("is_neox_style", True) is not True:
        raise ValueError(f"{where}: is_neox_style false; this drafter rotates in the NeoX layout")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {config['hidden_act']!r}; the drafter's MLP is SiLU-gated")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{where}: rope_type {rope.get('rope_type')!r}; the drafter implements only default RoPE")
    nulls = [k for k in NOT_NULL if k in config and config[k] is None]
    if nulls:
        raise ValueError(f"{where}: {nulls} null, which vLLM refuses to load; give the values or leave the fields out")


def _defaulted(config: dict, dflash: dict, notes: list[str]) -> dict:
    """The fields vLLM reads with a default when absent, as vLLM reads them; each default taken is noted."""

    def read(key, default, why):
        if config.get(key) is not None:
            return config[key]
        notes.append(f"{key}: absent, read as {default} ({why})")
        return default

    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        theta = VLLM_DEFAULTS["rope_theta"]
        notes.append(f"rope_theta: absent, read as {theta:g} (vLLM's Qwen3 config default)")
    vocab = config["vocab_size"]
    kv_default = (
        config["num_attention_heads"] if "num_key_value_heads" in config else VLLM_DEFAULTS["num_key_value_heads"]
    )
    mask = dflash.get("mask_token_id")
    if mask is None and config.get("mask_token_id") is not None:
        mask = config["mask_token_id"]
        notes.append(f"mask_token_id: read from the top level ({mask}), as vLLM does without dflash_config's")
    # vLLM never reads block_size (it drafts the serve command's K); the published drafters' block is 16.
    block = config.get("block_size") or dflash.get("block_size")
    if block is None:
        block = DEFAULT_BLOCK_SIZE
        notes.append(
            f"block_size: absent (vLLM never reads it), taken as {block}: serve it with "
            f"num_speculative_tokens {block - 1} unless its trainer says otherwise"
        )
    return {
        "num_key_value_heads": read("num_key_value_heads", kv_default, "vLLM's Qwen3 config default"),
        "head_dim": read("head_dim", VLLM_DEFAULTS["head_dim"], "vLLM's Qwen3 config default"),
        "draft_vocab_size": read("draft_vocab_size", vocab, "the target's vocabulary, through its lm_head"),
        "target_hidden_size": read("target_hidden_size", config["hidden_size"], "vLLM: hidden_size"),
        "rms_norm_eps": read("rms_norm_eps", VLLM_DEFAULTS["rms_norm_eps"], "vLLM's Qwen3 config default"),
        "max_position_embeddings": read(
            "max_position_embeddings", VLLM_DEFAULTS["max_position_embeddings"], "vLLM's Qwen3 config default"
        ),
        "rope_theta": float(theta),
        "mask_token_id": mask,
        "block_size": block,
    }


# ---------------------------------------------------------------------------------------------------
# The speculators library's DFlash folder (`speculators_model_type: "dflash"`), read as vLLM reads it:
# vLLM builds its DFlash config from `transformer_layer_config` as written plus the speculators fields
# (its `update_dflash`), then loads the same tensor names as above. speculators counts the target
# layers as vLLM's top-level list does (id k = the residual after k layers, ours), and vLLM derives
# dflash_config.target_layer_ids = k - 1 from them.

SPECULATORS_TYPE = "dflash"
# Layer fields vLLM has no default for on this path: its config is transformer_layer_config as written,
# with no Qwen3 config behind it, so a missing one fails to load there.
SPECULATORS_LAYER_NEEDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "num_hidden_layers",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "hidden_act",
)
# vLLM's DFlash layer's theta for a config without one (not Qwen3's 10,000: no Qwen3 config here).
SPECULATORS_ROPE_THETA = 1_000_000.0


def is_speculators(config: dict) -> bool:
    """A speculators DFlash config (which names the DFlashDraftModel architecture too)."""
    return config.get("speculators_model_type") == SPECULATORS_TYPE


def is_dflash(config: dict) -> bool:
    """A DFlash drafter's config.json, in vLLM's own form or speculators'."""
    return isinstance(config, dict) and (ARCHITECTURE in (config.get("architectures") or []) or is_speculators(config))


def speculators_k(config: dict) -> int | None:
    """Tokens per round vLLM drafts for a speculators folder: its first proposal method's."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens")
    return k if isinstance(k, int) else None


def _speculators_refusals(config: dict, layer: dict, where: str) -> None:
    """What vLLM would not load, or our drafter cannot be: refused, with the reason."""
    absent = [k for k in SPECULATORS_LAYER_NEEDS if layer.get(k) is None]
    if absent:
        raise ValueError(
            f"{where}: transformer_layer_config has no {absent}, without which vLLM cannot build the drafter"
        )
    mask = config.get("mask_token_id")
    if not isinstance(mask, int):
        raise ValueError(
            f"{where}: mask_token_id {mask!r}; vLLM requires the id of the token that fills the mask slots"
        )
    ids = config.get("aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(k, int) for k in ids):
        raise ValueError(f"{where}: aux_hidden_state_layer_ids {ids!r}; vLLM requires a list of target layer ids")
    if config.get("sample_from_anchor"):
        raise ValueError(
            f"{where}: sample_from_anchor true (the anchor slot drafts a token too); specdraft's "
            "DFlash drafter drafts from the mask slots only"
        )
    if layer.get("is_causal"):  # vLLM reads it before dflash_config.causal
        raise ValueError(
            f"{where}: transformer_layer_config.is_causal true: vLLM serves the block attention "
            "causal; specdraft's DFlash drafter attends both ways within the block"
        )
    non_causal = config.get("sliding_window_non_causal", True)  # vLLM: causal = not this, in every layer
    if layer.get("is_causal") is None and not non_causal:
        raise ValueError(
            f"{where}: sliding_window_non_causal {json.dumps(non_causal)}, which vLLM reads as causal "
            "attention within the block in every layer; specdraft's DFlash drafter attends both ways "
            "(as speculators trains full-attention layers)"
        )


def _speculators_block(config: dict, notes: list[str]) -> int | None:
    """block_size, which vLLM does not read: it drafts speculators_config's K per round."""
    block, k = config.get("block_size"), speculators_k(config)
    if block is None and k is not None:
        notes.append(
            f"block_size: absent; read as speculative_tokens + 1 = {k + 1} (vLLM drafts "
            f"speculators_config's {k} per round)"
        )
        return k + 1
    if block is not None and k is not None and k != block - 1:
        notes.append(
            f"speculative_tokens {k}: vLLM drafts {k} per round, not block_size - 1 = {block - 1} (doctor fails it)"
        )
    return block


def _speculators_fields(config: dict, layer: dict, notes: list[str]) -> dict:
    """The fields vLLM reads with a default on this path, as it reads them; each default noted."""
    hidden, vocab = layer["hidden_size"], layer["vocab_size"]

    def read(key, default, why):
        if config.get(key) is not None:
            return config[key]
        notes.append(f"{key}: {'null' if key in config else 'absent'}; read as {why}")
        return default

    fields = {
        "target_hidden_size": read("target_hidden_size", hidden, f"the drafter's hidden size {hidden}, as vLLM does"),
        "draft_vocab_size": read(
            "draft_vocab_size", vocab, f"the whole vocabulary, {vocab}, as vLLM does (the target's lm_head, shared)"
        ),
    }
    read("sample_from_anchor", False, "false, as vLLM does (the anchor slot drafts nothing)")
    if layer.get("is_causal") is None and "sliding_window_non_causal" not in config:
        notes.append(
            "sliding_window_non_causal: absent; read as true, as vLLM does (attention within the block both ways)"
        )
    if layer.get("head_dim") is None:
        fields["head_dim"] = hidden // layer["num_attention_heads"]
        notes.append(
            f"head_dim: absent; read as hidden_size / num_attention_heads = {fields['head_dim']}, as vLLM does"
        )
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if rope.get("rope_theta", layer.get("rope_theta")) is None:
        fields["rope_parameters"] = {"rope_type": "default", **rope, "rope_theta": SPECULATORS_ROPE_THETA}
        notes.append(f"rope_theta: absent; read as {SPECULATORS_ROPE_THETA:g}, vLLM's DFlash default")
    if "is_neox_style" not in layer:
        fields["is_neox_style"] = True
        notes.append("is_neox_style: absent; read as true, as vLLM does (the layout speculators rotates in)")
    return fields


def from_speculators(config: dict, where: str, notes: list[str]) -> dict:
    """A speculators DFlash config.json -> the DFlash config vLLM builds from it (the form `parse_config`
    reads), refusing what vLLM would not load or our drafter cannot be; defaults taken are appended to
    `notes`, and the layer ids' translation too."""
    try:
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"{where}: no transformer_layer_config (the drafter's layers)")
        _speculators_refusals(config, layer, where)
        ids = list(config["aux_hidden_state_layer_ids"])
        notes.append(
            f"aux_hidden_state_layer_ids {ids}: vLLM's target_layer_ids {[k - 1 for k in ids]} (the "
            f"output of layer j = k - 1), i.e. the residual after k layers, specdraft's {ids}"
        )
        native = {
            **layer,
            **_speculators_fields(config, layer, notes),
            "architectures": [ARCHITECTURE],
            "eagle_aux_hidden_state_layer_ids": ids,
            "dflash_config": {
                "mask_token_id": config["mask_token_id"],
                "target_layer_ids": [k - 1 for k in ids],
                "sample_from_anchor": False,
                "causal": False,
            },
        }
        block = _speculators_block(config, notes)
        return native if block is None else {**native, "block_size": block}
    except (TypeError, AttributeError, KeyError, IndexError) as e:
        # A field of the wrong kind where an object, list or number belongs.
        raise ValueError(f"{where}: a field holds a value of the wrong kind ({e!r})") from None


def parse_config(config: dict, where: str, notes: list[str] | None = None) -> DFlashConfig:
    """A DFlash config.json (vLLM's own form, or speculators') -> our DFlashConfig, read as vLLM reads it
    (absent fields take vLLM's defaults, each appended to `notes`), refusing what our drafter does not
    implement."""
    notes = notes if notes is not None else []
    if is_speculators(config):
        config = from_speculators(config, where, notes)
    if ARCHITECTURE not in (config.get("architectures") or []):
        raise ValueError(f"{where}: architectures {config.get('architectures')} lack {ARCHITECTURE!r}")
    dflash = config.get("dflash_config") or {}
    _refusals(config, dflash, where)
    absent = [
        k
        for k in ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size")
        if config.get(k) is None
    ]
    if absent:
        raise ValueError(f"{where}: no {absent}")
    fields = _defaulted(config, dflash, notes)
    if fields["mask_token_id"] is None:
        raise ValueError(f"{where}: no 'mask_token_id' (dflash_config.mask_token_id): the mask slots' token")
    return DFlashConfig(
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"],
        aux_layer_ids=_target_layer_ids(config, where),
        **fields,
    )


def _vocab_map(state: dict, cfg: DFlashConfig, folder: Path) -> None:
    """d2t and t2d into `state`: none for a drafter over the whole vocabulary; else d2t must hold offsets
    to ids of the target's vocabulary (vLLM adds them unchecked), and t2d, which vLLM skips, is rebuilt
    from it, or checked against it when the folder has one."""
    if cfg.shares_lm_head:
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        return
    d2t = state["d2t"].long()
    state["t2d"] = checked_t2d(d2t, cfg.draft_vocab_size, cfg.vocab_size, state.get("t2d"), folder)
    state["d2t"] = d2t


def read_dflash(
    folder: Path, embed: torch.Tensor, lm_head: torch.Tensor | None = None, notes: list[str] | None = None
) -> DFlashDrafter:
    """A DFlash folder -> our drafter (float32, eval mode). `embed` is the target's embedding, and
    `lm_head` the target's lm_head weight when the folder drafts over the whole vocabulary (both are
    what vLLM gives the drafter). Every tensor the config needs must be there, named when missing;
    config fields read with vLLM's defaults are appended to `notes`."""
    folder = Path(folder)
    path = folder / "config.json"
    cfg = parse_config(read_json(path, fix=REEXPORT, what="a drafter's config"), str(path), notes)
    theirs = read_tensors(folder, "model.")
    keys = keys_for(cfg)
    state = {ours: theirs[name] for ours, name in keys.items() if name in theirs}
    missing = [name for ours, name in keys.items() if ours not in state and ours != "t2d"]
    if missing:
        raise ValueError(f"{folder}: missing tensor(s) {missing}")
    state["embed_tokens.weight"] = theirs.get("embed_tokens.weight", embed)
    if cfg.shares_lm_head:
        state["lm_head.weight"] = theirs.get("lm_head.weight", lm_head if lm_head is not None else embed)
    _vocab_map(state, cfg, folder)
    drafter = DFlashDrafter(cfg)
    return load_checked(drafter, state, drafter.state_dict(), folder)
