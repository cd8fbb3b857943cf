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
interrupted stage leaves either the old file or the new one, never half of one; files written as a set
(eval's report.json + report.md + plot, export's folders) are renamed together at the stage's end.

A failed or interrupted stage leaves the run as it was: a command's `--set` values and flags reach the
recorded recipe only with a stage's `done` record, and a stage's last good record stays until a new run
of it succeeds (the failure is kept beside it, as its `attempt`). The temporaries a killed stage left in
its own outputs are removed when it starts again; specdraft writes only into folders it made.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
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


@contextlib.contextmanager
def staged_files(*paths: Path):
    """Temporary paths for files that belong together (a report and its plots): all renamed into place
    when the block ends without an error, none of them otherwise, so a failure midway never leaves half
    an old set and half a new one."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(atomic_path(Path(p))) for p in paths]


def scratch_paths(path: Path) -> tuple[Path, Path]:
    """The siblings a folder written whole uses: the new folder is written in the first, the one it
    replaces moved to the second while the new one is renamed in (remove_stale_temporaries knows both)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")


@contextlib.contextmanager
def staged_folders(*paths: Path):
    """Fresh, empty temporary folders for `paths`, each swapped in for its folder (the old one removed)
    when the block ends without an error; on any error they are removed and `paths` are left as they were."""
    scratch = [scratch_paths(p) for p in paths]
    try:
        for tmp, _ in scratch:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        yield [tmp for tmp, _ in scratch]
    except BaseException:
        for tmp, _ in scratch:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    for path, (tmp, old) in zip(paths, scratch):
        shutil.rmtree(old, ignore_errors=True)
        if Path(path).exists():
            Path(path).rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)


# The temporaries specdraft's writers leave when killed: atomic_path's `.NAME.tmp-PID`, the `.tmpXXXXXX`
# safetensors writes and renames (Rust's tempfile names), and a folder swap's `.NAME.tmp` / `.NAME.old`.
_ATOMIC_TMP = re.compile(r"^\..+\.tmp-(\d+)$")
_SAFETENSORS_TMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")
_SWAP_SCRATCH = re.compile(r"^\.(.+)\.(tmp|old)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clear_entry(entry: Path, removed: list[Path], every_tmp: bool) -> None:
    """Remove `entry` if it is a temporary a killed writer left (see above); a folder swap cut off
    between its renames gets its old folder back first."""
    name = entry.name
    atomic = _ATOMIC_TMP.match(name)
    if atomic and not entry.is_dir():
        if not _alive(int(atomic[1])):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    elif _SAFETENSORS_TMP.match(name) and entry.is_file() and not entry.is_symlink():
        if every_tmp:
            entry.unlink(missing_ok=True)
            removed.append(entry)
    elif (swap := _SWAP_SCRATCH.match(name)) and entry.is_dir() and not entry.is_symlink():
        home = entry.with_name(swap[1])
        if swap[2] == "old" and not home.exists():
            entry.rename(home)  # cut off between the swap's two renames: the old folder is the good one
            return
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)


def remove_stale_temporaries(outputs: list[Path], *, every_tmp: bool = True) -> list[Path]:
    """The temporaries killed writers left beside and inside `outputs` (a stage's own files and folders):
    atomic_path's of processes no longer running, safetensors' `.tmpXXXXXX` (`every_tmp`: no writer of
    these outputs is running), and folder swaps' scratch. A symlinked output is another run's (share_data)
    and is left alone. Returns what was removed."""
    removed: list[Path] = []
    for out in map(Path, outputs):
        if out.parent.is_dir():
            for entry in list(out.parent.iterdir()):
                if entry.name.startswith(f".{out.name}."):
                    _clear_entry(entry, removed, every_tmp)
        if out.is_dir() and not out.is_symlink():
            for root, dirs, names in os.walk(out):
                for name in [*dirs, *names]:
                    entry = Path(root) / name
                    if name.startswith("."):
                        _clear_entry(entry, removed, every_tmp)
                dirs[:] = [d for d in dirs if (Path(root) / d).is_dir()]
    return removed


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


def _under(*parts: str) -> property:
    """A path of a run folder's layout: `parts` under its root."""
    return property(lambda self: self.path.joinpath(*parts))


