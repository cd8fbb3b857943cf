"""import: a published drafter read, checked against the target and written as a specdraft checkpoint
that eval, export and doctor use. The folder's config.json says whose it is, and that method's package
reads it (specdraft/methods/<name>/: the speculators library's folders, vLLM's and SGLang's, each read
as its engine reads it, the defaults taken reported).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from specdraft.drafters.checkpoint import COMPLETE, scratch_paths
from specdraft.drafters.common import REEXPORT
from specdraft.files import read_json
from specdraft.hidden.store import INDEX, read_index
from specdraft.methods import for_folder
from specdraft.run import RunFolder, check_new_or_ours
from specdraft.targets import Target


def _config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    config = read_json(path, fix=REEXPORT, kind=None) if path.exists() else {}
    return config if isinstance(config, dict) else {}


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
        raise ValueError(
            f"import: {out} {relation} the drafter folder being imported ({source}), which "
            "writing the checkpoint there would destroy; write it to a folder apart from it"
        )
    for scratch in scratch_paths(out):
        if _relation(src, scratch.resolve()):
            raise ValueError(
                f"import: writing {out} first clears {scratch}, which holds the drafter folder "
                f"being imported ({source}); give --out another name"
            )
    check_new_or_ours(
        out,
        _earlier_import,
        "import: --out",
        "writing the checkpoint there would delete them (only an earlier import's checkpoint is "
        "replaced): give --out a new or empty folder, or move them out first",
    )


def run_import(source: str, recipe, folder: RunFolder | None = None, out: str | None = None) -> dict:
    """`specdraft import`: into a run (its checkpoints/imported, recorded as the run's drafter, so
    `eval`, `export` and `doctor` take it from there) or into a bare checkpoint folder (`out`)."""

    t0 = time.time()
    if folder is not None:
        trained = folder.stage("train")
        if trained and trained.get("state") == "done" and "imported_from" not in trained:
            raise ValueError(
                f"import: {folder.path} already holds a trained drafter ({trained.get('checkpoint')}); "
                "import into a new run (--run) or a folder (--out)"
            )
        out_path = folder.checkpoint("imported")
        index = folder.hidden / INDEX
        extracted = read_index(folder.hidden, ("aux_layer_ids",))["aux_layer_ids"] if index.exists() else None
    else:
        out_path, extracted = Path(out), None
    check_out(Path(source), out_path)
    target = Target(recipe.target.model)
    method = for_folder(_config(Path(source)))
    drafter, published = method.import_folder(Path(source), target, out_path, extracted)
    cfg = drafter.config
    print(f"import: {source} ({published.layout})")
    for note in published.notes:
        print(f"  {note}")
    print(f"  drafter: {method.describe(drafter)}")
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
    formats = "both" if len(method.formats) > 1 else method.formats[0]
    print(
        f"\nnext: specdraft eval --run {folder.path}    "
        f"(then: specdraft export --run {folder.path} --formats {formats})"
    )
    return entry
