"""The package's layering, read from its import graph by import-linter (contracts in pyproject.toml):
the CLI on the stages, the stages on the library, no stage importing another, no import cycles.
The same check on a copy with one stage importing another must fail, so the check can fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """import-linter with the repository's contracts, on the `specdraft` package found in `package_parent`."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True))")
    # Run from the package's parent: `python -c` puts the working folder first on sys.path.
    return subprocess.run([sys.executable, "-c", code], cwd=package_parent, env=env, capture_output=True, text=True)


def test_the_package_keeps_its_layers():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("importer,line,broken", [
    ("stages/eval.py", "from specdraft.stages.gen import run as _gen_run", "specdraft.stages.eval -> specdraft.stages.gen"),
    ("hidden/store.py", "from specdraft.stages import extract as _extract",
     "specdraft.hidden.store -> specdraft.stages.extract"),
])
def test_a_forbidden_import_breaks_the_contracts(importer, line, broken, tmp_path):
    """A stage importing another stage, or a library module importing a stage, on a copy of the package."""
    shutil.copytree(ROOT / "specdraft", tmp_path / "specdraft", ignore=shutil.ignore_patterns("__pycache__"))
    module = tmp_path / "specdraft" / importer
    module.write_text(module.read_text() + f"\n{line}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert broken in result.stdout