class RunFolder:
    """A run folder `runs/<name>/`: the paths of its artifacts and its manifest.json."""

    def __init__(self, path: Path, recipe: Recipe | None = None):
        self.path = Path(path)
        # The recipe this command runs with (open_run's: the run's, with the command's --set values and
        # flags on top): written into the manifest with a stage's done record, never before.
        self.command_recipe = recipe

    # --- layout: every artifact of a run, named here and nowhere else ---------------------------
    manifest_path = _under(MANIFEST)
    conversations = _under("conversations.jsonl")
    gen_errors = _under("gen_errors.jsonl")
    gen_in_flight = _under("gen_in_flight.jsonl")
    tokens = _under("tokens")
    hidden = _under("hidden")
    # The states server specdraft starts for train.hidden = "served": its log, and the scratch folder its
    # connector writes each request's states to (deleted as read, bounded by served_scratch_bytes).
    served = _under("served")
    checkpoints = _under("checkpoints")
    # Where a new training that starts over moves the last good one's checkpoints until it succeeds.
    previous_checkpoints = _under("checkpoints.previous")
    train_log = _under("checkpoints", "train_log.jsonl")
    tensorboard = _under("checkpoints", "tensorboard")
    curves = _under("checkpoints", "curves.png")
    exports = _under("export")
    eval = _under("eval")
    eval_report = _under("eval", "report.json")
    calibration = _under("calibration.json")
    status = _under("STATUS.md")

    def checkpoint(self, name: CheckpointName) -> Path:
        return self.checkpoints / name

    def export(self, fmt: str) -> Path:
        return self.exports / fmt

    # --- the manifest ---------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> dict:
        if not self.exists():
            return {"stages": {}}
        return check_manifest(
            files.read_json(self.manifest_path, fix=MANIFEST_FIX, what="the run's manifest"), self.manifest_path
        )

    def save_manifest(self, manifest: dict) -> None:
        write_json(self.manifest_path, manifest)

    def recipe(self) -> Recipe:
        """The recipe the run was created with (stages run alone read it from here)."""
        m = self.manifest()
        if "recipe" not in m:
            raise FileNotFoundError(f"{self.manifest_path}: no recipe recorded; pass --recipe")
        return recipe_from_dict(m["recipe"], str(self.manifest_path))

    def init(self, recipe: Recipe) -> None:
        """Create the folder and record `recipe` as the run's (set-up code and tests; commands go through
        open_run, which records a command's recipe only when its stage succeeds)."""
        self.path.mkdir(parents=True, exist_ok=True)
        m = self.manifest()
        m.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        m["name"] = recipe.name
        m["recipe"] = to_dict(recipe)
        m.setdefault("stages", {})
        self.save_manifest(m)

    def create(self, recipe: Recipe) -> None:
        """A new run: the folder and its manifest with `recipe`, which a stage run alone reads (and a
        rerun of a failed first stage resumes with). An existing run is left as it is."""
        if not self.exists():
            self.init(recipe)

    def runs_with(self, recipe: Recipe) -> None:
        """The recipe this command runs with, recorded with its stage's done record."""
        self.command_recipe = recipe

    def record(
        self,
        stage: str,
        *,
        state: str,
        config=None,
        counts=None,
        metrics=None,
        seconds: float | None = None,
        extra: dict | None = None,
    ) -> dict:
        """Record a stage's state (done / partial / failed) with what it counted and measured.

        `done` replaces the stage's record and writes the command's recipe (its --set values) as the run's.
        Anything else, where the stage has a good (done) record, is kept beside it as its `attempt`: the
        good record, which later stages and STATUS.md read, stays until a new run of the stage succeeds."""
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
        stages = m.setdefault("stages", {})
        good = stages.get(stage)
        if state == "done":
            stages[stage] = entry
            if self.command_recipe is not None:
                m["name"] = self.command_recipe.name
                m["recipe"] = to_dict(self.command_recipe)
        else:
            unrecorded = self.unrecorded_changes(m)
            if unrecorded:
                entry["recipe_not_recorded"] = unrecorded
            if good is not None and good.get("state") == "done":
                good["attempt"] = entry
            else:
                stages[stage] = entry
        self.save_manifest(m)
        return entry

    def unrecorded_changes(self, manifest: dict | None = None) -> dict:
        """The fields where this command's recipe differs from the run's recorded one ("section.field":
        [recorded, this command's]): what a failed stage's --set values would have changed."""
        if self.command_recipe is None:
            return {}
        recorded = (manifest if manifest is not None else self.manifest()).get("recipe") or {}
        return _differences(recorded, to_dict(self.command_recipe))

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
        """The stage's good record; refused (one line) when it has none, or when a later run of it that
        did not finish rewrote its outputs in place (extract's shards)."""
        entry = self.stage(stage)
        if entry is None or entry["state"] != "done":
            state = "missing" if entry is None else entry["state"]
            raise RuntimeError(f"stage {stage!r} is {state} in {self.path}; run `specdraft {stage}` first")
        known = STAGES.get(stage)
        if entry.get("attempt") and known is not None and known.intact is not None and not known.intact(self):
            attempt = entry["attempt"]
            why = f" ({attempt['error']})" if attempt.get("error") else ""
            raise RuntimeError(
                f"stage {stage!r} was run again in {self.path} and did not finish{why}, leaving "
                f"its outputs part rewritten; rerun `specdraft {stage}` to finish it"
            )
        return entry

    def set_aside_checkpoints(self) -> None:
        """Before a training that starts over: the last good one's checkpoints moved to
        checkpoints.previous/ (its record pointed there) so that a retraining that fails leaves the
        trained drafter; removed once a new training succeeds (drop_previous_checkpoints). Without a good
        training on disk, the checkpoints are cleared."""
        m = self.manifest()
        entry = m.get("stages", {}).get("train") or {}
        kept = entry.get("checkpoint", "checkpoints/final")
        if (
            entry.get("state") == "done"
            and kept.startswith(f"{self.checkpoints.name}/")
            and (self.path / kept).exists()
        ):
            shutil.rmtree(self.previous_checkpoints, ignore_errors=True)
            self.checkpoints.rename(self.previous_checkpoints)
            entry["checkpoint"] = f"{self.previous_checkpoints.name}/{kept.split('/', 1)[1]}"
            self.save_manifest(m)
        else:
            shutil.rmtree(self.checkpoints, ignore_errors=True)

    def drop_previous_checkpoints(self) -> None:
        """checkpoints.previous/, once the train record no longer points into it."""
        entry = self.stage("train") or {}
        if not entry.get("checkpoint", "").startswith(f"{self.previous_checkpoints.name}/"):
            shutil.rmtree(self.previous_checkpoints, ignore_errors=True)

    def clear_temporaries(self, stage: str) -> list[Path]:
        """What a killed run of `stage` left in its own outputs (remove_stale_temporaries), and the run's
        own manifest / STATUS.md temporaries; for train, a checkpoints.previous/ no record points to, or
        the record of one a kill cut off while it was being moved there."""
        outputs = [getattr(self, name) for name in STAGES[stage].outputs] if stage in STAGES else []
        removed = remove_stale_temporaries([self.manifest_path, self.status])
        removed += remove_stale_temporaries(outputs)
        if stage == "train" and self.exists():
            self._finish_set_aside()
            self.drop_previous_checkpoints()
        return removed

    def _finish_set_aside(self) -> None:
        """A kill between set_aside_checkpoints' rename and its manifest write: point the record there."""
        m = self.manifest()
        entry = m.get("stages", {}).get("train") or {}
        kept = entry.get("checkpoint", "checkpoints/final")
        moved = self.previous_checkpoints / kept.split("/", 1)[-1]
        if (
            entry.get("state") == "done"
            and kept.startswith(f"{self.checkpoints.name}/")
            and not (self.path / kept).exists()
            and moved.exists()
        ):
            entry["checkpoint"] = str(moved.relative_to(self.path))
            self.save_manifest(m)


