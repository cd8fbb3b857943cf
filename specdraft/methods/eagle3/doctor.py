"""doctor's checks of an EAGLE-3 folder: the failures seen in the field (docs/engine-facts.md): aux layer
ids missing or not the ones the hidden states were extracted with, d2t missing or holding absolute ids,
sizes that do not fit the target, norm flags left to an engine's default, and training data rendered
with another chat template than the one served; then the drafter's first step against the target on
real conversations.
"""

from __future__ import annotations

from pathlib import Path

from specdraft.decoding.runners import TargetRunner
from specdraft.drafters.checks import (
    FREQUENT_DRAFTS,
    MIN_COVERAGE,
    MIN_FREQUENT_SHARE,
    MIN_TOP1_AGREEMENT,
    Check,
    held_out_conversations,
    run_checks,
    target_model,
    trained_config,
    vocab_checks,
)
from specdraft.methods.eagle3.formats import EAGLE31_FLAGS, FLAT_ARCHITECTURE, read_drafter
from specdraft.targets import Target


def _config_checks(config: dict) -> list[Check]:
    """What the engines read from config.json, checked without loading any weights."""
    checks = []
    speculators = "speculators_model_type" in config
    fmt = "speculators (vLLM)" if speculators else "flat (SGLang / vLLM)"
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    checks.append(
        Check(
            "aux layer ids written",
            bool(ids),
            f"{ids}" if ids else "absent",
            "write eagle_aux_hidden_state_layer_ids; without them the engine guesses (2, L//2, L-3) "
            "(1.2 % vs 59 % acceptance in vLLM #50170)",
        )
    )
    checks.append(
        Check(
            "norm_before_residual written",
            "norm_before_residual" in config,
            f"{config.get('norm_before_residual')!r} in the {fmt} format",
            "write it explicitly: the speculators path reads it as True when absent, the flat path "
            "as False, so an absent flag serves another network on one of them",
        )
    )
    if not speculators and FLAT_ARCHITECTURE not in (config.get("architectures") or []):
        checks.append(
            Check(
                "format",
                False,
                f"architectures {config.get('architectures')}",
                f"a flat drafter needs architectures [{FLAT_ARCHITECTURE!r}]",
            )
        )
    return checks


def _target_checks(drafter, target) -> list[Check]:
    cfg = drafter.config
    L = target.num_layers
    ids = cfg.aux_layer_ids
    checks = [
        Check(
            "aux layer ids in range",
            all(1 <= k < L for k in ids),
            f"{ids} for a target with {L} layers",
            f"ids are residual streams after k layers, 1 <= k < {L}",
        ),
        Check(
            "aux layer ids ascending",
            ids == sorted(set(ids)),
            f"{ids}",
            "vLLM concatenates aux states in ascending layer order; list them so, and train fc on that order",
        ),
        Check(
            "target hidden size",
            cfg.target_hidden_size == target.hidden_size,
            f"drafter {cfg.target_hidden_size}, target {target.hidden_size}",
            "the drafter was trained for another target",
        ),
        Check(
            "fc input width",
            drafter.fc.in_features == len(ids) * target.hidden_size,
            f"{drafter.fc.in_features} = {len(ids)} aux x {target.hidden_size}?",
            "fc must read one target hidden state per aux layer",
        ),
        Check(
            "vocab size",
            cfg.vocab_size == target.vocab_size,
            f"drafter {cfg.vocab_size}, target {target.vocab_size}",
            "the drafter's token ids are not the target's; retrain on this target's tokenizer",
        ),
    ]
    text = target.text_config
    # The family's drafter head width: the target's own, except MLA targets (the value head width).
    head_dim = target.drafter_head_dim
    checks.append(
        Check(
            "head dim",
            cfg.head_dim == head_dim,
            f"drafter {cfg.num_attention_heads} heads x {cfg.head_dim}, target {text.num_attention_heads} x {head_dim}",
            "EAGLE-3 drafters take the target's attention shape; another head dim means it was "
            "built for another target",
        )
    )
    rope_params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    rope = rope_params.get("rope_theta", getattr(text, "rope_theta", None))
    if rope is not None:
        checks.append(
            Check(
                "rope theta",
                float(rope) == float(cfg.rope_theta),
                f"drafter {cfg.rope_theta}, target {rope}",
                "the drafter's positions would rotate differently from training",
            )
        )
    # The drafter implements default RoPE only (formats refuse other types on read).
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    checks.append(
        Check(
            "rope type",
            rope_type == "default",
            f"drafter default, target {rope_type}",
            f"the target scales positions ({rope_type}); a drafter with plain RoPE sees other "
            "angles than the target at long context",
        )
    )
    return checks


