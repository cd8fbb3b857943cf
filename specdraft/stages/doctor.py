"""doctor: the checks that catch a drafter that loads but would accept almost nothing when served.

Each check is a pass / fail line with the fix. The failures it looks for are the ones seen in the
field (docs/engine-facts.md): aux layer ids missing or not the ones the hidden states were extracted with, d2t
missing or holding absolute ids, sizes that do not fit the target, norm flags left to an engine's
default, and training data rendered with another chat template than the one served.

A DFlash folder (architectures ["DFlashDraftModel"], or the speculators library's, checked as the config
vLLM builds from it) gets its own checks, for the silent failures of that format (docs/dflash.md): the target layers in two conventions, the mask token (its id, the
embedding row vLLM feeds the mask slots, whether the data contains it), the block size as trained and
as served, the vocabulary mapping, and the first drafted slot's agreement with the target.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from specdraft.config import Recipe
from specdraft.data.sources import prompts
from specdraft.data.tokens import load_tokens
from specdraft.decoding.runners import TargetRunner
from specdraft.drafters.dflash_format import WEIGHTS as DFLASH_WEIGHTS
from specdraft.drafters.dflash_format import (
    from_speculators,
    is_dflash,
    is_speculators,
    read_dflash,
    speculators_k,
)
from specdraft.drafters.checkpoint import read_meta
from specdraft.drafters.formats import EAGLE31_FLAGS, FLAT_ARCHITECTURE, REEXPORT, read_drafter
from specdraft.drafters.vocab import token_counts
from specdraft.files import FileError, open_safetensors, read_json
from specdraft.hidden.store import INDEX, read_index
from specdraft.run import RunFolder
from specdraft.targets import Target

# The measured checks: the drafter drafts for the target on a few held-out ShareGPT conversations and
# its first-step top-1 (mapped through d2t) is compared with the target's next token at every answer
# position. 8 x 48 = 384 positions, one target forward per conversation: seconds for SmolLM2 on a CPU.
AGREEMENT_CONVERSATIONS = 8
AGREEMENT_TOKENS = 48
# Below this first-step agreement a drafter is failed before serving: a random or mis-exported one
# measures ~0, the demo drafter 0.29 (its held-out position-0 acceptance). At 0.1 a chain of 3 drafts
# accepts ~0.11 tokens per draft, which does not pay for drafting and verifying on any engine.
MIN_TOP1_AGREEMENT = 0.10
# The drafter's most frequent predictions must be tokens the target itself produces: a d2t from another
# vocabulary order maps them elsewhere while the draft vocab (t2d) still covers the answers.
FREQUENT_DRAFTS = 10
MIN_FREQUENT_SHARE = 0.5
# Share of the target's next tokens the draft vocabulary must hold: a vocabulary built from this
# target's answers holds ~98 % (demo: 98.0 %; the memorised drafter: 98.8 %), a lost d2t (identity:
# SmolLM2's ids 0..511) 51 %, and acceptance at every position is capped by this share.
MIN_COVERAGE = 0.8


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    value: float | None = None  # what a measured check measured

    def line(self) -> str:
        head = f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"
        return head if self.ok or not self.fix else f"{head}\n      fix: {self.fix}"


def _config_checks(config: dict) -> list[Check]:
    """What the engines read from config.json, checked without loading any weights."""
    checks = []
    speculators = "speculators_model_type" in config
    fmt = "speculators (vLLM)" if speculators else "flat (SGLang / vLLM)"
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    checks.append(Check("aux layer ids written", bool(ids), f"{ids}" if ids else "absent",
                        "write eagle_aux_hidden_state_layer_ids; without them the engine guesses (2, L//2, L-3) "
                        "(1.2 % vs 59 % acceptance in vLLM #50170)"))
    checks.append(Check("norm_before_residual written", "norm_before_residual" in config,
                        f"{config.get('norm_before_residual')!r} in the {fmt} format",
                        "write it explicitly: the speculators path reads it as True when absent, the flat path "
                        "as False, so an absent flag serves another network on one of them"))
    if not speculators and FLAT_ARCHITECTURE not in (config.get("architectures") or []):
        checks.append(Check("format", False, f"architectures {config.get('architectures')}",
                            f"a flat drafter needs architectures [{FLAT_ARCHITECTURE!r}]"))
    return checks


def _target_checks(drafter, target) -> list[Check]:
    cfg = drafter.config
    L = target.num_layers
    ids = cfg.aux_layer_ids
    checks = [
        Check("aux layer ids in range", all(1 <= k < L for k in ids),
              f"{ids} for a target with {L} layers",
              f"ids are residual streams after k layers, 1 <= k < {L}"),
        Check("aux layer ids ascending", ids == sorted(set(ids)), f"{ids}",
              "vLLM concatenates aux states in ascending layer order; list them so, and train fc on that order"),
        Check("target hidden size", cfg.target_hidden_size == target.hidden_size,
              f"drafter {cfg.target_hidden_size}, target {target.hidden_size}",
              "the drafter was trained for another target"),
        Check("fc input width", drafter.fc.in_features == len(ids) * target.hidden_size,
              f"{drafter.fc.in_features} = {len(ids)} aux x {target.hidden_size}?",
              "fc must read one target hidden state per aux layer"),
        Check("vocab size", cfg.vocab_size == target.vocab_size,
              f"drafter {cfg.vocab_size}, target {target.vocab_size}",
              "the drafter's token ids are not the target's; retrain on this target's tokenizer"),
    ]
    text = target.text_config
    # The family's drafter head width: the target's own, except MLA targets (the value head width).
    head_dim = target.drafter_head_dim
    checks.append(Check("head dim", cfg.head_dim == head_dim,
                        f"drafter {cfg.num_attention_heads} heads x {cfg.head_dim}, target "
                        f"{text.num_attention_heads} x {head_dim}",
                        "EAGLE-3 drafters take the target's attention shape; another head dim means it was "
                        "built for another target"))
    rope_params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    rope = rope_params.get("rope_theta", getattr(text, "rope_theta", None))
    if rope is not None:
        checks.append(Check("rope theta", float(rope) == float(cfg.rope_theta),
                            f"drafter {cfg.rope_theta}, target {rope}",
                            "the drafter's positions would rotate differently from training"))
    # The drafter implements default RoPE only (formats refuse other types on read).
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    checks.append(Check("rope type", rope_type == "default", f"drafter default, target {rope_type}",
                        f"the target scales positions ({rope_type}); a drafter with plain RoPE sees other "
                        "angles than the target at long context"))
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
        checks.append(Check(f"{flag} as served", len(values) == 1, detail,
                            "write the flag as trained; SGLang cannot serve norm_before_residual=True or "
                            "EAGLE-3.1 norms: serve such a drafter with vLLM"))
    return checks


def _vocab_checks(drafter, counts=None) -> list[Check]:
    """d2t's range and its agreement with t2d are enforced when the drafter is read; what loading
    cannot see is a mapping that is valid but wrong, e.g. lost (all zeros = draft id i -> target id i)."""
    import torch

    d2t = drafter.d2t
    targets = torch.arange(d2t.numel()) + d2t
    checks = []
    if d2t.numel() < drafter.config.vocab_size:
        checks.append(Check("d2t is a real mapping", bool(d2t.any()),
                            "draft ids map to target ids " + ("0..Vd-1 (identity)" if not d2t.any() else
                                                               f"{int(targets.min())}..{int(targets.max())}"),
                            "write the trained d2t; vLLM keeps a missing d2t at zeros, i.e. the identity"))
    if counts is not None:
        covered = counts[targets].sum().item() / max(1, counts.sum().item())
        checks.append(Check("draft vocab covers the training answers", covered >= MIN_COVERAGE,
                            f"{covered:.1%} of the run's answer tokens",
                            "d2t does not map to the frequent tokens of the data (lost or misread mapping)"))
    return checks


def trained_config(run_path: Path) -> dict | None:
    """The drafter config of the run's trained checkpoint, when there is one."""

    folder = RunFolder(run_path)
    entry = folder.stage("train")
    if not entry or entry.get("state") != "done":
        return None
    checkpoint = run_path / entry["checkpoint"] if "checkpoint" in entry else folder.checkpoint("final")
    path = checkpoint / "config.json"
    return read_meta(checkpoint)["drafter"] if path.exists() else None


