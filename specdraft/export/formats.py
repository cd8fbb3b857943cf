"""Writers and readers of the drafter formats that serving engines load.

vLLM ("vllm"): the speculators format, config.json with `speculators_model_type: "eagle3"` and a
`transformer_layer_config`, weights named as in vLLM's Eagle-3 Llama model. Every field the engine
reads is written explicitly, never left to its default: the speculators path reads a missing
`norm_before_residual` as True and the flat path as False (FACTS.md), so an omitted flag would serve
a different network from the one trained.

Each format is a literal key map (our name -> the format's name) and a reader that inverts it, so
export followed by import gives back the same tensors (tested).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..drafter.model import DrafterConfig, Eagle3Drafter
from ..run import write_json

# Our state-dict names -> the speculators/vLLM names. vLLM names the decoder layer `layers.0`, as we do.
VLLM_KEYS = {
    "fc.weight": "fc.weight",
    "layers.0.input_layernorm.weight": "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight": "layers.0.hidden_norm.weight",
    "layers.0.self_attn.q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight": "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight": "layers.0.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}
# Written only when the drafter's embedding differs from the target's (engines share the target's).
EMBED_KEY = ("embed_tokens.weight", "embed_tokens.weight")


def layer_config(cfg: DrafterConfig) -> dict:
    """The one-layer Llama config the engine builds the drafter's decoder layer from."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        # vLLM sizes fc's input from this field (default 3) and ignores the top-level aux id list.
        "num_aux_hidden_states": len(cfg.aux_layer_ids),
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def write_vllm(drafter: Eagle3Drafter, out: Path, *, verifier: str, verifier_architectures: list[str],
               speculative_tokens: int, include_embed: bool, provenance: dict) -> Path:
    from safetensors.torch import save_file

    from ..run import atomic_path

    cfg = drafter.config
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
        "torch_dtype": "bfloat16",
        "specdraft": provenance,
    }
    state = drafter.state_dict()
    keys = dict(VLLM_KEYS)
    if include_embed:
        keys[EMBED_KEY[0]] = EMBED_KEY[1]
    tensors = {}
    for ours, theirs in keys.items():
        t = state[ours].detach()
        tensors[theirs] = (t if not t.is_floating_point() else t.to(torch.bfloat16)).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(tensors, str(tmp))
    write_json(out / "config.json", config)
    return out


def read_vllm(folder: Path, embed: torch.Tensor | None = None) -> Eagle3Drafter:
    """A speculators-format folder -> our drafter (float32), for eval, fine-tuning and round trips."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{folder}/config.json: not a speculators eagle3 config")
    lc = config["transformer_layer_config"]
    cfg = DrafterConfig(
        hidden_size=lc["hidden_size"],
        num_attention_heads=lc["num_attention_heads"],
        num_key_value_heads=lc["num_key_value_heads"],
        head_dim=lc.get("head_dim") or lc["hidden_size"] // lc["num_attention_heads"],
        intermediate_size=lc["intermediate_size"],
        vocab_size=lc["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        target_hidden_size=config["target_hidden_size"],
        aux_layer_ids=list(config["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=lc["rms_norm_eps"],
        rope_theta=lc.get("rope_parameters", {}).get("rope_theta", lc.get("rope_theta", 10000.0)),
        max_position_embeddings=lc["max_position_embeddings"],
        # What vLLM assumes when the flag is absent on this path.
        norm_before_residual=config.get("norm_before_residual", True),
    )
    theirs = load_file(str(folder / "model.safetensors"))
    inverse = {v: k for k, v in {**VLLM_KEYS, EMBED_KEY[0]: EMBED_KEY[1]}.items()}
    state = {inverse[k]: v for k, v in theirs.items() if k in inverse}
    missing = set(VLLM_KEYS) - set(state)
    if missing:
        raise ValueError(f"{folder}/model.safetensors: missing {sorted(missing)}")
    if "embed_tokens.weight" not in state:
        if embed is None:
            raise ValueError(f"{folder}: no embed_tokens in the drafter; pass the target's embedding")
        state["embed_tokens.weight"] = embed
    drafter = Eagle3Drafter(cfg)
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return drafter.eval()


def provenance(run_name: str) -> dict:
    return {"run": run_name, "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def serve_command(target_path: str, drafter_dir: Path, speculative_tokens: int) -> str:
    spec = json.dumps({"method": "eagle3", "model": str(Path(drafter_dir).resolve()),
                       "num_speculative_tokens": speculative_tokens})
    return f"vllm serve {target_path} --speculative-config '{spec}'"


def run(recipe, run) -> dict:
    from ..train import load_trained

    cfg = recipe.export
    t_start = time.time()
    drafter, target, embed = load_trained(recipe, run)
    unknown = set(cfg.formats) - {"vllm"}
    if unknown:
        raise ValueError(f"export: unknown format(s) {sorted(unknown)}; known: ['vllm']")
    written = {}
    # The embedding is frozen at the target's during training, so the engine's shared copy is identical.
    include_embed = not torch.equal(drafter.embed_tokens.weight.detach(), embed.float())
    out = write_vllm(drafter, run.path / "export" / "vllm", verifier=str(target.path),
                     verifier_architectures=list(target.config.architectures or []),
                     speculative_tokens=cfg.speculative_tokens, include_embed=include_embed,
                     provenance=provenance(recipe.name))
    written["vllm"] = {"path": str(out.relative_to(run.path)), "format": "speculators (Eagle3Speculator)"}
    command = serve_command(str(target.path), out, cfg.speculative_tokens)
    print(f"export: vLLM drafter in {out}\n  serve it with:\n  {command}")
    return run.record("export", state="done", config=cfg, counts={"formats": len(written)},
                      seconds=time.time() - t_start,
                      extra={"folders": written, "serve_command": command, "embed_included": include_embed})