def _norm_flag_checks(config: dict, trained: dict | None) -> list[Check]:
    """Each norm flag as trained (the run's checkpoint, when known) against what each engine reads
    from this folder: vLLM's speculators path takes a missing norm_before_residual as True and its
    flat path as False; SGLang reads no flag and always adds the un-normed hidden state (False) and
    has none of EAGLE-3.1's norms."""
    speculators = "speculators_model_type" in config
    eagle = config.get("eagle_config") or {}
    flags = {"norm_before_residual": speculators, **{f: False for f in EAGLE31_FLAGS}}
    checks = []
    for flag, absent in flags.items():
        # vLLM's flat path reads norm_before_fc from eagle_config first.
        written = eagle.get(flag, config.get(flag)) if flag == "norm_before_fc" else config.get(flag)
        vllm = absent if written is None else bool(written)
        readings = {"vLLM": vllm}
        if not speculators:
            readings["SGLang"] = False
        want = trained.get(flag, False) if trained is not None else None
        values = set(readings.values()) | ({want} if want is not None else set())
        told = ", ".join(f"{engine} reads {v}" for engine, v in readings.items())
        detail = f"{'trained ' + str(want) + ', ' if want is not None else ''}written {written}, {told}"
        checks.append(
            Check(
                f"{flag} as served",
                len(values) == 1,
                detail,
                "write the flag as trained; SGLang cannot serve norm_before_residual=True or "
                "EAGLE-3.1 norms: serve such a drafter with vLLM",
            )
        )
    return checks


def measure(drafter, target, conversations: list[tuple[list[int], list[int]]]) -> dict:
    """The drafter against the target on real conversations (prompt ids, answer ids): one target
    forward over each, then at every answer position the drafter's first step (fed the target's aux
    states for the layers its config names, as an engine would) predicts the next token, compared
    with the target's own top-1 there. Teacher-forced on the dataset's answer rather than generated:
    one forward per conversation instead of one per token, and no bf16 near-ties in the way.

    Returns the agreement, the number of positions, the share of the target's predicted tokens inside
    the draft vocab, and the share of the drafter's most frequent predictions that the target predicts."""
    import collections

    import torch

    if target.aux_layer_ids != list(drafter.config.aux_layer_ids):
        target = Target(str(target.path), list(drafter.config.aux_layer_ids))
    runner = TargetRunner(target, target_model(target))
    drafter = drafter.float().eval()
    agree = positions = 0
    wanted: collections.Counter = collections.Counter()
    predicted: collections.Counter = collections.Counter()
    with torch.inference_mode():
        for prompt, answer in conversations:
            runner.reset()
            logits, aux = runner.forward(prompt + answer)
            ids = torch.tensor(prompt + answer)
            n, P = len(ids), len(prompt)
            top = logits.argmax(-1)[P:]  # [n-P]: the target's next token after each answer token
            # Position t reads (aux_t, x_{t+1}) and predicts x_{t+2}: the target's top-1 at t + 1.
            draft_logits, _, _ = drafter(
                drafter.project(aux[None, :-1].float()), ids[None, 1:], torch.arange(n - 1)[None]
            )  # [1, n-1, Vd]
            pred = drafter.to_target_ids(draft_logits[0, P - 1 :].argmax(-1))  # [n-P]
            agree += int((pred == top).sum())
            positions += n - P
            wanted.update(top.tolist())
            predicted.update(pred.tolist())
    target_ids = torch.tensor(list(wanted.elements()), dtype=torch.long)
    frequent = predicted.most_common(FREQUENT_DRAFTS)
    return {
        "agreement": agree / max(1, positions),
        "positions": positions,
        "conversations": len(conversations),
        "coverage": float(drafter.t2d[target_ids].float().mean()) if len(target_ids) else 0.0,
        "frequent_share": sum(c for tok, c in frequent if tok in wanted) / max(1, sum(c for _, c in frequent)),
        "frequent": [(target.tokenizer.decode([tok]), c) for tok, c in frequent],
    }