def _run_checks(drafter, run_path: Path, target) -> tuple[list[Check], object]:
    checks, counts, folder = [], None, RunFolder(run_path)
    index_path = folder.hidden / INDEX
    if index_path.exists():
        extracted = read_index(folder.hidden, ("aux_layer_ids",))["aux_layer_ids"]
        checks.append(Check("aux layer ids = extracted ones", drafter.config.aux_layer_ids == extracted,
                            f"drafter {drafter.config.aux_layer_ids}, hidden states {extracted}",
                            "the drafter would be fed other layers than it was trained on; re-export from the run"))
    if (folder.tokens / "index.json").exists():
        index, samples = load_tokens(folder.tokens, target.vocab_size)
        served = hashlib.sha256((target.tokenizer.chat_template or "").encode()).hexdigest()[:16]
        trained = index.get("chat_template_sha256")
        checks.append(Check("chat template = training data's", served == trained,
                            f"served {served}, training data {trained}",
                            "render the training data with the template the engine serves (tau < 3 vs 5.8 seen)"))
        counts = token_counts(samples, target.vocab_size)
    return checks, counts


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
    runner = TargetRunner(target, _model(target))
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
            draft_logits, _, _ = drafter(drafter.project(aux[None, :-1].float()), ids[None, 1:],
                                         torch.arange(n - 1)[None])  # [1, n-1, Vd]
            pred = drafter.to_target_ids(draft_logits[0, P - 1:].argmax(-1))  # [n-P]
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


