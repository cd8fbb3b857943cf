"""import: a published drafter read, checked against the target and written as a specdraft checkpoint
that eval, export and doctor use: an EAGLE-3 drafter (speculators or flat format, midlayer.* or
layers.0.*) or a DFlash drafter (the folder vLLM loads for method "dflash", in vLLM's own form or the
speculators library's, read as vLLM reads it: fields it leaves out take vLLM's defaults, each reported).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.drafters.checkpoint import COMPLETE, save_checkpoint, scratch_paths
from specdraft.drafters.dflash import DFlashDrafter
from specdraft.drafters.dflash_format import is_dflash as is_dflash_config
from specdraft.drafters.dflash_format import is_speculators, read_dflash
from specdraft.drafters.dflash_format import problems as dflash_problems
from specdraft.drafters.eagle3 import Eagle3Drafter
from specdraft.drafters.formats import (
    EMBED_KEY,
    REEXPORT,
    Published,
    fit_problems,
    read_published,
)
from specdraft.files import read_json
from specdraft.hidden.store import INDEX, read_index
from specdraft.run import RunFolder, check_new_or_ours
from specdraft.targets import Target


def import_drafter(folder: Path, target, out: Path,
                   extracted_aux_layer_ids: list[int] | None = None) -> tuple[Eagle3Drafter, Published]:
    """A published drafter folder -> a specdraft checkpoint at `out` (train.save_checkpoint's format,
    which eval, export and fine-tuning read), after checking it against `target` (and against the
    layers a run's hidden states hold, when given). Any misfit is an error that lists every one."""

    folder = Path(folder)
    published = read_published(folder, target.default_aux_layer_ids())
    problems = fit_problems(published.config, target, EMBED_KEY[1] in published.tensors)
    if extracted_aux_layer_ids is not None and list(extracted_aux_layer_ids) != published.config.aux_layer_ids:
        problems.append(f"aux layer ids: drafter {published.config.aux_layer_ids}, the run's hidden states "
                        f"{list(extracted_aux_layer_ids)} (fine-tuning would feed it other layers)")
    if problems:
        raise ValueError(f"import: {folder} does not fit the target {target.path}:\n  " + "\n  ".join(problems))
    embed = target.embed_weight()
    drafter = published.build(embed)
    if EMBED_KEY[1] in published.tensors and not torch.equal(drafter.embed_tokens.weight, embed.float()):
        published.notes.append("embed_tokens: differs from the target's; kept in the checkpoint")
    aux_ids = drafter.config.aux_layer_ids
    target_for_drafter = type(target)(target.name, aux_ids)
    meta = {"aux_layer_ids": aux_ids, "target": target_for_drafter.describe(),
            "imported_from": {"folder": str(folder.resolve()), "layout": published.layout,
                              "notes": published.notes}}
    save_checkpoint(drafter, Path(out), meta)
    return drafter, published


def _config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    config = read_json(path, fix=REEXPORT, kind=None) if path.exists() else {}
    return config if isinstance(config, dict) else {}


def is_dflash(folder: Path) -> bool:
    """vLLM's own DFlash form or speculators' (whose EAGLE-3 folders import_drafter reads)."""
    return is_dflash_config(_config(folder))


@dataclass
class DFlashRead:
    layout: str
    notes: list[str]  # how it was read: vLLM's defaults taken, an embedding of its own


def import_dflash(folder: Path, target, out: Path,
                  extracted_aux_layer_ids: list[int] | None = None) -> tuple[DFlashDrafter, DFlashRead]:
    """A DFlash folder -> a specdraft checkpoint at `out`, after checking it against `target` as vLLM
    would serve it (the target's embedding and, over the whole vocabulary, its lm_head)."""
    if (Path(folder) / "mask_embedding.pt").exists():
        # vLLM feeds the mask slots that tensor instead of an embedding row, which our drafter has no place for.
        raise ValueError(f"import: {folder} ships mask_embedding.pt (a mask embedding apart from the vocabulary), "
                         "which specdraft's DFlash drafter does not model")
    notes: list[str] = []
    drafter = read_dflash(folder, target.embed_weight(), target.head_weight(), notes)
    cfg = drafter.config
    found = dflash_problems(cfg, target.num_layers)
    if cfg.vocab_size != target.vocab_size:
        found.append(f"vocab_size: drafter {cfg.vocab_size}, target {target.vocab_size} (another tokenizer)")
    if cfg.target_hidden_size != target.hidden_size:
        found.append(f"target_hidden_size: drafter {cfg.target_hidden_size}, target hidden_size {target.hidden_size}")
    if extracted_aux_layer_ids is not None and list(extracted_aux_layer_ids) != cfg.aux_layer_ids:
        found.append(f"aux layer ids: drafter {cfg.aux_layer_ids}, the run's hidden states "
                     f"{list(extracted_aux_layer_ids)} (fine-tuning would feed it other layers)")
    if found:
        raise ValueError(f"import: {folder} does not fit the target {target.path}:\n  " + "\n  ".join(found))
    if not torch.equal(drafter.embed_tokens.weight, target.embed_weight().float()):
        notes.append("embed_tokens: the folder's own, differing from the target's (vLLM keeps it); kept")
    published = DFlashRead("speculators (dflash)" if is_speculators(_config(folder)) else "dflash", notes)
    aux_ids = list(cfg.aux_layer_ids)
    meta = {"aux_layer_ids": aux_ids, "target": type(target)(target.name, aux_ids).describe(),
            "imported_from": {"folder": str(Path(folder).resolve()), "layout": published.layout, "notes": notes}}
    save_checkpoint(drafter, Path(out), meta)
    return drafter, published


def describe(drafter) -> str:
    cfg = drafter.config
    common = (f"hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads x {cfg.head_dim}, draft vocab "
              f"{cfg.draft_vocab_size} of {cfg.vocab_size}, aux layers {cfg.aux_layer_ids}")
    if isinstance(drafter, DFlashDrafter):
        return (f"DFlash, {cfg.num_layers} layer(s), {common}, block {cfg.block_size}, mask token "
                f"{cfg.mask_token_id}, rope theta {cfg.rope_theta:g}")
    return f"EAGLE-3, {common}, norm_before_residual {cfg.norm_before_residual}"


# All that an import's checkpoint holds (save_checkpoint without a trainer state): a folder holding
# anything else has files specdraft did not put there, or a trainer state an import would discard.
IMPORT_FILES = {COMPLETE, "model.safetensors", "config.json"}


def _relation(a: Path, b: Path) -> str | None:
    """How the resolved path `a` overlaps `b`: "is", "is inside", "holds", or None when apart."""
    if a == b:
        return "is"
    if b in a.parents:
        return "is inside"
    return "holds" if a in b.parents else None


def _earlier_import(out: Path) -> bool:
    """Whether `out` is a checkpoint an earlier import wrote: IMPORT_FILES only, with the marker
    save_checkpoint writes last and the config import_drafter writes (its "imported_from")."""
    names = {p.name for p in out.iterdir()}
    if COMPLETE not in names or not names <= IMPORT_FILES:
        return False
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "imported_from" in config


def check_out(source: Path, out: Path) -> None:
    """Refuse, before anything is read or written, an `out` that writing would lose files in.
    save_checkpoint swaps a whole folder in at `out` (deleting what was there) and clears its scratch
    siblings, so none of them may overlap the source, and `out` must be new, empty or an earlier import."""
    src = source.resolve()
    relation = _relation(out.resolve(), src)
    if relation:
        raise ValueError(f"import: {out} {relation} the drafter folder being imported ({source}), which "
                         "writing the checkpoint there would destroy; write it to a folder apart from it")
    for scratch in scratch_paths(out):
        if _relation(src, scratch.resolve()):
            raise ValueError(f"import: writing {out} first clears {scratch}, which holds the drafter folder "
                             f"being imported ({source}); give --out another name")
    check_new_or_ours(out, _earlier_import, "import: --out",
                      "writing the checkpoint there would delete them (only an earlier import's checkpoint is "
                      "replaced): give --out a new or empty folder, or move them out first")


def run_import(source: str, recipe, folder: RunFolder | None = None, out: str | None = None) -> dict:
    """`specdraft import`: into a run (its checkpoints/imported, recorded as the run's drafter, so
    `eval`, `export` and `doctor` take it from there) or into a bare checkpoint folder (`out`)."""

    t0 = time.time()
    if folder is not None:
        trained = folder.stage("train")
        if trained and trained.get("state") == "done" and "imported_from" not in trained:
            raise ValueError(f"import: {folder.path} already holds a trained drafter ({trained.get('checkpoint')}); "
                             "import into a new run (--run) or a folder (--out)")
        out_path = folder.checkpoint("imported")
        index = folder.hidden / INDEX
        extracted = read_index(folder.hidden, ("aux_layer_ids",))["aux_layer_ids"] if index.exists() else None
    else:
        out_path, extracted = Path(out), None
    check_out(Path(source), out_path)
    target = Target(recipe.target.model)
    read = import_dflash if is_dflash(Path(source)) else import_drafter
    drafter, published = read(Path(source), target, out_path, extracted)
    cfg = drafter.config
    print(f"import: {source} ({published.layout})")
    for note in published.notes:
        print(f"  {note}")
    print(f"  drafter: {describe(drafter)}")
    print(f"  checkpoint: {out_path}")
    info = {"folder": str(Path(source).resolve()), "layout": published.layout, "notes": published.notes}
    if folder is None:
        print(f"\nnext: specdraft doctor {source} --target {recipe.target.model}")
        return info
    # The run's target reads the drafter's layers from now on (extract for fine-tuning, eval).
    recipe.target.aux_layer_ids = list(cfg.aux_layer_ids)
    folder.runs_with(recipe)  # recorded as the run's recipe with the records below
    rel = str(out_path.relative_to(folder.path))
    entry = folder.record("import", state="done", seconds=time.time() - t0, extra={**info, "checkpoint": rel})
    # Recorded as the run's drafter: eval and export load the train stage's checkpoint.
    folder.record("train", state="done", extra={"checkpoint": rel, "imported_from": info["folder"]})
    formats = "vllm" if isinstance(drafter, DFlashDrafter) else "both"  # DFlash: vLLM's folder format only
    print(f"\nnext: specdraft eval --run {folder.path}    (then: specdraft export --run {folder.path} --formats {formats})")
    return entry
