"""The package's layering, read from its import graph by import-linter (contracts in pyproject.toml):
the CLI on the stages, the stages on the library, no stage importing another, no import cycles.
The same check on a copy with one stage importing another must fail, so the check can fail."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """import-linter with the repository's contracts, on the `specdraft` package found in `package_parent`."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))"
    )
    # Run from the package's parent: `python -c` puts the working folder first on sys.path.
    return subprocess.run([sys.executable, "-c", code], cwd=package_parent, env=env, capture_output=True, text=True)


def test_the_package_keeps_its_layers():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "importer,line,broken",
    [
        (
            "stages/eval.py",
            "from specdraft.stages.gen import run as _gen_run",
            "specdraft.stages.eval -> specdraft.stages.gen",
        ),
        (
            "hidden/store.py",
            "from specdraft.stages import extract as _extract",
            "specdraft.hidden.store -> specdraft.stages.extract",
        ),
    ],
)
def test_a_forbidden_import_breaks_the_contracts(importer, line, broken, tmp_path):
    """A stage importing another stage, or a library module importing a stage, on a copy of the package."""
    shutil.copytree(ROOT / "specdraft", tmp_path / "specdraft", ignore=shutil.ignore_patterns("__pycache__"))
    module = tmp_path / "specdraft" / importer
    module.write_text(module.read_text() + f"\n{line}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert broken in result.stdout


def _contract(name: str) -> dict:
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["name"] == name)


def test_every_method_package_is_kept_behind_the_registry():
    """The contracts name every registered method's package: one left out could be imported by a stage."""
    from specdraft.methods import METHODS

    packages = {type(m).__module__ for m in METHODS.values()}
    assert (
        set(
            _contract("stages and shared library modules ask the registry, never a method's package")[
                "forbidden_modules"
            ]
        )
        == packages
    )
    assert set(_contract("no method's package imports another's")["modules"]) == packages


# A method's name, or the name of one of its modules, as code would write it.
METHOD_WORD = re.compile(r"(?<![A-Za-z0-9])(eagle3|dflash|peagle)(?![A-Za-z0-9])", re.IGNORECASE)


def test_no_stage_names_a_method():
    """Stages never branch on a method: outside the method packages (and the registry) no stage names
    one, in code or in prose, so a method added is a package, not edits across the stages."""
    found = []
    for path in sorted((ROOT / "specdraft" / "stages").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if METHOD_WORD.search(line):
                found.append(f"{path.name}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_a_stage_naming_a_method_is_found(tmp_path):
    assert METHOD_WORD.search('    if drafter.METHOD == "dflash":')
    assert METHOD_WORD.search("from specdraft.methods.eagle3 import formats")
    assert not METHOD_WORD.search("a DFlashy name, eagle30")


# A comparison with a method's name: `== "dflash"`, `"eagle3" !=`, `in ("eagle3", ...)`.
METHOD_COMPARISON = re.compile(
    r"""[=!]=\s*["'](eagle3|dflash|peagle)["']|["'](eagle3|dflash|peagle)["']\s*[=!]="""
    r"""|\bin\s*[(\[{][^)\]}]*["'](eagle3|dflash|peagle)["']"""
)


def test_no_library_module_compares_a_method_name():
    """Outside the method packages nothing branches on a method's name (config's Literal of them aside):
    a method's own checks are its package's."""
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "specdraft").rglob("*.py"))
        if "methods" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if METHOD_COMPARISON.search(line)
    ]
    assert not found, "\n".join(found)
    assert METHOD_COMPARISON.search('if t.method == "dflash" and t.mask_token_id >= vocab_size:')
    assert METHOD_COMPARISON.search("if method in ('eagle3', 'x'):")


def test_the_code_cites_what_exists_and_no_issue_numbers():
    """A document the code cites (docs/*.md, bench/*.md) exists, and no comment cites an issue's number:
    the reader has the repository, not the tracker."""
    cited = re.compile(r"\b((?:docs|bench)/[\w.-]+\.md)\b")
    issue = re.compile(r"\bissues?[ -]#?\d+|(?<![\w&])#\d{1,4}\b", re.IGNORECASE)
    dangling, numbered = [], []
    for path in sorted([*(ROOT / "specdraft").rglob("*.py"), *(ROOT / "tests").glob("*.py")]):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            dangling += [f"{where}: {doc}" for doc in cited.findall(line) if not (ROOT / doc).exists()]
            if issue.search(line) and path.name != "test_layering.py":
                numbered.append(f"{where}: {line.strip()}")
    assert not dangling and not numbered, "\n".join(dangling + numbered)
    assert issue.search("(issue 24)") and issue.search("see #23") and not issue.search("f'{x:#x}'")


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command):
    """ruff with pyproject.toml's settings over the repository (a second or two): lint findings and unformatted
    files fail the README's test command, as in CI."""
    result = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
