"""The rendered token store (render's output): input ids and loss masks per sample, as safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_tokens(tokens_dir: Path) -> tuple[dict, list[tuple[list[int], list[int]]]]:
    """The rendered samples: (index, [(input_ids, loss_mask), ...])."""
    from safetensors.torch import load_file

    out = Path(tokens_dir)
    index = json.loads((out / "index.json").read_text())
    t = load_file(str(out / "tokens.safetensors"))
    ids, mask, off = t["input_ids"].tolist(), t["loss_mask"].tolist(), t["offsets"].tolist()
    return index, [(ids[a:b], mask[a:b]) for a, b in zip(off[:-1], off[1:])]
