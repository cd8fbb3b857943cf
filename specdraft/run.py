"""The run folder: the one place that names a run's artifacts, keeps its manifest (the only hand-off
between stages) and lists the stages in their order.

    runs/<name>/
      manifest.json          stages, their config, counts, measured figures, the machine
      conversations.jsonl    gen (+ gen_errors.jsonl, gen_in_flight.jsonl)
      tokens/                render
      hidden/                extract
      served/                train with hidden = "served": the states server's log and scratch folder
      checkpoints/           train: latest/, best/, final/ (+ train_log.jsonl, tensorboard/, curves.png)
      export/vllm/ export/sglang/   export
      eval/                  eval: report.json, report.md, plots
      STATUS.md              status
      calibration.json       plan: this machine's timed steps of the stages' work (specdraft.calibrate)

Every file a stage produces is written under a temporary name and renamed into place, so an
interrupted stage leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from specdraft import environment, files
from specdraft.config import (
    Recipe,
    apply_override,
    apply_sets,
    check_recipe,
    load_recipe,
    recipe_from_dict,
    to_dict,
)

MANIFEST = "manifest.json"
DEFAULT_RECIPE = "smollm2-cpu"
CheckpointName = Literal["latest", "best", "final", "imported"]


@contextlib.contextmanager
def atomic_path(path: Path, needed: int | None = None):
    """Yield a temporary path beside `path`; on success rename it over `path`, else remove it. A full
    disk is one DiskFull line naming `path` and the bytes it `needed` (when the caller knows them)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if tmp.exists():
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.errno not in files.FULL:
            raise
        raise files.full_disk(e, path, needed, files.size_of(tmp)) from None
    finally:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()


def write_text(path: Path, text: str) -> None:
    data = text.encode()
    with atomic_path(path, needed=len(data)) as tmp:
        tmp.write_bytes(data)


def write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


# What to do with a manifest.json specdraft cannot read: it is only ever replaced whole, so a damaged one
# was written by something else; its stages' files are still there.
MANIFEST_FIX = "restore it from a copy or fix that entry by hand (specdraft writes it whole: something else changed it)"


def check_manifest(m: dict, path: Path) -> dict:
    """The manifest `m` read from `path`, checked for what every reader of it takes as given: a
    `stages` object of objects, each with its `state`, and an object as its `recipe`."""
    stages = m.get("stages", {})
    if not isinstance(stages, dict):
        raise files.FileError(f"{path}: 'stages' is a JSON {type(stages).__name__}, not an object; {MANIFEST_FIX}")
    for name, entry in stages.items():
        state = entry.get("state") if isinstance(entry, dict) else None
        if not isinstance(state, str):
            found = "no 'state'" if isinstance(entry, dict) else f"a JSON {type(entry).__name__}, not an object"
            raise files.FileError(f"{path}: stage {name!r} has {found}; {MANIFEST_FIX}")
    if not isinstance(m.get("recipe", {}), dict):
        raise files.FileError(f"{path}: 'recipe' is not an object; {MANIFEST_FIX}")
    m.setdefault("stages", stages)
    return m