def _measured_checks(drafter, target, run_path: Path | None, conversations=None) -> list[Check]:
    held_out = conversations is None
    if held_out:
        conversations = held_out_conversations(target, run_path)
    m = measure(drafter, target, conversations)
    kind = "held-out ShareGPT" if held_out else "given"
    where = f"{m['positions']} answer positions of {m['conversations']} {kind} conversations"
    shown = ", ".join(f"{tok!r} x{c}" for tok, c in m["frequent"][:5])
    return [
        Check(
            "top-1 agreement with the target",
            m["agreement"] >= MIN_TOP1_AGREEMENT,
            f"{m['agreement']:.1%} of {where} (floor {MIN_TOP1_AGREEMENT:.0%})",
            "the drafter does not predict this target's next tokens as served: see the aux layer, d2t and "
            "norm checks; if they pass, the drafter needs more (or on-policy) training data",
            m["agreement"],
        ),
        Check(
            "draft vocab covers the target's answers",
            m["coverage"] >= MIN_COVERAGE,
            f"{m['coverage']:.1%} of the target's next tokens there",
            "d2t maps the draft vocab to tokens this target rarely writes (lost, misread or another target's), "
            "or the draft vocab was built from too little data",
            m["coverage"],
        ),
        Check(
            "frequent draft tokens are target tokens",
            m["frequent_share"] >= MIN_FREQUENT_SHARE,
            f"{m['frequent_share']:.0%} of the drafter's {FREQUENT_DRAFTS} most frequent predictions are tokens "
            f"the target predicts there too ({shown})",
            "d2t does not match the lm_head's rows (e.g. a draft vocab in another order): rebuild d2t with "
            "the drafter's own vocabulary",
            m["frequent_share"],
        ),
    ]


def diagnose(
    folder: Path,
    config: dict,
    target,
    run_path: Path | None,
    measured: bool,
    conversations: list[tuple[list[int], list[int]]] | None = None,
) -> list[Check]:
    """Every check of an EAGLE-3 folder (its config.json read as `config`)."""
    checks = _config_checks(config)
    checks += _norm_flag_checks(config, trained_config(Path(run_path)) if run_path is not None else None)
    try:
        drafter = read_drafter(folder, target.embed_weight())
    except ValueError as e:
        ours = "specdraft" in config
        fix = (
            "re-export the drafter with `specdraft export`"
            if ours
            else "the folder is not one the engines load as EAGLE-3 (or a layout specdraft cannot read yet): "
            "check it against its trainer's export"
        )
        return checks + [Check("drafter loads", False, str(e), fix)]
    own = sum(p.numel() for name, p in drafter.named_parameters() if name != "embed_tokens.weight")
    checks.append(Check("drafter loads", True, f"{own / 1e6:.2f} M parameters besides the target's embedding"))
    checks += _target_checks(drafter, target)
    counts = None
    if run_path is not None:
        found, counts = run_checks(drafter, Path(run_path), target)
        checks += found
    checks += vocab_checks(drafter, counts)
    in_range = all(1 <= k < target.num_layers for k in drafter.config.aux_layer_ids)
    fits = drafter.config.target_hidden_size == target.hidden_size and drafter.config.vocab_size == target.vocab_size
    if measured and in_range and fits:
        checks += _measured_checks(drafter, target, Path(run_path) if run_path is not None else None, conversations)
    return checks
