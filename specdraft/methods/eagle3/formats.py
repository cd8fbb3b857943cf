"""Writers and readers of the drafter formats that serving engines load.

vLLM ("vllm"): the speculators format, config.json with `speculators_model_type: "eagle3"` and a
`transformer_layer_config`, weights named as in vLLM's Eagle-3 Llama model.

SGLang ("sglang"): the flat format SGLang's `LlamaForCausalLMEagle3` reads (vLLM reads it too): a
one-layer Llama config with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`,
`target_hidden_size` and `eagle_config`, weights named as EAGLE/SpecForge checkpoints name them
(`midlayer.*`; vLLM renames it to `layers.0.*`).

Every field an engine reads is written explicitly, never left to its default: the speculators path
reads a missing `norm_before_residual` as True and the flat path as False (docs/engine-facts.md), so an omitted
flag would serve a different network from the one trained. The flat format carries the aux layer ids
twice, once per engine convention, because the engines count them differently:

- vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` (newer versions fall back to
  `eagle_config`'s, taken as they are), and id k is the residual stream after k decoder layers: our
  convention (targets.py).
- SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids` and captures the input of layer
  j + 1 for id j (`set_eagle3_layers_to_capture` adds 1), i.e. id j is the output of layer j: our id
  k is its k - 1.

What SGLang cannot represent is refused at export instead of served wrong: its fc is built for
exactly 3 aux states, its decoder layer always adds the un-normed hidden state as the residual (our
`norm_before_residual=False`), and it replaces the drafter's embedding with the target's whenever
`target_hidden_size == hidden_size`.

Each format is a literal key map (our name -> the format's name) and a reader that inverts it, so
export followed by import gives back the same tensors (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.drafters.common import LAYER_WEIGHTS, REEXPORT, layer_config, load_checked, read_tensors, write_tensors
from specdraft.drafters.vocab import checked_t2d
from specdraft.files import read_json
from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter
from specdraft.run import write_json

FLAT_ARCHITECTURE = "LlamaForCausalLMEagle3"

# Our state-dict names, which are the speculators/vLLM names too (vLLM names the decoder layer `layers.0`).
VLLM_KEYS = {
    k: k
    for k in (
        "fc.weight",
        *(f"layers.0.{name}.weight" for name in LAYER_WEIGHTS),
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    )
}
# Our state-dict names -> the flat (SGLang / EAGLE / SpecForge) names. SGLang loads `midlayer.*` into
# its one decoder layer, turns d2t into `hot_token_id` (i + d2t[i]) and skips t2d.
SGLANG_KEYS = {k: k.replace("layers.0.", "midlayer.") for k in VLLM_KEYS}
# Written only when the drafter's embedding differs from the target's (engines share the target's).
EMBED_KEY = ("embed_tokens.weight", "embed_tokens.weight")
# SGLang's fc takes 3 * target_hidden_size inputs whatever the config says.
SGLANG_NUM_AUX = 3
# EAGLE-3.1's optional norms (before fc, per aux state in fc, on the state fed to the next step).
EAGLE31_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def _config_from_layer(
    lc: dict,
    where: str,
    *,
    draft_vocab_size: int,
    target_hidden_size: int,
    aux_layer_ids: list[int],
    norm_before_residual: bool,
    norms: dict,
) -> DrafterConfig:
    """The inverse of `layer_config` (plus the format's own top-level fields) -> our DrafterConfig."""

    def need(key):
        if lc.get(key) is None:
            raise ValueError(f"{where}: no {key!r}")
        return lc[key]

    if lc.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {lc['hidden_act']!r}; the drafter's MLP is SiLU-gated")
    if lc.get("attention_bias") or lc.get("mlp_bias"):
        raise ValueError(f"{where}: attention/MLP biases, which the drafter does not have")
    rope = lc.get("rope_parameters") or lc.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{where}: rope_type {rope_type!r}; the drafter implements only default RoPE")
    return DrafterConfig(
        hidden_size=need("hidden_size"),
        num_attention_heads=need("num_attention_heads"),
        num_key_value_heads=lc.get("num_key_value_heads") or need("num_attention_heads"),
        head_dim=lc.get("head_dim") or need("hidden_size") // need("num_attention_heads"),
        intermediate_size=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target_hidden_size,
        aux_layer_ids=list(aux_layer_ids),
        rms_norm_eps=need("rms_norm_eps"),
        rope_theta=rope.get("rope_theta", lc.get("rope_theta", 10000.0)),
        max_position_embeddings=lc.get("max_position_embeddings", 8192),
        norm_before_residual=bool(norm_before_residual),
        **norms,
    ).check(where)


def _norm_keys(cfg: DrafterConfig) -> dict[str, str]:
    """The EAGLE-3.1 norms' tensors, named alike in our drafter and both formats (vLLM's `input_norm`
    and `fc_norm.{i}`), present only when their flag is on."""
    keys = {}
    if cfg.norm_before_fc:
        keys["input_norm.weight"] = "input_norm.weight"
    if cfg.fc_norm:
        keys.update({f"fc_norm.{i}.weight": f"fc_norm.{i}.weight" for i in range(len(cfg.aux_layer_ids))})
    return keys


def _with_embed(keys: dict[str, str], cfg: DrafterConfig, include_embed: bool) -> dict[str, str]:
    """The key map (with the norms the config turns on), plus embed_tokens when asked for or when it
    cannot be the target's (other width)."""
    keys = {**keys, **_norm_keys(cfg)}
    if include_embed or cfg.target_hidden_size != cfg.hidden_size:
        return {**keys, EMBED_KEY[0]: EMBED_KEY[1]}
    return keys


def _build(
    folder: Path,
    cfg: DrafterConfig,
    theirs: dict[str, torch.Tensor],
    keys: dict[str, str],
    embed: torch.Tensor | None,
    notes: list[str] | None = None,
) -> Eagle3Drafter:
    """Our drafter (float32, eval mode) from the format's tensors read through `keys` (ours -> theirs).

    Every tensor is required, named as the folder names it when missing, except:
    - t2d, which engines skip and which d2t determines (rebuilt when absent, checked when present);
    - d2t, which engines keep at zeros when absent (draft id i -> target id i): read so, and said so
      in `notes`, because only a full-vocabulary drafter is right that way;
    - embed_tokens, which is the target's (`embed`) when the folder has none.
    Tensors whose shapes do not fit config.json are all named, with both shapes.
    """
    notes = notes if notes is not None else []
    state = {ours: theirs[name] for ours, name in keys.items() if name in theirs}
    missing = [name for ours, name in keys.items() if ours not in state and ours not in ("t2d", "d2t")]
    if missing:
        raise ValueError(f"{folder}: missing tensor(s) {missing}")
    if EMBED_KEY[1] in theirs:
        state[EMBED_KEY[0]] = theirs[EMBED_KEY[1]]
        notes.append("embed_tokens: the drafter's own (in the folder)")
    elif embed is None:
        raise ValueError(f"{folder}: no embed_tokens in the drafter; pass the target's embedding")
    else:
        state[EMBED_KEY[0]] = embed
        notes.append("embed_tokens: not in the folder; the target's (as the engines share it)")
    if "d2t" in state:
        d2t = state["d2t"].long()
        notes.append("d2t: present (offsets)")
    else:
        d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        notes.append(
            "d2t: absent; the draft vocabulary is the full target vocabulary, no mapping needed"
            if cfg.draft_vocab_size == cfg.vocab_size
            else f"d2t: ABSENT; the engines map draft id i to target id i (0..{cfg.draft_vocab_size - 1}), "
            "almost never what the drafter was trained for (doctor fails it)"
        )
    t2d = checked_t2d(d2t, cfg.draft_vocab_size, cfg.vocab_size, state.get("t2d"), folder)
    notes.append(
        "t2d: present, consistent with d2t"
        if "t2d" in state
        else "t2d: absent; rebuilt from d2t (the engines do not read it)"
    )
    state["d2t"], state["t2d"] = d2t, t2d
    with torch.device("meta"):  # shapes only: a config.json of absurd sizes allocates nothing
        expected = Eagle3Drafter(cfg).state_dict()
    names = {**keys, EMBED_KEY[0]: EMBED_KEY[1]}  # ours -> the folder's, for the messages
    if EMBED_KEY[1] not in theirs:
        names[EMBED_KEY[0]] = "embed_tokens (the target's, shared)"
    return load_checked(Eagle3Drafter(cfg), state, expected, folder, names)


def write_vllm(
    drafter: Eagle3Drafter,
    out: Path,
    *,
    verifier: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
    include_embed: bool,
    provenance: dict,
) -> Path:
    cfg = drafter.config
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        **{flag: getattr(cfg, flag) for flag in EAGLE31_FLAGS},
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "torch_dtype": "bfloat16",
        "specdraft": provenance,
    }
    write_tensors(drafter, out, _with_embed(VLLM_KEYS, cfg, include_embed))
    write_json(out / "config.json", config)
    return out


