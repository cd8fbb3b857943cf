"""doctor's checks of a P-EAGLE folder (formats.py): what vLLM would refuse or serve as another network
(the parallel flag, the mask token, mask_hidden and its width, the K served against the K trained, the
aux layer ids), the drafter against the target and the run that trained it, and its first slot against
the target on real conversations.
"""

from __future__ import annotations

import math
from pathlib import Path

from specdraft.decoding.runners import TargetRunner
from specdraft.drafters.checks import (
    MIN_TOP1_AGREEMENT,
    Check,
    agrees_with_training,
    held_out_conversations,
    mask_token_unused,
    run_checks,
    target_model,
    vocab_checks,
)
from specdraft.drafters.common import REEXPORT
from specdraft.files import FileError, open_safetensors
from specdraft.methods.peagle.formats import MODEL_TYPE, WEIGHTS, read_peagle, served_k
from specdraft.targets import Target


def _config_checks(config: dict, target) -> list[Check]:
    """config.json alone, as vLLM reads it."""
    kind, mask, trained, k = (
        config.get("speculators_model_type"),
        config.get("mask_token_id"),
        config.get("para_depths"),
        served_k(config),
    )
    tok = target.tokenizer
    reserved = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} - {None}
    mask_ok = type(mask) is int and 0 <= mask < target.vocab_size and mask not in reserved
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    L = target.num_layers
    return [
        Check(
            "parallel flag",
            kind == MODEL_TYPE,
            f"speculators_model_type {kind!r}",
            f"set speculators_model_type to {MODEL_TYPE!r}: vLLM then serves it with parallel_drafting: true; "
            "as 'eagle3' it drafts one token per forward and drops mask_hidden",
        ),
        Check(
            "mask token",
            mask_ok,
            f"mask_token_id {mask!r}"
            + (f" ({tok.convert_ids_to_tokens(mask)!r})" if mask_ok else "")
            + f" in a vocabulary of {target.vocab_size}",
            "write the mask token the drafter was trained with as mask_token_id: an id of the target's "
            "vocabulary that is not bos / eos / pad (vLLM refuses parallel drafting without one)",
        ),
        Check(
            "K served <= K trained",
            type(trained) is int and (k is None or k <= trained),
            f"speculative_tokens {k}, para_depths {trained!r}",
            f"serve at most para_depths speculative tokens (speculators_config.proposal_methods[0]."
            f"speculative_tokens <= {trained}); write para_depths, the K it was trained for",
        ),
        Check(
            "aux layer ids",
            bool(ids) and all(type(i) is int and 1 <= i < L for i in ids) and ids == sorted(set(ids)),
            f"{ids} for a target of {L} layers",
            f"write eagle_aux_hidden_state_layer_ids: ascending residual ids 1 <= k < {L}, the extracted ones",
        ),
    ]


