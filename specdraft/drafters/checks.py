"""What doctor's checks of every method share: a check (pass / fail with the fix), the thresholds of
the measured ones, the real conversations they measure on, the checks of a folder against the run that
trained it, and of the draft vocabulary's mapping. Each method's package holds its own folder checks
(specdraft/methods/<name>/doctor.py) and builds on these.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from specdraft.config import Recipe
from specdraft.data.sources import prompts
from specdraft.data.tokens import load_tokens
from specdraft.drafters.checkpoint import checkpoint_fix
from specdraft.drafters.vocab import token_counts
from specdraft.files import FileError, read_json
from specdraft.hidden.store import INDEX, read_index
from specdraft.run import RunFolder

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


def vocab_checks(drafter, counts=None) -> list[Check]:
    """d2t's range and its agreement with t2d are enforced when the drafter is read; what loading
    cannot see is a mapping that is valid but wrong, e.g. lost (all zeros = draft id i -> target id i)."""
    import torch

    d2t = drafter.d2t
    targets = torch.arange(d2t.numel()) + d2t
    checks = []
    if d2t.numel() < drafter.config.vocab_size:
        checks.append(
            Check(
                "d2t is a real mapping",
                bool(d2t.any()),
                "draft ids map to target ids "
                + ("0..Vd-1 (identity)" if not d2t.any() else f"{int(targets.min())}..{int(targets.max())}"),
                "write the trained d2t; vLLM keeps a missing d2t at zeros, i.e. the identity",
            )
        )
    if counts is not None:
        covered = counts[targets].sum().item() / max(1, counts.sum().item())
        checks.append(
            Check(
                "draft vocab covers the training answers",
                covered >= MIN_COVERAGE,
                f"{covered:.1%} of the run's answer tokens",
                "d2t does not map to the frequent tokens of the data (lost or misread mapping)",
            )
        )
    return checks


def trained_config(run_path: Path) -> dict | None:
    """The drafter config of the run's trained checkpoint, when there is one."""

    folder = RunFolder(run_path)
    entry = folder.stage("train")
    if not entry or entry.get("state") != "done":
        return None
    checkpoint = run_path / entry["checkpoint"] if "checkpoint" in entry else folder.checkpoint("final")
    path = checkpoint / "config.json"
    if not path.exists():
        return None
    meta = read_json(path, fix=checkpoint_fix(checkpoint))
    if not isinstance(meta.get("drafter"), dict):
        raise FileError(f"{path}: not a specdraft checkpoint's config (its 'drafter'); {checkpoint_fix(checkpoint)}")
    return meta["drafter"]


def run_checks(drafter, run_path: Path, target) -> tuple[list[Check], object]:
    checks, counts, folder = [], None, RunFolder(run_path)
    index_path = folder.hidden / INDEX
    if index_path.exists():
        extracted = read_index(folder.hidden, ("aux_layer_ids",))["aux_layer_ids"]
        checks.append(
            Check(
                "aux layer ids = extracted ones",
                drafter.config.aux_layer_ids == extracted,
                f"drafter {drafter.config.aux_layer_ids}, hidden states {extracted}",
                "the drafter would be fed other layers than it was trained on; re-export from the run",
            )
        )
    if (folder.tokens / "index.json").exists():
        index, samples = load_tokens(folder.tokens, target.vocab_size)
        served = hashlib.sha256((target.tokenizer.chat_template or "").encode()).hexdigest()[:16]
        trained = index.get("chat_template_sha256")
        checks.append(
            Check(
                "chat template = training data's",
                served == trained,
                f"served {served}, training data {trained}",
                "render the training data with the template the engine serves (tau < 3 vs 5.8 seen)",
            )
        )
        counts = token_counts(samples, target.vocab_size)
    return checks, counts


def agrees_with_training(cfg, run_path: Path, names: tuple[str, ...]) -> list[Check]:
    """The folder's `names` against the checkpoint the run trained (none where the run has no checkpoint)."""
    trained = trained_config(run_path)
    if trained is None:
        return []
    return [
        Check(
            f"{name} = trained",
            getattr(cfg, name) == trained.get(name),
            f"folder {getattr(cfg, name)}, checkpoint {trained.get(name)}",
            "the folder no longer says what the drafter was trained with: re-export from the run",
        )
        for name in names
    ]


def mask_token_unused(counts, mask_token_id: int) -> list[Check]:
    """A mask token the training answers contain would be read as data by the mask slots (none without
    the run's token counts)."""
    if counts is None:
        return []
    n = int(counts[mask_token_id])
    return [
        Check(
            "mask token absent from the training answers",
            n == 0,
            f"{n} occurrence(s)",
            "choose a mask token the data never contains (train.mask_token_id)",
        )
    ]


_MODELS: dict = {}


def target_model(target):
    """The target model for the measured checks, loaded once per process."""
    key = str(target.path)
    if key not in _MODELS:
        _MODELS[key] = target.load_model("bfloat16")
    return _MODELS[key]


def held_out_conversations(
    target, run_path: Path | None, n: int = AGREEMENT_CONVERSATIONS, answer_tokens: int = AGREEMENT_TOKENS
) -> list[tuple[list[int], list[int]]]:
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
        if len(prompt) > d.max_prompt_tokens or full[: len(prompt)] != prompt:
            continue
        out.append((prompt, full[len(prompt) : len(prompt) + answer_tokens]))
        if len(out) >= n:
            break
    return out
