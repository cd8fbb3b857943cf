"""doctor's checks of a DFlash folder (architectures ["DFlashDraftModel"], or the speculators library's,
checked as the config vLLM builds from it), for the silent failures of that format (docs/dflash.md): the
target layers in two conventions, the mask token (its id, the embedding row vLLM feeds the mask slots,
whether the data contains it), the block size as trained and as served, the vocabulary mapping, and the
first drafted slot's agreement with the target.
"""

from __future__ import annotations

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
from specdraft.drafters.common import REEXPORT, WEIGHTS
from specdraft.files import FileError, open_safetensors
from specdraft.methods.dflash.formats import from_speculators, is_speculators, read_dflash, speculators_k
from specdraft.run import RunFolder
from specdraft.targets import Target


def _layer_checks(config: dict, target) -> list[Check]:
    """The two lists of target layers vLLM reads (the top-level one first) and their range."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("dflash_config") or {}).get("target_layer_ids")
    agree = bool(top) and bool(nested) and [j + 1 for j in nested] == list(top)
    ids = list(top or [j + 1 for j in nested or []])
    L = target.num_layers
    return [
        Check(
            "target layer ids in both conventions",
            agree,
            f"eagle_aux_hidden_state_layer_ids {top} (residual after k layers), dflash_config.target_layer_ids "
            f"{nested} (output of layer j = k - 1)",
            "write both from one list (k = j + 1): vLLM reads the top-level list first, and a list in the other "
            "convention feeds the neighbouring layers, silently",
        ),
        Check(
            "target layer ids in range",
            bool(ids) and all(1 <= k < L for k in ids) and ids == sorted(set(ids)),
            f"{ids} for a target of {L} layers",
            f"ascending residual ids 1 <= k < {L}, the extracted ones",
        ),
    ]


def _mask_checks(folder: Path, config: dict, target) -> list[Check]:
    """The mask token's id and the embedding row vLLM feeds the mask slots: the folder's own embedding
    when it ships one, a mask_embedding.pt when present, else the target's row."""
    import torch

    mask = (config.get("dflash_config") or {}).get("mask_token_id")
    tok = target.tokenizer
    reserved = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id} - {None}
    ok = isinstance(mask, int) and 0 <= mask < target.vocab_size and mask not in reserved
    shown = f"{mask} ({tok.convert_ids_to_tokens(mask)!r})" if ok else f"{mask!r}"
    checks = [
        Check(
            "mask token id",
            ok,
            f"{shown} in a vocabulary of {target.vocab_size}",
            "mask_token_id (dflash_config's; speculators': the top-level one) must be the trained mask "
            "token: an id of the target's vocabulary that is not bos / eos / pad / unk (specdraft's "
            "default: dflash.default_mask_token)",
        )
    ]
    if (folder / "mask_embedding.pt").exists():
        checks.append(
            Check(
                "mask embedding",
                False,
                "mask_embedding.pt present: vLLM feeds it to the mask slots",
                "remove it: specdraft's drafters train on the target's embedding row of the mask token "
                "(and specdraft never unpickles a .pt to check it)",
            )
        )
    elif ok:
        row = target.embed_weight()[mask].float()
        try:
            f = open_safetensors(folder / WEIGHTS, fix=REEXPORT)
        except FileError as e:
            return checks + [Check("mask embedding", False, str(e), REEXPORT)]
        with f:
            names = {n.removeprefix("model."): n for n in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
            own = f.get_tensor(names["embed_tokens.weight"])[mask].float() if "embed_tokens.weight" in names else None
        served = own if own is not None else row
        checks.append(
            Check(
                "mask embedding",
                bool(row.abs().sum() > 0) and torch.allclose(served, row, atol=1e-2),
                f"the {'folder' if own is not None else 'target'}'s row {mask}, norm {served.norm():.3f}",
                "the mask slots must read the target's row of the mask token, as trained: drop the "
                "folder's embed_tokens or re-export",
            )
        )
    return checks


def _shape_checks(config: dict) -> list[Check]:
    """What vLLM does not read but the drafter was trained with, and what it reads with a default."""
    block = config.get("block_size")
    dflash = config.get("dflash_config") or {}
    return [
        Check(
            "block size",
            isinstance(block, int) and block >= 2,
            f"{block!r}",
            "write block_size (the anchor plus the drafted tokens) and serve with num_speculative_tokens = "
            "block_size - 1: vLLM drafts the K of the serve command, whatever the block was",
        ),
        Check(
            "block attention bidirectional",
            dflash.get("causal") is False and not config.get("is_causal"),
            f"dflash_config.causal {dflash.get('causal')!r}, is_causal {config.get('is_causal')!r}",
            "write dflash_config.causal = false: the drafter's block attention is not causal",
        ),
        Check(
            "rotary layout written",
            config.get("is_neox_style") is True,
            f"is_neox_style {config.get('is_neox_style')!r}",
            "write is_neox_style = true, the layout the drafter rotates in",
        ),
    ]


def _run_checks(drafter, run_path: Path, target) -> tuple[list[Check], object]:
    """The folder against the run that trained it: layers, mask token, block size, the served K."""
    folder, cfg = RunFolder(run_path), drafter.config
    checks = agrees_with_training(cfg, run_path, ("mask_token_id", "block_size", "aux_layer_ids"))
    served = ((folder.stage("export") or {}).get("speculative_tokens") or {}).get("value")
    if served is not None:
        checks.append(
            Check(
                "served K = block_size - 1",
                served == cfg.speculative_tokens,
                f"num_speculative_tokens {served}, block_size {cfg.block_size}",
                f"serve with num_speculative_tokens = {cfg.speculative_tokens}",
            )
        )
    more, counts = run_checks(drafter, run_path, target)
    more += mask_token_unused(counts, cfg.mask_token_id)
    return checks + more, counts


def measure(drafter, target, conversations: list[tuple[list[int], list[int]]]) -> dict:
    """The first drafted slot against the target, teacher-forced on real conversations: one target
    forward each, then a block anchored at every answer position a (its context: positions < a) whose
    slot 1 predicts the token at a + 1, compared with the target's own top-1 there."""
    import torch

    if target.aux_layer_ids != list(drafter.config.aux_layer_ids):
        target = Target(str(target.path), list(drafter.config.aux_layer_ids))
    runner = TargetRunner(target, target_model(target))
    drafter, bs = drafter.float().eval(), drafter.config.block_size
    agree = positions = 0
    with torch.inference_mode():
        for prompt, answer in conversations:
            runner.reset()
            logits, aux = runner.forward(prompt + answer)
            ids, n = torch.tensor(prompt + answer), len(prompt) + len(answer)
            anchors = torch.arange(len(prompt), n - 1)  # [N]
            context = drafter.context(aux[None].float(), torch.arange(n)[None])
            at = (anchors[:, None] + torch.arange(bs)).reshape(1, -1)  # [1, N*bs]
            visible = torch.arange(n)[None, None] < anchors.repeat_interleave(bs)[None, :, None]  # [1, N*bs, n]
            out = drafter(drafter.block_inputs(ids[anchors][None]), at, context, visible)  # [1, N*bs, Vd]
            pred = drafter.to_target_ids(out[0].reshape(len(anchors), bs, -1)[:, 1].argmax(-1))  # [N]
            agree += int((pred == logits[anchors].argmax(-1)).sum())
            positions += len(anchors)
    return {"agreement": agree / max(1, positions), "positions": positions, "conversations": len(conversations)}


# A folder specdraft did not write is fixed where it was made, not by re-exporting it.
FOREIGN_FIX = (
    "the folder is not one vLLM loads as this DFlash drafter, or one specdraft cannot hold: fix its "
    "config.json where it was made"
)


def _speculators_checks(raw: dict, config: dict) -> list[Check]:
    """A speculators folder's own K: vLLM drafts speculators_config's, whatever the block was."""
    k, block = speculators_k(raw), config.get("block_size")
    if k is None or block is None:
        return []
    return [
        Check(
            "served K = block_size - 1",
            k == block - 1,
            f"speculative_tokens {k}, block_size {block}",
            f"set speculators_config.proposal_methods[0].speculative_tokens to {block - 1}: vLLM drafts that "
            "many per round",
        )
    ]


def diagnose(
    folder: Path, config: dict, target, run_path: Path | None, measured: bool, conversations=None
) -> list[Check]:
    """Every check of a DFlash folder (module docstring); a speculators one is checked as the config vLLM
    builds from it."""
    raw, fix = config, "re-export the drafter with `specdraft export`" if "specdraft" in config else FOREIGN_FIX
    if is_speculators(raw):
        try:
            config = from_speculators(raw, str(folder / "config.json"), [])
        except ValueError as e:
            return [Check("drafter loads", False, str(e), fix)]
    checks = _layer_checks(config, target) + _mask_checks(folder, config, target)
    checks += _shape_checks(config) + _speculators_checks(raw, config)
    try:
        drafter = read_dflash(folder, target.embed_weight(), target.head_weight())
    except ValueError as e:
        return checks + [Check("drafter loads", False, str(e), fix)]
    own = sum(t.numel() for name, t in drafter.named_parameters() if t.requires_grad)
    checks.append(
        Check(
            "drafter loads",
            True,
            f"{own / 1e6:.2f} M parameters besides the target's embedding"
            f"{' and lm_head' if drafter.config.shares_lm_head else ''}",
        )
    )
    fits = drafter.config.target_hidden_size == target.hidden_size and drafter.config.vocab_size == target.vocab_size
    checks.append(
        Check(
            "drafter fits the target",
            fits,
            f"target width {drafter.config.target_hidden_size} / {target.hidden_size}, vocabulary "
            f"{drafter.config.vocab_size} / {target.vocab_size}",
            "the drafter was trained for another target",
        )
    )
    counts = None
    if run_path is not None:
        found, counts = _run_checks(drafter, run_path, target)
        checks += found
    checks += vocab_checks(drafter, counts)
    if measured and fits and all(c.ok for c in checks):
        held_out = conversations is None
        m = measure(drafter, target, held_out_conversations(target, run_path) if held_out else conversations)
        checks.append(
            Check(
                "first drafted slot agrees with the target",
                m["agreement"] >= MIN_TOP1_AGREEMENT,
                f"{m['agreement']:.1%} of {m['positions']} answer positions of {m['conversations']} "
                f"{'held-out ShareGPT' if held_out else 'given'} conversations (floor "
                f"{MIN_TOP1_AGREEMENT:.0%})",
                "the drafter does not predict this target's next tokens as served: see the checks "
                "above; if they pass, it needs more training",
                m["agreement"],
            )
        )
    return checks
