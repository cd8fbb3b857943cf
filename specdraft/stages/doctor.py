"""doctor: the checks that catch a drafter that loads but would accept almost nothing when served.

Each check is a pass / fail line with the fix (drafters/checks.py). The folder's config.json says
whose it is: the method that owns it (specdraft/methods/) checks it, for the failures seen in the field
with that method's folders (docs/engine-facts.md and each method's page in docs/).
"""

from __future__ import annotations

from pathlib import Path

from specdraft.drafters.checks import Check
from specdraft.drafters.common import REEXPORT
from specdraft.files import FileError, read_json
from specdraft.methods import for_folder
from specdraft.run import RunFolder
from specdraft.targets import Target


def diagnose(
    folder: Path,
    target,
    run_path: Path | None = None,
    measured: bool = True,
    conversations: list[tuple[list[int], list[int]]] | None = None,
) -> list[Check]:
    """Every check of an exported drafter folder, by the method that owns it; `measured` adds the ones
    that run the target on real conversations (held-out ShareGPT unless `conversations` are given;
    seconds to minutes, the target's size), which config-level callers can leave out."""
    folder = Path(folder)
    try:
        config = read_json(folder / "config.json", fix=REEXPORT, what="a drafter's config")
    except (OSError, FileError) as e:
        return [Check("config.json readable", False, str(e), "point doctor at an exported drafter folder")]
    return for_folder(config).diagnose(
        folder, config, target, Path(run_path) if run_path is not None else None, measured, conversations
    )


def run_doctor(folder: str, target_name: str | None, run_path: str | None, measured: bool = True) -> int:
    """Print the checks; exit status 1 when any fails. The run (for the extracted layer ids and the
    training data) defaults to the one the folder was exported into (runs/<name>/export/<format>)."""

    folder_path = Path(folder)
    if not folder_path.is_dir():
        raise FileNotFoundError(
            f"doctor: {folder_path} is not a folder (give an exported drafter folder, e.g. runs/demo/export/vllm)"
        )
    if run_path is None and RunFolder(folder_path.resolve().parents[1]).exists():
        run_path = str(folder_path.resolve().parents[1])
    if target_name is None:
        if run_path is None:
            raise ValueError("doctor: pass --target (or --run, whose recipe names it)")
        target_name = RunFolder(Path(run_path)).recipe().target.model
    target = Target(target_name)
    checks = diagnose(folder_path, target, Path(run_path) if run_path else None, measured=measured)
    for c in checks:
        print(c.line())
    failed = [c for c in checks if not c.ok]
    print(f"\n{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