_MODELS: dict = {}


def _model(target):
    """The target model for the measured checks, loaded once per process."""
    key = str(target.path)
    if key not in _MODELS:
        _MODELS[key] = target.load_model("bfloat16")
    return _MODELS[key]


def held_out_conversations(target, run_path: Path | None, n: int = AGREEMENT_CONVERSATIONS,
                           answer_tokens: int = AGREEMENT_TOKENS) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, first answer's ids) of real conversations the drafter was not trained on: the
    run's held-out ShareGPT split when the run is known (its data settings), else the default
    recipe's; rendered with the target's chat template, the answer cut to `answer_tokens`."""

    recipe = RunFolder(run_path).recipe() if run_path is not None and RunFolder(run_path).exists() else Recipe()
    d = recipe.data
    out = []
    for conv in prompts(d.source, "eval", d.eval_fraction, d.split_seed, data=d):
        turns = [m for m in conv["messages"] if m["role"] != "system"]
        if len(turns) < 2 or turns[1]["role"] != "assistant" or not turns[1]["content"].strip():
            continue
        prompt = target.chat_ids(turns[:1], add_generation_prompt=True)
        full = target.chat_ids(turns[:2], add_generation_prompt=False)
        if len(prompt) > d.max_prompt_tokens or full[:len(prompt)] != prompt:
            continue
        out.append((prompt, full[len(prompt):len(prompt) + answer_tokens]))
        if len(out) >= n:
            break
    return out


def training_conversations(run_path: Path, n: int = AGREEMENT_CONVERSATIONS,
                           answer_tokens: int = AGREEMENT_TOKENS) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the run's own training samples: where a drafter that learnt anything
    must agree with the target (the held-out split tells whether it generalises)."""

    _, samples = load_tokens(RunFolder(run_path).tokens)
    out = []
    for ids, mask in samples[:n]:
        ids, mask = list(map(int, ids)), list(map(int, mask))
        start = mask.index(1)
        out.append((ids[:start], ids[start:start + answer_tokens]))
    return out


def _measured_checks(drafter, target, run_path: Path | None, conversations=None) -> list[Check]:
    held_out = conversations is None
    if held_out:
        conversations = held_out_conversations(target, run_path)
    m = measure(drafter, target, conversations)
    kind = "held-out ShareGPT" if held_out else "given"
    where = f"{m['positions']} answer positions of {m['conversations']} {kind} conversations"
    shown = ", ".join(f"{tok!r} x{c}" for tok, c in m["frequent"][:5])
    return [
        Check("top-1 agreement with the target", m["agreement"] >= MIN_TOP1_AGREEMENT,
              f"{m['agreement']:.1%} of {where} (floor {MIN_TOP1_AGREEMENT:.0%})",
              "the drafter does not predict this target's next tokens as served: see the aux layer, d2t and "
              "norm checks; if they pass, the drafter needs more (or on-policy) training data", m["agreement"]),
        Check("draft vocab covers the target's answers", m["coverage"] >= MIN_COVERAGE,
              f"{m['coverage']:.1%} of the target's next tokens there",
              "d2t maps the draft vocab to tokens this target rarely writes (lost, misread or another target's), "
              "or the draft vocab was built from too little data",
              m["coverage"]),
        Check("frequent draft tokens are target tokens", m["frequent_share"] >= MIN_FREQUENT_SHARE,
              f"{m['frequent_share']:.0%} of the drafter's {FREQUENT_DRAFTS} most frequent predictions are tokens "
              f"the target predicts there too ({shown})",
              "d2t does not match the lm_head's rows (e.g. a draft vocab in another order): rebuild d2t with "
              "the drafter's own vocabulary", m["frequent_share"]),
    ]