def _differences(recorded: dict, new: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in new.items():
        old = recorded.get(key) if isinstance(recorded, dict) else None
        if isinstance(value, dict) and isinstance(old, dict):
            out.update(_differences(old, value, f"{prefix}{key}."))
        elif value != old:
            out[f"{prefix}{key}"] = [old, value]
    return out


def is_run_folder(path: Path) -> bool:
    """Whether `path` holds a specdraft run's manifest.json (a manifest.json that is JSON but not a run's,
    such as a web app's, is not one; one that does not parse is left to the manifest's reader)."""
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        doc = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return True
    return isinstance(doc, dict) and isinstance(doc.get("stages"), dict)


def check_new_or_ours(path: Path, ours: Callable[[Path], bool], what: str, fix: str) -> None:
    """Refuse, before anything is written, a folder specdraft would write into that holds files it did
    not write: `path` must be new, an empty folder, or one `ours` recognises. `what` names the option;
    `fix` says what to give instead."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file, not a folder; {fix}")
    # specdraft's own temporaries do not count: another process of a torchrun may be creating the run.
    if path.is_dir() and any(not _ATOMIC_TMP.match(p.name) for p in path.iterdir()) and not ours(path):
        raise ValueError(f"{what} {path} holds files specdraft did not write; {fix}")


# --- how far along a stage is that has not recorded itself done --------------------------------


def _gen_progress(folder: RunFolder, recipe: dict) -> dict | None:
    if not folder.conversations.exists():
        return None
    # A torn last line is skipped: gen repairs it when it resumes.
    lines = files.read_jsonl(
        folder.conversations,
        torn_tail=True,
        fix="remove the line (gen answers its prompt again) or start over in a new run folder",
    )
    records = sum("id" in record for _, record in lines)
    # gen.num_samples (when the recipe sets it) or data.num_train conversations make gen done; both 0
    # means every usable one, a count gen alone knows (fraction None: started, share unknown).
    of = recipe["gen"].get("num_samples") or recipe["data"]["num_train"]
    fraction = min(1.0, records / of) if of else (None if records else 0.0)
    return {
        "records": records,
        "of": of or "all",
        "unit": "conversations",
        "fraction": fraction,
        "source": "conversations.jsonl lines, of gen.num_samples or data.num_train",
    }


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
    return {
        "shards": len(written),
        "shards_of": len(names),
        "samples": len(done),
        "samples_of": len(index["samples"]),
        "tokens": tokens,
        "tokens_of": total_tokens,
        "fraction": tokens / max(1, total_tokens),
        "index_state": index.get("state"),
        "source": "hidden/index.json and the shard files present",
    }


def _extract_intact(folder: RunFolder) -> bool:
    """extract rewrites its shards in place (the hidden states are too big to keep twice): a later
    extract that did not finish leaves hidden/index.json partial."""
    progress = _extract_progress(folder, {})
    return progress is None or progress["index_state"] == "done"


def _train_progress(folder: RunFolder, recipe: dict) -> dict | None:
    config = folder.checkpoint("latest") / "config.json"
    if not (folder.checkpoint("latest") / "COMPLETE").exists() or not config.exists():
        return None
    step = files.read_json(config, fix="rerun `specdraft train` (it resumes from the last whole checkpoint)").get(
        "step"
    )
    return {"latest_checkpoint_step": step, "source": "checkpoints/latest/config.json"}


# --- the stages, in pipeline order ---------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    name: str
    module: str  # holds run(recipe, folder)
    section: str  # the recipe section whose fields become the subcommand's flags
    outputs: tuple[str, ...]  # RunFolder attributes it writes; the first is what a later run can share
    progress: Callable[[RunFolder, dict], dict | None] | None = None  # None: it writes its outputs whole
    # Whether its outputs are still its last good run's after a later run that did not finish (None: a
    # run writes them whole at its end, or only adds to them, so they are).
    intact: Callable[[RunFolder], bool] | None = None


PIPELINE = (
    Stage("gen", "specdraft.stages.gen", "gen", ("conversations", "gen_errors", "gen_in_flight"), _gen_progress),
    Stage("render", "specdraft.stages.render", "render", ("tokens",)),
    Stage("extract", "specdraft.stages.extract", "extract", ("hidden",), _extract_progress, _extract_intact),
    Stage("train", "specdraft.stages.train", "train", ("checkpoints",), _train_progress),
    Stage("export", "specdraft.stages.export", "export", ("exports",)),
    Stage("eval", "specdraft.stages.eval", "eval", ("eval",)),
)
STAGES = {s.name: s for s in PIPELINE}


def check_run_folder(path: Path) -> None:
    """Refuse a --run folder that is not a specdraft run's and not new or empty: specdraft would write
    its manifest and stage outputs among the user's files."""
    check_new_or_ours(
        path,
        is_run_folder,
        "--run",
        "a run's manifest and outputs would be written among them: give a new or empty folder, "
        "or a run folder specdraft made (it holds manifest.json)",
    )


def open_run(
    recipe_name: str | None,
    run_dir: str | None,
    sets: list[str],
    flags: dict | None = None,
    check: Callable[[Recipe], None] | None = None,
) -> tuple[Recipe, RunFolder]:
    """The recipe and run folder a command works on: the run's recorded recipe when no recipe is named
    and the run exists, else the named (or default) recipe; then `--set` items and stage flags
    (`{"train.epochs": "3"}`) on top. Once `check` (the command's own refusals, e.g. a key variable that
    is not set) has passed, a new run is created with that recipe recorded; an existing run's recorded
    recipe changes only when the command's stage succeeds (RunFolder.record). Every process of a
    torchrun calls this."""
    recipe = load_recipe(recipe_name or DEFAULT_RECIPE)
    folder = RunFolder(Path(run_dir) if run_dir else Path("runs") / recipe.name)
    check_run_folder(folder.path)
    if not recipe_name and folder.exists():
        recipe = folder.recipe()
    apply_sets(recipe, sets, check=False)
    for dotted, value in (flags or {}).items():
        if value is not None:
            apply_override(recipe, dotted, value)
    check_recipe(recipe)  # the checks across fields, once every --set and flag is in
    if check is not None:
        check(recipe)
    folder.create(recipe)
    folder.runs_with(recipe)
    return recipe, folder
