"""The memorised drafters the serving, doctor and decoder tests share, trained once and kept outside the
checkout (`$SPECDRAFT_CACHE/test-runs`, default ~/.cache/specdraft) under a key of what the trained run
really depends on.

A memorised run is gen, render, extract and train of a small recipe through the CLI. Its key hashes the
recipe, the compute dtype, the torch and transformers versions, the target's weights, and the code those
four stages import (the import closure of `specdraft.cli` and the four stage modules, never entering
another stage), read as syntax trees without their docstrings: a change to `eval`, `doctor` or `export`,
or to a comment or docstring anywhere, keeps the cached run; a change to the trainer or anything it
imports trains anew.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specdraft"
# The stages a memorised run is built with; every other stage only reads one.
BUILD_STAGES = ("gen", "render", "extract", "train")
# Every change to the trainer's code makes new keys, so the cache keeps the runs used most recently and
# drops the rest: a handful of recipes times a few checkouts in use at once. A run used in the last hour
# stays whatever its rank, since another session may be copying it.
KEEP_RUNS = 12
KEEP_SECONDS = 3600


def _module_file(root: Path, dotted: str) -> Path | None:
    """The file of `specdraft.a.b` under `root` (the package folder), or None when it is no module."""
    parts = dotted.split(".")[1:]
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(tree: ast.AST) -> set[str]:
    """Every `specdraft…` name an import statement anywhere in the file names (function-level too):
    `from specdraft.x import y` yields both `specdraft.x` and `specdraft.x.y` (y may be a module)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.split(".")[0] == "specdraft"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "specdraft":
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _without_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]
    return tree


def build_closure(root: Path = PACKAGE) -> dict[str, str]:
    """{module: its syntax tree without docstrings, dumped} for the code a memorised run is built with.
    A module's parent packages count too (their `__init__` runs on import)."""
    other_stages = {
        f"specdraft.stages.{p.stem}"
        for p in (root / "stages").glob("*.py")
        if p.stem not in BUILD_STAGES and p.stem != "__init__"
    }
    todo = ["specdraft.cli", *(f"specdraft.stages.{s}" for s in BUILD_STAGES)]
    seen: dict[str, str] = {}
    while todo:
        name = todo.pop()
        path = _module_file(root, name)
        if name in seen or path is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += [n for n in (*_imported(tree), *parents) if n not in other_stages]
        seen[name] = ast.dump(_without_docstrings(tree))
    return seen


def cache_key(recipe: str, target, dtype: str, root: Path = PACKAGE) -> str:
    import torch
    import transformers

    h = hashlib.sha256(recipe.encode())
    h.update(f"dtype {dtype} torch {torch.__version__} transformers {transformers.__version__}".encode())
    h.update(f"{target.path.name} {sorted(target.fingerprint().items())}".encode())
    for name, dumped in sorted(build_closure(root).items()):
        h.update(f"{name}\n{dumped}\n".encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    from specdraft.targets import cache_dir

    return cache_dir() / "test-runs"


def build(recipe: str, key: str, workdir: Path) -> Path:
    """The trained run of `recipe`, from the cache or trained now into it (whole or absent: trained in
    `workdir`, copied next to its place, then renamed; two sessions building at once both succeed)."""
    from specdraft.cli import main

    cached = cache_root() / key
    if (cached / "checkpoints" / "final").exists():
        os.utime(cached)  # its last use, which pruning ranks by
        prune(cache_root())
        return cached
    (workdir / "recipe.toml").write_text(recipe)
    for stage in BUILD_STAGES:
        assert main([stage, "--recipe", str(workdir / "recipe.toml"), "--run", str(workdir / "run")]) == 0
    staging = cached.with_name(f"{key}.tmp-{os.getpid()}")
    staging.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(workdir / "run", staging)
    try:
        os.replace(staging, cached)
        os.utime(cached)
    except OSError:
        shutil.rmtree(staging)  # another session put its (identical) run there first
    prune(cache_root())
    return cached


def prune(root: Path, keep: int = KEEP_RUNS, keep_seconds: float = KEEP_SECONDS) -> list[Path]:
    """Removes the cached runs past the `keep` used most recently and unused for `keep_seconds`, and the
    staging copies of builds that died; returns what it removed."""
    now = time.time()
    entries = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    stale = [p for p in entries if ".tmp-" in p.name and now - p.stat().st_mtime > keep_seconds]
    runs = [p for p in entries if ".tmp-" not in p.name]
    stale += [p for p in runs[keep:] if now - p.stat().st_mtime > keep_seconds]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def trained_copy(recipe: str, target, tmp_path_factory) -> Path:
    """A copy of the trained run of `recipe` (trained now or taken from the cache), for a test to write into."""
    from specdraft.targets import resolve_dtype

    key = cache_key(recipe, target, resolve_dtype("auto", "cpu"))
    cached = build(recipe, key, tmp_path_factory.mktemp("memorised-build"))
    run = tmp_path_factory.mktemp("memorised") / "run"
    shutil.copytree(cached, run)
    return run