def diagnose(folder: Path, target, run_path: Path | None = None, measured: bool = True,
             conversations: list[tuple[list[int], list[int]]] | None = None) -> list[Check]:
    """Every check of an exported drafter folder; `measured` adds the ones that run the target on real
    conversations (held-out ShareGPT unless `conversations` are given; seconds to minutes, the target's
    size), which config-level callers can leave out."""
    folder = Path(folder)
    try:
        config = read_json(folder / "config.json", fix=REEXPORT, what="a drafter's config")
    except (OSError, FileError) as e:
        return [Check("config.json readable", False, str(e), "point doctor at an exported drafter folder")]
    if is_dflash(config):
        return diagnose_dflash(folder, config, target, Path(run_path) if run_path is not None else None, measured,
                               conversations)
    checks = _config_checks(config)
    checks += _norm_flag_checks(config, trained_config(Path(run_path)) if run_path is not None else None)
    try:
        drafter = read_drafter(folder, target.embed_weight())
    except ValueError as e:
        ours = "specdraft" in config
        fix = ("re-export the drafter with `specdraft export`" if ours else
               "the folder is not one the engines load as EAGLE-3 (or a layout specdraft cannot read yet): "
               "check it against its trainer's export")
        return checks + [Check("drafter loads", False, str(e), fix)]
    own = sum(p.numel() for name, p in drafter.named_parameters() if name != "embed_tokens.weight")
    checks.append(Check("drafter loads", True, f"{own / 1e6:.2f} M parameters besides the target's embedding"))
    checks += _target_checks(drafter, target)
    counts = None
    if run_path is not None:
        run_checks, counts = _run_checks(drafter, Path(run_path), target)
        checks += run_checks
    checks += _vocab_checks(drafter, counts)
    in_range = all(1 <= k < target.num_layers for k in drafter.config.aux_layer_ids)
    fits = drafter.config.target_hidden_size == target.hidden_size and drafter.config.vocab_size == target.vocab_size
    if measured and in_range and fits:
        checks += _measured_checks(drafter, target, Path(run_path) if run_path is not None else None,
                                   conversations)
    return checks


# ---------------------------------------------------------------------------------------------------
# DFlash folders