class RunFolder:
    """A run folder `runs/<name>/`: the paths of its artifacts and its manifest.json."""

    def __init__(self, path: Path):
        self.path = Path(path)

    # --- layout: every artifact of a run, named here and nowhere else ---------------------------
    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    @property
    def conversations(self) -> Path:
        return self.path / "conversations.jsonl"

    @property
    def gen_errors(self) -> Path:
        return self.path / "gen_errors.jsonl"

    @property
    def gen_in_flight(self) -> Path:
        return self.path / "gen_in_flight.jsonl"

    @property
    def tokens(self) -> Path:
        return self.path / "tokens"

    @property
    def hidden(self) -> Path:
        return self.path / "hidden"

    @property
    def served(self) -> Path:
        """The states server specdraft starts for train.hidden = "served": its log, and the scratch folder
        its connector writes each request's states to (deleted as read, bounded by served_scratch_bytes)."""
        return self.path / "served"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint(self, name: CheckpointName) -> Path:
        return self.checkpoints / name

    @property
    def train_log(self) -> Path:
        return self.checkpoints / "train_log.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.checkpoints / "tensorboard"

    @property
    def curves(self) -> Path:
        return self.checkpoints / "curves.png"

    @property
    def exports(self) -> Path:
        return self.path / "export"

    def export(self, fmt: str) -> Path:
        return self.exports / fmt

    @property
    def eval(self) -> Path:
        return self.path / "eval"

    @property
    def eval_report(self) -> Path:
        return self.eval / "report.json"

    @property
    def calibration(self) -> Path:
        return self.path / "calibration.json"

    @property
    def status(self) -> Path:
        return self.path / "STATUS.md"

    # --- the manifest ---------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> dict:
        if not self.exists():
            return {"stages": {}}
        return check_manifest(files.read_json(self.manifest_path, fix=MANIFEST_FIX, what="the run's manifest"),
                              self.manifest_path)

    def save_manifest(self, manifest: dict) -> None:
        write_json(self.manifest_path, manifest)

    def recipe(self) -> Recipe:
        """The recipe the run was created with (stages run alone read it from here)."""
        m = self.manifest()
        if "recipe" not in m:
            raise FileNotFoundError(f"{self.manifest_path}: no recipe recorded; pass --recipe")
        return recipe_from_dict(m["recipe"], str(self.manifest_path))

    def init(self, recipe: Recipe) -> None:
        """Create the folder, or update the recorded recipe when flags changed it."""
        self.path.mkdir(parents=True, exist_ok=True)
        m = self.manifest()
        m.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        m["name"] = recipe.name
        m["recipe"] = to_dict(recipe)
        m.setdefault("stages", {})
        self.save_manifest(m)

    def record(self, stage: str, *, state: str, config=None, counts=None, metrics=None,
               seconds: float | None = None, extra: dict | None = None) -> dict:
        """Record a stage's state (done / partial / failed) with what it counted and measured."""
        m = self.manifest()
        entry = {
            "state": state,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": to_dict(config) if config is not None else None,
            "counts": counts or {},
            "metrics": metrics or {},
            "seconds": round(seconds, 2) if seconds is not None else None,
            "environment": environment.describe(self.path),
        }
        if extra:
            entry.update(extra)
        m.setdefault("stages", {})[stage] = entry
        self.save_manifest(m)
        return entry

    def stage(self, stage: str) -> dict | None:
        return self.manifest().get("stages", {}).get(stage)

    def share_data(self, source: Path, through: str) -> None:
        """Make this folder a run on another run's data: `source`'s manifest with its stages up to
        `through` ("gen", "render" or "extract") and links to the files they wrote, so only the later
        stages run here (a variant trained on the same hidden states; an fp8 extract of the same tokens).
        A folder that already has a manifest is left as it is."""
        if self.exists():
            return
        names = [s.name for s in PIPELINE]
        shared = names[: names.index(through) + 1]
        source = RunFolder(source)
        manifest = source.manifest()
        manifest["stages"] = {k: v for k, v in manifest["stages"].items() if k in shared}
        self.path.mkdir(parents=True, exist_ok=True)
        for stage in shared:
            output = STAGES[stage].outputs[0]
            theirs, ours = getattr(source, output), getattr(self, output)
            if theirs.exists() and not ours.exists():
                ours.symlink_to(theirs.resolve())
        self.save_manifest(manifest)

    def require(self, stage: str) -> dict:
        entry = self.stage(stage)
        if entry is None or entry["state"] != "done":
            state = "missing" if entry is None else entry["state"]
            raise RuntimeError(f"stage {stage!r} is {state} in {self.path}; run `specdraft {stage}` first")
        return entry


# --- how far along a stage is that has not recorded itself done --------------------------------

def _gen_progress(folder: RunFolder, recipe: dict) -> dict | None:
    if not folder.conversations.exists():
        return None
    # A torn last line is skipped: gen repairs it when it resumes.
    lines = files.read_jsonl(folder.conversations, torn_tail=True,
                             fix="remove the line (gen answers its prompt again) or start over in a new run folder")
    records = sum("id" in record for _, record in lines)
    # gen.num_samples (when the recipe sets it) or data.num_train conversations make gen done; both 0
    # means every usable one, a count gen alone knows (fraction None: started, share unknown).
    of = recipe["gen"].get("num_samples") or recipe["data"]["num_train"]
    fraction = min(1.0, records / of) if of else (None if records else 0.0)
    return {"records": records, "of": of or "all", "unit": "conversations", "fraction": fraction,
            "source": "conversations.jsonl lines, of gen.num_samples or data.num_train"}


