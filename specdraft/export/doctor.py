"""doctor: the checks that catch a drafter that loads but would accept almost nothing when served.

Each check is a pass / fail line with the fix. The failures it looks for are the ones seen in the
field (FACTS.md): aux layer ids missing or not the ones the hidden states were extracted with, d2t
missing or holding absolute ids, sizes that do not fit the target, norm flags left to an engine's
default, and training data rendered with another chat template than the one served.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .formats import FLAT_ARCHITECTURE, read_drafter


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""

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
    rope = (getattr(text, "rope_parameters", None) or {}).get("rope_theta", getattr(text, "rope_theta", None))
    if rope is not None:
        checks.append(Check("rope theta", float(rope) == float(cfg.rope_theta),
                            f"drafter {cfg.rope_theta}, target {rope}",
                            "the drafter's positions would rotate differently from training"))
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
        checks.append(Check("draft vocab covers the training answers", covered > 0.5,
                            f"{covered:.1%} of the run's answer tokens",
                            "d2t does not map to the frequent tokens of the data (lost or misread mapping)"))
    return checks


def _run_checks(drafter, run_path: Path, target) -> tuple[list[Check], object]:
    checks, counts = [], None
    index_path = run_path / "hidden" / "index.json"
    if index_path.exists():
        extracted = json.loads(index_path.read_text())["aux_layer_ids"]
        checks.append(Check("aux layer ids = extracted ones", drafter.config.aux_layer_ids == extracted,
                            f"drafter {drafter.config.aux_layer_ids}, hidden states {extracted}",
                            "the drafter would be fed other layers than it was trained on; re-export from the run"))
    tokens_index = run_path / "tokens" / "index.json"
    if tokens_index.exists():
        from ..data.render import load_tokens
        from ..drafter.vocab import token_counts

        index, samples = load_tokens(run_path)
        served = hashlib.sha256((target.tokenizer.chat_template or "").encode()).hexdigest()[:16]
        trained = index["chat_template_sha256"]
        checks.append(Check("chat template = training data's", served == trained,
                            f"served {served}, training data {trained}",
                            "render the training data with the template the engine serves (tau < 3 vs 5.8 seen)"))
        counts = token_counts(samples, target.vocab_size)
    return checks, counts


def diagnose(folder: Path, target, run_path: Path | None = None) -> list[Check]:
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [Check("config.json readable", False, str(e), "point doctor at an exported drafter folder")]
    checks = _config_checks(config)
    try:
        drafter = read_drafter(folder, target.embed_weight())
    except ValueError as e:
        return checks + [Check("drafter loads", False, str(e), "re-export the drafter with `specdraft export`")]
    own = sum(p.numel() for name, p in drafter.named_parameters() if name != "embed_tokens.weight")
    checks.append(Check("drafter loads", True, f"{own / 1e6:.2f} M parameters besides the target's embedding"))
    checks += _target_checks(drafter, target)
    counts = None
    if run_path is not None:
        run_checks, counts = _run_checks(drafter, Path(run_path), target)
        checks += run_checks
    checks += _vocab_checks(drafter, counts)
    return checks


def run_doctor(folder: str, target_name: str | None, run_path: str | None) -> int:
    """Print the checks; exit status 1 when any fails. The run (for the extracted layer ids and the
    training data) defaults to the one the folder was exported into (runs/<name>/export/<format>)."""
    from ..run import Run
    from ..targets import Target

    folder_path = Path(folder)
    if run_path is None and Run(folder_path.resolve().parents[1]).exists():
        run_path = str(folder_path.resolve().parents[1])
    if target_name is None:
        if run_path is None:
            raise ValueError("doctor: pass --target (or --run, whose recipe names it)")
        target_name = Run(Path(run_path)).recipe().target.model
    target = Target(target_name)
    checks = diagnose(folder_path, target, Path(run_path) if run_path else None)
    for c in checks:
        print(c.line())
    failed = [c for c in checks if not c.ok]
    print(f"\n{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