def _read_norms(config: dict) -> dict[str, bool]:
    """EAGLE-3.1's extra norms, as vLLM reads them (top level; norm_before_fc from eagle_config first;
    False when absent) -> the DrafterConfig fields. Every one of them is read, never dropped: a served
    drafter whose norm_before_fc was lost on load accepts little."""
    eagle = config.get("eagle_config") or {}
    return {
        flag: bool(eagle.get(flag, config.get(flag, False)) if flag == "norm_before_fc" else config.get(flag, False))
        for flag in EAGLE31_FLAGS
    }


def _parse_vllm(folder: Path, config: dict) -> tuple[DrafterConfig, dict[str, str], str]:
    where = f"{folder}/config.json"
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{where}: not a speculators eagle3 config")
    for key in ("transformer_layer_config", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids"):
        if not config.get(key):
            raise ValueError(f"{where}: no {key!r}")
    norms = _read_norms(config)
    layer = config["transformer_layer_config"]
    cfg = _config_from_layer(
        layer,
        where,
        norms=norms,
        draft_vocab_size=config["draft_vocab_size"],
        # speculators writes null when it equals the drafter's width, and vLLM reads null so.
        target_hidden_size=config.get("target_hidden_size") or layer.get("hidden_size"),
        aux_layer_ids=config["eagle_aux_hidden_state_layer_ids"],
        # What vLLM assumes when the flag is absent on this path.
        norm_before_residual=config.get("norm_before_residual", True),
    )
    return cfg, {**VLLM_KEYS, **_norm_keys(cfg)}, "speculators (Eagle3Speculator, layers.0.*)"


def flat_config(cfg: DrafterConfig, provenance: dict) -> dict:
    """The flat (SGLang / vLLM `LlamaForCausalLMEagle3`) config.json of a drafter."""
    ids = list(cfg.aux_layer_ids)
    return {
        **layer_config(cfg),
        "architectures": [FLAT_ARCHITECTURE],
        # SGLang sizes lm_head from this; absent, it would take the target's full lm_head instead.
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        # vLLM's list (read before eagle_config's): id k = the residual stream after k layers (ours).
        "eagle_aux_hidden_state_layer_ids": ids,
        # SGLang's list: id j = the output of layer j, which SGLang captures as layer j + 1's input.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in ids], "use_aux_hidden_state": True},
        # vLLM reads a missing flag as False on this path; SGLang has no flag and always behaves so.
        "norm_before_residual": cfg.norm_before_residual,
        # The EAGLE-3.1 norms (vLLM reads them; all False when absent).
        **{flag: getattr(cfg, flag) for flag in EAGLE31_FLAGS},
        "specdraft": provenance,
    }


def write_sglang(drafter: Eagle3Drafter, out: Path, *, include_embed: bool, provenance: dict) -> Path:
    """The flat format, read by SGLang (and vLLM); refuses a drafter SGLang would serve differently."""
    cfg = drafter.config
    if len(cfg.aux_layer_ids) != SGLANG_NUM_AUX:
        raise ValueError(
            f"export sglang: {len(cfg.aux_layer_ids)} aux layers {cfg.aux_layer_ids}; SGLang's "
            f"EAGLE-3 fc reads exactly {SGLANG_NUM_AUX}"
        )
    if min(cfg.aux_layer_ids) < 1:
        raise ValueError(
            f"export sglang: aux layer ids {cfg.aux_layer_ids}; SGLang cannot capture the embeddings (id 0)"
        )
    if cfg.norm_before_residual:
        raise ValueError(
            "export sglang: the drafter uses norm_before_residual=True; SGLang's EAGLE-3 layer always "
            "adds the un-normed hidden state as the residual, so it would serve another network"
        )
    on = [flag for flag in EAGLE31_FLAGS if getattr(cfg, flag)]
    if on:
        raise ValueError(
            f"export sglang: the drafter uses {on}; SGLang's LlamaForCausalLMEagle3 has none of "
            "EAGLE-3.1's norms, so it would serve another network (serve it with vLLM)"
        )
    if include_embed and cfg.target_hidden_size == cfg.hidden_size:
        raise ValueError(
            "export sglang: the drafter's embedding differs from the target's, but SGLang replaces it "
            "with the target's (target_hidden_size == hidden_size), so it would serve another network"
        )
    write_tensors(drafter, out, _with_embed(SGLANG_KEYS, cfg, include_embed))
    write_json(out / "config.json", flat_config(cfg, provenance))
    return out


def _flat_aux_layer_ids(config: dict, where: str, default: list[int] | None) -> list[int]:
    """Our aux layer ids from a flat config, from either engine's list; both present must agree.
    Neither present (SpecForge writes none): the ids the engines then use, `default` (the target's
    (2, L//2, L-3), same layers in both engines), when the caller knows the target."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    eagle = config.get("eagle_config") or {}
    nested = eagle.get("eagle_aux_hidden_state_layer_ids")
    from_nested = [j + 1 for j in nested] if nested else None
    if top and from_nested and list(top) != from_nested:
        raise ValueError(
            f"{where}: eagle_aux_hidden_state_layer_ids {list(top)} (vLLM's: residual after k layers) and "
            f"eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} (SGLang's: output of layer j, k = j + 1) "
            "name different layers, so vLLM and SGLang would feed this drafter different hidden states"
        )
    ids = list(top) if top else from_nested
    if not ids:
        if default is None:
            raise ValueError(f"{where}: no aux layer ids; the engines would guess (2, L//2, L-3)")
        ids = list(default)
    if eagle.get("use_aux_hidden_state", True) is not True:
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state is not true; not an EAGLE-3 drafter")
    if config.get("num_aux_hidden_states", len(ids)) != len(ids):
        raise ValueError(
            f"{where}: num_aux_hidden_states {config['num_aux_hidden_states']} but {len(ids)} aux layer ids"
        )
    return ids


def _parse_flat(
    folder: Path, config: dict, tensor_names: set[str], default_aux_layer_ids: list[int] | None
) -> tuple[DrafterConfig, dict[str, str], str]:
    where = f"{folder}/config.json"
    if FLAT_ARCHITECTURE not in (config.get("architectures") or []):
        raise ValueError(f"{where}: architectures {config.get('architectures')} lack {FLAT_ARCHITECTURE!r}")
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: num_hidden_layers {config['num_hidden_layers']}; the drafter has one layer")
    if config.get("tie_word_embeddings"):
        raise ValueError(f"{where}: tie_word_embeddings is true; the engines would use embed_tokens as lm_head")
    if config.get("draft_vocab_size") is None:
        raise ValueError(f"{where}: no 'draft_vocab_size'; SGLang would take the target's lm_head instead")
    norms = _read_norms(config)
    cfg = _config_from_layer(
        config,
        where,
        norms=norms,
        draft_vocab_size=config["draft_vocab_size"],
        # SGLang's and vLLM's rule when absent: the drafter's own hidden size.
        target_hidden_size=config.get("target_hidden_size") or config.get("hidden_size"),
        aux_layer_ids=_flat_aux_layer_ids(config, where, default_aux_layer_ids),
        # What vLLM assumes when the flag is absent on this path (SGLang has no other behaviour).
        norm_before_residual=config.get("norm_before_residual", False),
    )
    midlayer = any(k.startswith("midlayer.") for k in tensor_names)
    layers0 = any(k.startswith("layers.0.") for k in tensor_names)
    if midlayer and layers0:
        raise ValueError(f"{folder}: both midlayer.* and layers.0.* tensors; which one is the decoder layer?")
    if layers0:
        return cfg, {**VLLM_KEYS, **_norm_keys(cfg)}, f"flat ({FLAT_ARCHITECTURE}, layers.0.*)"
    return cfg, {**SGLANG_KEYS, **_norm_keys(cfg)}, f"flat ({FLAT_ARCHITECTURE}, midlayer.*)"


@dataclass
class Published:
    """A drafter folder as read: its config and tensors under their names, the layout, and what it
    lacked or how it was read (`notes`)."""

    folder: Path
    config: DrafterConfig
    tensors: dict[str, torch.Tensor]
    keys: dict[str, str]
    layout: str
    notes: list[str]

    def build(self, embed: torch.Tensor | None) -> Eagle3Drafter:
        return _build(self.folder, self.config, self.tensors, self.keys, embed, self.notes)


def read_published(folder: Path, default_aux_layer_ids: list[int] | None = None) -> Published:
    """Any drafter folder an engine loads, parsed but not yet built: the speculators format (has
    `speculators_model_type`) or the flat one (architectures name LlamaForCausalLMEagle3)."""
    folder = Path(folder)
    config = read_json(folder / "config.json", fix=REEXPORT, what="a drafter's config")
    try:
        return _read_published(folder, config, default_aux_layer_ids)
    except (TypeError, AttributeError, KeyError, ZeroDivisionError) as e:
        # A field of the wrong kind somewhere the parsers expect an object, list or number.
        raise ValueError(f"{folder}/config.json: a field holds a value of the wrong kind ({e})") from None


def _read_published(folder: Path, config: dict, default_aux_layer_ids: list[int] | None) -> Published:
    notes: list[str] = []
    if "speculators_model_type" in config:
        tensors = read_tensors(folder)
        cfg, keys, layout = _parse_vllm(folder, config)
        if "norm_before_residual" not in config:
            notes.append("norm_before_residual: absent; read as True, as vLLM's speculators path does")
        if config.get("target_hidden_size") is None:
            notes.append(
                f"target_hidden_size: null; read as the drafter's hidden size {cfg.hidden_size}, as vLLM "
                "and speculators do"
            )
        notes += _sliding_notes(config["transformer_layer_config"])
    elif FLAT_ARCHITECTURE in (config.get("architectures") or []):
        tensors = read_tensors(folder, "model.")  # some checkpoints prefix every name
        cfg, keys, layout = _parse_flat(folder, config, set(tensors), default_aux_layer_ids)
        if "norm_before_residual" not in config:
            notes.append(
                "norm_before_residual: absent; read as False, as vLLM's flat path does (SGLang always behaves so)"
            )
        eagle = config.get("eagle_config") or {}
        if not config.get("eagle_aux_hidden_state_layer_ids") and not eagle.get("eagle_aux_hidden_state_layer_ids"):
            notes.append(f"aux layer ids: absent; the engines' default for this target, {cfg.aux_layer_ids}")
    else:
        raise ValueError(
            f"{folder}/config.json: neither a speculators config (speculators_model_type) nor a "
            f"flat EAGLE-3 one (architectures {FLAT_ARCHITECTURE})"
        )
    return Published(folder, cfg, tensors, keys, layout, notes)


def _sliding_notes(layer: dict) -> list[str]:
    """A layer config saying "sliding_attention" makes vLLM give the drafter's one layer a window; our
    drafter attends to the whole context, which is the same network on contexts up to the window."""
    if "sliding_attention" not in (layer.get("layer_types") or []) or not layer.get("sliding_window"):
        return []
    return [
        f"layer_types: sliding_attention with a window of {layer['sliding_window']} tokens; read as full "
        f"attention, the same on contexts up to {layer['sliding_window']} tokens"
    ]


def read_drafter(folder: Path, embed: torch.Tensor | None = None) -> Eagle3Drafter:
    """Any drafter folder an engine loads -> our drafter (float32): the speculators format or the
    flat one, see `read_published`."""
    return read_published(folder).build(embed)


def fit_problems(cfg: DrafterConfig, target, has_embed: bool) -> list[str]:
    """What of a drafter's shapes does not fit the target, one line each (empty: it fits)."""
    problems = []
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocab_size: drafter {cfg.vocab_size}, target {target.vocab_size} (another tokenizer)")
    if cfg.target_hidden_size != target.hidden_size:
        problems.append(
            f"target_hidden_size: drafter {cfg.target_hidden_size}, target hidden_size "
            f"{target.hidden_size} (fc reads {len(cfg.aux_layer_ids)} x {cfg.target_hidden_size})"
        )
    outside = [k for k in cfg.aux_layer_ids if not 1 <= k < target.num_layers]
    if outside:
        problems.append(
            f"aux layer ids {outside} outside 1..{target.num_layers - 1} for a target with {target.num_layers} layers"
        )
    if not has_embed and cfg.hidden_size != target.hidden_size:
        problems.append(
            f"embed_tokens: not in the folder, and the target's has width {target.hidden_size}, "
            f"not the drafter's hidden_size {cfg.hidden_size}"
        )
    return problems
