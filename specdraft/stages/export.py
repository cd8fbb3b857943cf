"""export: the drafter folders the engines load (export/vllm, export/sglang), every field written
explicitly, and the command that serves each, as the drafter's method writes them (its package under
specdraft/methods/: the formats it has, and the number of speculative tokens it is served with).
"""

from __future__ import annotations

import time

from specdraft.config import ExportConfig, field_choices
from specdraft.methods import for_drafter, load_trained

FORMATS = tuple(f for f in field_choices(ExportConfig, "formats") if f != "both")


def resolve_formats(requested: list[str]) -> list[str]:
    """The export formats asked for, in order, "both" meaning vllm and sglang."""
    out: list[str] = []
    for name in requested:
        names = list(FORMATS) if name == "both" else [name]
        for n in names:
            if n not in FORMATS:
                raise ValueError(f"export: unknown format {name!r}; known: {list(FORMATS) + ['both']}")
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError(f"export: no format given; known: {list(FORMATS) + ['both']}")
    return out


def run(recipe, folder) -> dict:
    """The trained drafter's folders, as its method writes them."""
    t_start = time.time()
    formats = resolve_formats(recipe.export.formats)
    drafter, target, embed = load_trained(recipe, folder)
    return for_drafter(drafter).export(recipe, folder, formats, drafter, target, embed, t_start)