def _dflash_layer_checks(config: dict, target) -> list[Check]:
    """The two lists of target layers vLLM reads (the top-level one first) and their range."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("dflash_config") or {}).get("target_layer_ids")
    agree = bool(top) and bool(nested) and [j + 1 for j in nested] == list(top)
    ids = list(top or [j + 1 for j in nested or []])
    L = target.num_layers
    return [
        Check("target layer ids in both conventions", agree,
              f"eagle_aux_hidden_state_layer_ids {top} (residual after k layers), dflash_config.target_layer_ids "
              f"{nested} (output of layer j = k - 1)",
              "write both from one list (k = j + 1): vLLM reads the top-level list first, and a list in the other "
              "convention feeds the neighbouring layers, silently"),
        Check("target layer ids in range", bool(ids) and all(1 <= k < L for k in ids) and ids == sorted(set(ids)),
              f"{ids} for a target of {L} layers", f"ascending residual ids 1 <= k < {L}, the extracted ones"),
    ]


def _dflash_mask_checks(folder: Path, config: dict, target) -> list[Check]:
    """The mask token's id and the embedding row vLLM feeds the mask slots: the folder's own embedding
    when it ships one, a mask_embedding.pt when present, else the target's row."""
    import torch

    mask = (config.get("dflash_config") or {}).get("mask_token_id")
    tok = target.tokenizer
    reserved = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id} - {None}
    ok = isinstance(mask, int) and 0 <= mask < target.vocab_size and mask not in reserved
    shown = f"{mask} ({tok.convert_ids_to_tokens(mask)!r})" if ok else f"{mask!r}"
    checks = [Check("mask token id", ok, f"{shown} in a vocabulary of {target.vocab_size}",
                    "mask_token_id (dflash_config's; speculators': the top-level one) must be the trained mask "
                    "token: an id of the target's vocabulary that is not bos / eos / pad / unk (specdraft's "
                    "default: dflash.default_mask_token)")]
    if (folder / "mask_embedding.pt").exists():
        checks.append(Check("mask embedding", False, "mask_embedding.pt present: vLLM feeds it to the mask slots",
                            "remove it: specdraft's drafters train on the target's embedding row of the mask token "
                            "(and specdraft never unpickles a .pt to check it)"))
    elif ok:
        row = target.embed_weight()[mask].float()
        try:
            f = open_safetensors(folder / DFLASH_WEIGHTS, fix=REEXPORT)
        except FileError as e:
            return checks + [Check("mask embedding", False, str(e), REEXPORT)]
        with f:
            names = {n.removeprefix("model."): n for n in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
            own = f.get_tensor(names["embed_tokens.weight"])[mask].float() if "embed_tokens.weight" in names else None
        served = own if own is not None else row
        checks.append(Check("mask embedding", bool(row.abs().sum() > 0) and torch.allclose(served, row, atol=1e-2),
                            f"the {'folder' if own is not None else 'target'}'s row {mask}, norm {served.norm():.3f}",
                            "the mask slots must read the target's row of the mask token, as trained: drop the "
                            "folder's embed_tokens or re-export"))
    return checks


def _dflash_shape_checks(config: dict) -> list[Check]:
    """What vLLM does not read but the drafter was trained with, and what it reads with a default."""
    block = config.get("block_size")
    dflash = config.get("dflash_config") or {}
    return [
        Check("block size", isinstance(block, int) and block >= 2, f"{block!r}",
              "write block_size (the anchor plus the drafted tokens) and serve with num_speculative_tokens = "
              "block_size - 1: vLLM drafts the K of the serve command, whatever the block was"),
        Check("block attention bidirectional", dflash.get("causal") is False and not config.get("is_causal"),
              f"dflash_config.causal {dflash.get('causal')!r}, is_causal {config.get('is_causal')!r}",
              "write dflash_config.causal = false: the drafter's block attention is not causal"),
        Check("rotary layout written", config.get("is_neox_style") is True, f"is_neox_style {config.get('is_neox_style')!r}",
              "write is_neox_style = true, the layout the drafter rotates in"),
    ]


def _dflash_run_checks(drafter, run_path: Path, target) -> tuple[list[Check], object]:
    """The folder against the run that trained it: layers, mask token, block size, the served K."""
    folder, cfg, checks = RunFolder(run_path), drafter.config, []
    trained = trained_config(run_path)
    if trained is not None:
        for name in ("mask_token_id", "block_size", "aux_layer_ids"):
            checks.append(Check(f"{name} = trained", getattr(cfg, name) == trained.get(name),
                                f"folder {getattr(cfg, name)}, checkpoint {trained.get(name)}",
                                "the folder no longer says what the drafter was trained with: re-export from the run"))
    served = ((folder.stage("export") or {}).get("speculative_tokens") or {}).get("value")
    if served is not None:
        checks.append(Check("served K = block_size - 1", served == cfg.speculative_tokens,
                            f"num_speculative_tokens {served}, block_size {cfg.block_size}",
                            f"serve with num_speculative_tokens = {cfg.speculative_tokens}"))
    more, counts = _run_checks(drafter, run_path, target)
    if counts is not None:
        n = int(counts[cfg.mask_token_id])
        more.append(Check("mask token absent from the training answers", n == 0, f"{n} occurrence(s)",
                          "choose a mask token the data never contains (train.mask_token_id)"))
    return checks + more, counts


def measure_dflash(drafter, target, conversations: list[tuple[list[int], list[int]]]) -> dict:
    """The first drafted slot against the target, teacher-forced on real conversations: one target
    forward each, then a block anchored at every answer position a (its context: positions < a) whose
    slot 1 predicts the token at a + 1, compared with the target's own top-1 there."""
    import torch

    if target.aux_layer_ids != list(drafter.config.aux_layer_ids):
        target = Target(str(target.path), list(drafter.config.aux_layer_ids))
    runner = TargetRunner(target, _model(target))
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
FOREIGN_FIX = ("the folder is not one vLLM loads as this DFlash drafter, or one specdraft cannot hold: fix its "
               "config.json where it was made")


def _speculators_checks(raw: dict, config: dict) -> list[Check]:
    """A speculators folder's own K: vLLM drafts speculators_config's, whatever the block was."""
    k, block = speculators_k(raw), config.get("block_size")
    if k is None or block is None:
        return []
    return [Check("served K = block_size - 1", k == block - 1, f"speculative_tokens {k}, block_size {block}",
                  f"set speculators_config.proposal_methods[0].speculative_tokens to {block - 1}: vLLM drafts that "
                  "many per round")]


def diagnose_dflash(folder: Path, config: dict, target, run_path: Path | None, measured: bool,
                    conversations=None) -> list[Check]:
    """Every check of a DFlash folder (module docstring); a speculators one is checked as the config vLLM
    builds from it."""
    raw, fix = config, "re-export the drafter with `specdraft export`" if "specdraft" in config else FOREIGN_FIX
    if is_speculators(raw):
        try:
            config = from_speculators(raw, str(folder / "config.json"), [])
        except ValueError as e:
            return [Check("drafter loads", False, str(e), fix)]
    checks = _dflash_layer_checks(config, target) + _dflash_mask_checks(folder, config, target)
    checks += _dflash_shape_checks(config) + _speculators_checks(raw, config)
    try:
        drafter = read_dflash(folder, target.embed_weight(), target.head_weight())
    except ValueError as e:
        return checks + [Check("drafter loads", False, str(e), fix)]
    own = sum(t.numel() for name, t in drafter.named_parameters() if t.requires_grad)
    checks.append(Check("drafter loads", True, f"{own / 1e6:.2f} M parameters besides the target's embedding"
                        f"{' and lm_head' if drafter.config.shares_lm_head else ''}"))
    fits = drafter.config.target_hidden_size == target.hidden_size and drafter.config.vocab_size == target.vocab_size
    checks.append(Check("drafter fits the target", fits,
                        f"target width {drafter.config.target_hidden_size} / {target.hidden_size}, vocabulary "
                        f"{drafter.config.vocab_size} / {target.vocab_size}", "the drafter was trained for another target"))
    counts = None
    if run_path is not None:
        run_checks, counts = _dflash_run_checks(drafter, run_path, target)
        checks += run_checks
    checks += _vocab_checks(drafter, counts)
    if measured and fits and all(c.ok for c in checks):
        held_out = conversations is None
        m = measure_dflash(drafter, target, held_out_conversations(target, run_path) if held_out else conversations)
        checks.append(Check("first drafted slot agrees with the target", m["agreement"] >= MIN_TOP1_AGREEMENT,
                            f"{m['agreement']:.1%} of {m['positions']} answer positions of {m['conversations']} "
                            f"{'held-out ShareGPT' if held_out else 'given'} conversations (floor "
                            f"{MIN_TOP1_AGREEMENT:.0%})",
                            "the drafter does not predict this target's next tokens as served: see the checks "
                            "above; if they pass, it needs more training", m["agreement"]))
    return checks


def run_doctor(folder: str, target_name: str | None, run_path: str | None, measured: bool = True) -> int:
    """Print the checks; exit status 1 when any fails. The run (for the extracted layer ids and the
    training data) defaults to the one the folder was exported into (runs/<name>/export/<format>)."""

    folder_path = Path(folder)
    if not folder_path.is_dir():
        raise FileNotFoundError(f"doctor: {folder_path} is not a folder (give an exported drafter folder, e.g. "
                                "runs/demo/export/vllm)")
    if run_path is None and RunFolder(folder_path.resolve().parents[1]).exists():
        run_path = str(folder_path.resolve().parents[1])
    if target_name is None:
        if run_path is None:
            raise ValueError("doctor: pass --target (or --run, whose recipe names it)")
        target_name = RunFolder(Path(run_path)).recipe().target.model
    target = Target(target_name)
    checks = diagnose(folder_path, target, Path(run_path) if run_path else None, measured=measured)
    for c in checks:
        print(c.line())
    failed = [c for c in checks if not c.ok]
    print(f"\n{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
