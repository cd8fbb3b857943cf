"""The rendered token store (render's output): input ids and loss masks per sample, as safetensors."""

from __future__ import annotations

from pathlib import Path

from specdraft.files import FileError, load_safetensors, read_json

RERENDER = "rerun `specdraft render` to write it again"
TENSORS = ("input_ids", "loss_mask", "offsets")


def load_tokens(tokens_dir: Path, vocab_size: int | None = None) -> tuple[dict, list[tuple[list[int], list[int]]]]:
    """The rendered samples: (index, [(input_ids, loss_mask), ...]). A torn, foreign or inconsistent
    tokens.safetensors (or ids outside [0, `vocab_size`)) is one FileError naming it."""
    out = Path(tokens_dir)
    index = read_json(out / "index.json", fix=RERENDER)
    path = out / "tokens.safetensors"
    t = load_safetensors(path, fix=RERENDER, need=TENSORS)
    ids, mask, off = t["input_ids"], t["loss_mask"], t["offsets"]
    if ids.dim() != 1 or mask.shape != ids.shape or off.dim() != 1 or len(off) == 0:
        raise FileError(
            f"{path}: input_ids {list(ids.shape)}, loss_mask {list(mask.shape)} and offsets "
            f"{list(off.shape)} are not the 1-d store render writes; {RERENDER}"
        )
    off = off.tolist()
    if off[0] != 0 or off[-1] != len(ids) or any(a > b for a, b in zip(off, off[1:])):
        raise FileError(f"{path}: its offsets do not cut its {len(ids)} tokens into samples; {RERENDER}")
    if len(ids) and vocab_size is not None and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise FileError(
            f"{path}: token id {bad} is outside the target's vocabulary [0, {vocab_size}) "
            f"(rendered for another target?); {RERENDER}"
        )
    ids, mask = ids.tolist(), mask.tolist()
    return index, [(ids[a:b], mask[a:b]) for a, b in zip(off[:-1], off[1:])]