def _mask_hidden_check(folder: Path, config: dict, target) -> Check:
    """mask_hidden in the weights, of fc's input width (vLLM refuses a parallel drafter without it)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    width = len(ids) * (config.get("target_hidden_size") or target.hidden_size)
    try:
        f = open_safetensors(folder / WEIGHTS, fix=REEXPORT)
    except FileError as e:
        return Check("mask_hidden", False, str(e), REEXPORT)
    with f:
        names = {n.removeprefix("model."): n for n in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        n = f.get_slice(names["mask_hidden"]).get_shape() if "mask_hidden" in names else None
    size = None if n is None else math.prod(n)
    return Check(
        "mask_hidden",
        size == width and width > 0,
        "absent" if n is None else f"shape {list(n)}, {size} values for {len(ids)} aux x target hidden = {width}",
        "write mask_hidden, the mask slots' learned hidden input of width n_aux x target hidden (re-export)",
    )


def _run_checks(drafter, run_path: Path, target) -> tuple[list[Check], object]:
    cfg = drafter.config
    checks = agrees_with_training(cfg, run_path, ("mask_token_id", "speculative_tokens", "aux_layer_ids"))
    more, counts = run_checks(drafter, run_path, target)
    more += mask_token_unused(counts, cfg.mask_token_id)
    return checks + more, counts


def measure(drafter, target, conversations) -> dict:
    """Every slot against the target, teacher-forced on real conversations: one target forward each,
    then the block anchored at every answer position (objective.slot_logits), slot i compared with the
    target's own top-1 at t + 1 + i."""
    import torch

    from specdraft.methods.peagle.objective import slot_logits

    if target.aux_layer_ids != list(drafter.config.aux_layer_ids):
        target = Target(str(target.path), list(drafter.config.aux_layer_ids))
    runner = TargetRunner(target, target_model(target))
    drafter, K = drafter.float().eval(), drafter.config.speculative_tokens
    agree, positions = [0] * K, [0] * K
    with torch.inference_mode():
        for prompt, answer in conversations:
            runner.reset()
            logits, aux = runner.forward(prompt + answer)
            ids, n, P = torch.tensor(prompt + answer)[None], len(prompt) + len(answer), len(prompt)
            top = logits.argmax(-1)  # [n]: the target's token after each position
            docs = torch.zeros_like(ids)
            for i, out in enumerate(slot_logits(drafter, aux[None].float(), ids, docs, torch.arange(n)[None], K)):
                # anchors t = P - 1 .. n - 2 - i: slot i predicts the target's top-1 after t + 1 + i
                pred = drafter.to_target_ids(out[0, P - 1 : n - 1 - i].argmax(-1))
                agree[i] += int((pred == top[P + i : n]).sum())
                positions[i] += len(pred)
    return {
        "agreement": [a / max(1, p) for a, p in zip(agree, positions)],
        "positions": positions[0],
        "conversations": len(conversations),
    }


def diagnose(
    folder: Path, config: dict, target, run_path: Path | None, measured: bool, conversations=None
) -> list[Check]:
    """Every check of a P-EAGLE folder (module docstring)."""
    fix = (
        "re-export the drafter with `specdraft export`"
        if "specdraft" in config
        else "the folder is not one vLLM serves as this P-EAGLE drafter: fix its config.json where it was made"
    )
    checks = _config_checks(config, target) + [_mask_hidden_check(folder, config, target)]
    try:
        drafter = read_peagle(folder, target.embed_weight())
    except ValueError as e:
        return checks + [Check("drafter loads", False, str(e), fix)]
    cfg = drafter.config
    own = sum(p.numel() for name, p in drafter.named_parameters() if name != "embed_tokens.weight")
    checks.append(
        Check(
            "drafter loads",
            True,
            f"{own / 1e6:.2f} M parameters besides the target's embedding; trained for K = {cfg.speculative_tokens}",
        )
    )
    fits = (
        cfg.target_hidden_size == target.hidden_size
        and cfg.vocab_size == target.vocab_size
        and cfg.head_dim == target.drafter_head_dim
    )
    checks.append(
        Check(
            "drafter fits the target",
            fits,
            f"target width {cfg.target_hidden_size} / {target.hidden_size}, vocabulary {cfg.vocab_size} / "
            f"{target.vocab_size}, head dim {cfg.head_dim} / {target.drafter_head_dim}",
            "the drafter was trained for another target",
        )
    )
    counts = None
    if run_path is not None:
        found, counts = _run_checks(drafter, Path(run_path), target)
        checks += found
    checks += vocab_checks(drafter, counts)
    if measured and fits and all(c.ok for c in checks):
        held_out = conversations is None
        m = measure(drafter, target, held_out_conversations(target, run_path) if held_out else conversations)
        first = m["agreement"][0]
        slots = " / ".join(f"{a:.2f}" for a in m["agreement"])
        checks.append(
            Check(
                "first slot agrees with the target",
                first >= MIN_TOP1_AGREEMENT,
                f"{first:.1%} of {m['positions']} answer positions of {m['conversations']} "
                f"{'held-out ShareGPT' if held_out else 'given'} conversations (floor "
                f"{MIN_TOP1_AGREEMENT:.0%}); per slot {slots}",
                "the drafter does not predict this target's next tokens as served: see the checks "
                "above; if they pass, it needs more training",
                first,
            )
        )
    return checks