def _extract_progress(folder: RunFolder, recipe: dict) -> dict | None:
    index_path = folder.hidden / "index.json"
    if not index_path.exists():
        return None
    fix = "rerun `specdraft extract` (it rewrites what it needs)"
    index = files.read_json(index_path, fix=fix)
    try:
        # A shard file that exists is whole: extract writes each under a temporary name, then renames it.
        names = [s if isinstance(s, str) else s["name"] for s in index["shards"]]
        written = {s for s in names if (folder.hidden / s).exists()}
        done = [s for s in index["samples"] if s["shard"] in written]
        total_tokens = sum(s["tokens"] for s in index["samples"])
        tokens = sum(s["tokens"] for s in done)
    except (KeyError, TypeError) as e:
        raise files.FileError(f"{index_path}: not extract's index ({type(e).__name__}: {e}); {fix}") from None
    return {"shards": len(written), "shards_of": len(names), "samples": len(done),
            "samples_of": len(index["samples"]), "tokens": tokens, "tokens_of": total_tokens,
            "fraction": tokens / max(1, total_tokens), "index_state": index.get("state"),
            "source": "hidden/index.json and the shard files present"}


def _train_progress(folder: RunFolder, recipe: dict) -> dict | None:
    config = folder.checkpoint("latest") / "config.json"
    if not (folder.checkpoint("latest") / "COMPLETE").exists() or not config.exists():
        return None
    step = files.read_json(config, fix="rerun `specdraft train` (it resumes from the last whole checkpoint)").get("step")
    return {"latest_checkpoint_step": step, "source": "checkpoints/latest/config.json"}


# --- the stages, in pipeline order ---------------------------------------------------------------

@dataclass(frozen=True)
class Stage:
    name: str
    module: str  # holds run(recipe, folder)
    section: str  # the recipe section whose fields become the subcommand's flags
    outputs: tuple[str, ...]  # RunFolder attributes it writes; the first is what a later run can share
    progress: Callable[[RunFolder, dict], dict | None] | None = None  # None: it writes its outputs whole


PIPELINE = (
    Stage("gen", "specdraft.stages.gen", "gen", ("conversations", "gen_errors"), _gen_progress),
    Stage("render", "specdraft.stages.render", "render", ("tokens",)),
    Stage("extract", "specdraft.stages.extract", "extract", ("hidden",), _extract_progress),
    Stage("train", "specdraft.stages.train", "train", ("checkpoints",), _train_progress),
    Stage("export", "specdraft.stages.export", "export", ("exports",)),
    Stage("eval", "specdraft.stages.eval", "eval", ("eval",)),
)
STAGES = {s.name: s for s in PIPELINE}


def open_run(recipe_name: str | None, run_dir: str | None, sets: list[str], flags: dict | None = None,
             check: Callable[[Recipe], None] | None = None) -> tuple[Recipe, RunFolder]:
    """The recipe and run folder a command works on: the run's recorded recipe when no recipe is named
    and the run exists, else the named (or default) recipe; then `--set` items and stage flags
    (`{"train.epochs": "3"}`) on top. The folder is created, with the recipe recorded, once `check` (the
    command's own refusals, e.g. a key variable that is not set) has passed: a refused value is not written."""
    recipe = load_recipe(recipe_name or DEFAULT_RECIPE)
    folder = RunFolder(Path(run_dir) if run_dir else Path("runs") / recipe.name)
    if not recipe_name and folder.exists():
        recipe = folder.recipe()
    apply_sets(recipe, sets, check=False)
    for dotted, value in (flags or {}).items():
        if value is not None:
            apply_override(recipe, dotted, value)
    check_recipe(recipe)  # the checks across fields, once every --set and flag is in
    if check is not None:
        check(recipe)
    folder.init(recipe)
    return recipe, folder
