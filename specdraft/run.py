"""The run folder and its manifest: the only place that keeps state between stages.

Every file a stage produces is written under a temporary name and renamed into place, so an
interrupted stage leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from . import environment
from .config import Recipe, recipe_from_dict, to_dict

MANIFEST = "manifest.json"


@contextlib.contextmanager
def atomic_path(path: Path):
    """Yield a temporary path beside `path`; on success rename it over `path`, else remove it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if tmp.exists():
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


class Run:
    """A run folder `runs/<name>/` and its manifest.json."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def manifest(self) -> dict:
        if not self.exists():
            return {"stages": {}}
        return json.loads(self.manifest_path.read_text())

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
        from .data.generate import CONVERSATIONS
        from .data.render import TOKENS_DIR
        from .hidden.store import HIDDEN_DIR

        if self.exists():
            return
        outputs = {"gen": CONVERSATIONS, "render": TOKENS_DIR, "extract": HIDDEN_DIR}
        shared = list(outputs)[: list(outputs).index(through) + 1]
        source = Path(source)
        manifest = Run(source).manifest()
        manifest["stages"] = {k: v for k, v in manifest["stages"].items() if k in shared}
        self.path.mkdir(parents=True, exist_ok=True)
        for stage in shared:
            if (source / outputs[stage]).exists() and not (self.path / outputs[stage]).exists():
                (self.path / outputs[stage]).symlink_to((source / outputs[stage]).resolve())
        self.save_manifest(manifest)

    def require(self, stage: str) -> dict:
        entry = self.stage(stage)
        if entry is None or entry["state"] != "done":
            state = "missing" if entry is None else entry["state"]
            raise RuntimeError(f"stage {stage!r} is {state} in {self.path}; run `specdraft {stage}` first")
        return entry
