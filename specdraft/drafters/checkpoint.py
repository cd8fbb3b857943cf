"""specdraft's own checkpoint of a drafter: its weights (safetensors), its config and what it was
trained on (config.json), and a completeness marker written last, so a folder cut off mid-save is never
read as a checkpoint. A training checkpoint adds what resuming needs besides the weights, without
pickle (a checkpoint folder passed between people or machines must not run code when it is read):

    trainer.safetensors   every tensor of the trainer state, named by its path ("optimizer/state/<fqn>/exp_avg")
    trainer.json          {"format": "specdraft trainer state", "version": 1, "state": skeleton}: the rest
                          of the state as JSON, each tensor replaced by {"__tensor__": its name}

The state is {"model": trainable weights, "optimizer": the full optimizer state dict (every optimizer
of the run, FSDP-gathered), "scheduler": [each schedule's state dict], "state": the data position,
"rng": torch CPU / CUDA, python `random` and numpy states}. The skeleton keeps what JSON alone would
lose: tuples ({"__tuple__": [...]}) and dicts with keys other than plain strings
({"__items__": [[key, value], ...]}, e.g. an optimizer's integer parameter ids).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from specdraft.files import (
    FULL,
    DiskFull,
    FileError,
    load_safetensors,
    read_json,
    safetensors_bytes,
    save_safetensors,
)
from specdraft.run import scratch_paths as run_scratch_paths
from specdraft.run import staged_folders, write_json

COMPLETE = "COMPLETE"  # written last into a checkpoint folder: a folder without it is ignored
TRAINER_TENSORS = "trainer.safetensors"
TRAINER_JSON = "trainer.json"
TRAINER_FORMAT, TRAINER_VERSION = "specdraft trainer state", 1
PICKLED = "trainer.pt"  # what specdraft wrote before: a pickle, never read

_TAGS = ("__tensor__", "__tuple__", "__items__")


def target_tensors(config) -> set[str]:
    """The drafter's tensors that are the target's own, frozen: left out of checkpoints (read from the
    target on load). The embedding always; a DFlash lm_head over the whole vocabulary too."""
    return {"embed_tokens.weight"} | ({"lm_head.weight"} if getattr(config, "shares_lm_head", False) else set())


def flatten_state(state) -> tuple[dict[str, torch.Tensor], object]:
    """(named tensors, JSON skeleton) of a nested state of dicts, lists, tuples, tensors and JSON
    scalars; anything else is refused (TypeError naming its path), since only pickle could write it."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def walk(x, path: list[str]):
        if isinstance(x, torch.Tensor):
            name = "/".join(path) or "tensor"
            if name in tensors:
                raise TypeError(f"trainer state: two tensors named {name!r}")
            t = x.detach().cpu().contiguous()
            if t.untyped_storage().data_ptr() in storages:  # safetensors takes no two names of one storage
                t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
            tensors[name] = t
            return {"__tensor__": name}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [walk(v, [*path, str(i)]) for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v, [*path, str(i)]) for i, v in enumerate(x)]}
        if isinstance(x, dict):
            if all(isinstance(k, str) and k not in _TAGS for k in x):
                return {k: walk(v, [*path, k]) for k, v in x.items()}
            return {"__items__": [[walk(k, [*path, "key"]), walk(v, [*path, str(k)])] for k, v in x.items()]}
        raise TypeError(f"trainer state: {'/'.join(path)} is a {type(x).__name__}, which only pickle could save")

    return tensors, walk(state, [])


def unflatten_state(skeleton, tensors: dict[str, torch.Tensor]):
    """The nested state `flatten_state` took apart."""
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if set(skeleton) == {"__tensor__"}:
        return tensors[skeleton["__tensor__"]]
    if set(skeleton) == {"__tuple__"}:
        return tuple(unflatten_state(v, tensors) for v in skeleton["__tuple__"])
    if set(skeleton) == {"__items__"}:
        return {unflatten_state(k, tensors): unflatten_state(v, tensors) for k, v in skeleton["__items__"]}
    return {k: unflatten_state(v, tensors) for k, v in skeleton.items()}


def save_trainer_state(folder: Path, state: dict) -> None:
    tensors, skeleton = flatten_state(state)
    save_safetensors(tensors, folder / TRAINER_TENSORS)
    write_json(folder / TRAINER_JSON, {"format": TRAINER_FORMAT, "version": TRAINER_VERSION, "state": skeleton})


def check_trainer_state(path: Path) -> None:
    """Refuse, in one line, a checkpoint whose trainer state cannot be read without pickle or is absent."""
    if (path / TRAINER_JSON).exists() and (path / TRAINER_TENSORS).exists():
        return
    if (path / PICKLED).exists():
        raise ValueError(
            f"{path / PICKLED}: a trainer state an older specdraft saved as a pickle, which is "
            "never loaded (unpickling a file can run any code in it); start over with "
            "--set train.resume=false (checkpoints are replaced)"
        )
    raise ValueError(
        f"{path}: no trainer state ({TRAINER_JSON} + {TRAINER_TENSORS}) to resume from; "
        "start over with --set train.resume=false (checkpoints are replaced)"
    )


def load_trainer_state(path: Path) -> dict:
    """What `save_trainer_state` wrote into the folder `path`, read with safetensors and json only."""
    check_trainer_state(path)
    doc = read_json(path / TRAINER_JSON, fix=RESTART)
    if doc.get("format") != TRAINER_FORMAT or doc.get("version") != TRAINER_VERSION:
        raise ValueError(
            f"{path / TRAINER_JSON}: not a {TRAINER_FORMAT} version {TRAINER_VERSION} "
            f"(format {doc.get('format')!r}, version {doc.get('version')!r})"
        )
    tensors = load_safetensors(path / TRAINER_TENSORS, fix=RESTART)
    try:
        return unflatten_state(doc["state"], tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise FileError(
            f"{path}: {TRAINER_JSON} names a tensor {TRAINER_TENSORS} does not hold ({e}); {RESTART}"
        ) from None


# A training checkpoint that cannot be read is started over; any other is written again by its stage.
RESTART = "start over with --set train.resume=false (checkpoints are replaced)"


def checkpoint_fix(path: Path) -> str:
    """What to do about a checkpoint folder that cannot be read: an import's is imported again, a run's
    trained again (train resumes from the last whole checkpoint)."""
    if path.name == "imported":
        return "rerun `specdraft import` to write it again"
    if path.name == "latest":
        return RESTART
    return "rerun `specdraft train` (it resumes from checkpoints/latest), or " + RESTART


def read_meta(path: Path, methods, default: str) -> dict:
    """A checkpoint's config.json, checked for the drafter config and method every loader takes from it
    (`methods`: the names a method may have, `default` the method of a checkpoint that names none,
    written before there were several; the registry's readers pass them)."""
    meta = read_json(Path(path) / "config.json", fix=checkpoint_fix(Path(path)))
    if isinstance(meta, dict):
        meta.setdefault("method", default)
    if (
        not isinstance(meta.get("drafter"), dict)
        or not isinstance(meta.get("method"), str)
        or meta["method"] not in methods
        or not isinstance(meta.get("aux_layer_ids", []), list)
    ):
        raise FileError(
            f"{Path(path) / 'config.json'}: not a specdraft checkpoint's config (its 'drafter', "
            f"'method' or 'aux_layer_ids'); {checkpoint_fix(Path(path))}"
        )
    return meta


def drafter_config(meta: dict, path: Path, config_cls):
    """The drafter config (of `config_cls`, its method's) a checkpoint's config.json (`meta`, read
    from `path`) holds."""
    try:
        return config_cls(**meta["drafter"])
    except TypeError as e:  # a field this specdraft does not know, or one missing
        raise FileError(
            f"{Path(path) / 'config.json'}: its drafter config does not fit this specdraft ({e}); "
            f"{checkpoint_fix(Path(path))}"
        ) from None


def scratch_paths(path: Path) -> tuple[Path, Path]:
    """The siblings save_checkpoint clears and uses (run.scratch_paths): the new folder is written in the
    first, the one it replaces moved to the second. Callers that must not lose a folder check these as
    well as `path`."""
    return run_scratch_paths(path)


def refuse_misfits(folder: Path, target, found: list[str], aux_ids: list[int], extracted_aux_layer_ids) -> None:
    """import's one-line error listing every misfit of a folder: `found`, and aux layers other than a
    run's extracted ones (fine-tuning would feed it other layers)."""
    if extracted_aux_layer_ids is not None and list(extracted_aux_layer_ids) != list(aux_ids):
        found.append(
            f"aux layer ids: drafter {list(aux_ids)}, the run's hidden states {list(extracted_aux_layer_ids)} "
            "(fine-tuning would feed it other layers)"
        )
    if found:
        raise ValueError(f"import: {folder} does not fit the target {target.path}: " + "; ".join(found))


def save_imported(drafter, target, folder: Path, out: Path, layout: str, notes: list[str]) -> None:
    """An imported folder's drafter as a checkpoint at `out`, saying where it came from and how it was read."""
    aux_ids = list(drafter.config.aux_layer_ids)
    meta = {
        "aux_layer_ids": aux_ids,
        "target": type(target)(target.name, aux_ids).describe(),
        "imported_from": {"folder": str(Path(folder).resolve()), "layout": layout, "notes": notes},
    }
    save_checkpoint(drafter, Path(out), meta)


def save_checkpoint(drafter, path: Path, meta: dict, extra: dict | None = None) -> None:
    """A checkpoint folder, written whole under a temporary name, marked complete, then renamed
    (run.staged_folders): a failure (a full disk, a kill's KeyboardInterrupt) removes the temporary
    folder and leaves the last whole checkpoint at `path` untouched. The target's own tensors are left
    out (target_tensors), read from the target on load; config.json names the method. `extra`
    (optimizer, scheduler, data position, RNG) goes to trainer.safetensors + trainer.json for resuming."""
    shared = target_tensors(drafter.config)
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items() if k not in shared}
    try:
        with staged_folders(path) as (tmp,):
            save_safetensors(state, tmp / "model.safetensors")
            write_json(tmp / "config.json", {"drafter": drafter.config.to_dict(), **meta, "method": drafter.METHOD})
            if extra is not None:
                save_trainer_state(tmp, extra)
            (tmp / COMPLETE).write_text("")
    except OSError as e:
        if e.errno not in FULL:
            raise
        needed = safetensors_bytes(state) + (safetensors_bytes(flatten_state(extra)[0]) if extra else 0)
        raise DiskFull(path, needed) from None


def rng_state() -> dict:
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached],
    }


def set_rng_state(rng: dict) -> None:
    import numpy as np

    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def save_training(
    path: Path, wrapped, optimizers: list, schedulers: list, config, meta: dict, state: dict, rank: int
) -> None:
    """A resumable checkpoint of the drafter in training: its weights, plus the trainable weights,
    optimizer and scheduler states, `state` (step, tokens, ...) and RNG (see the module's doc). `wrapped`
    is the method's objective module, under DDP or FSDP or neither; `config` the drafter's config. Every
    process calls it, since gathering the full state dicts is collective; only rank 0 writes. It draws
    nothing from the RNG: a run that goes on after it continues the stream a run resumed from it starts
    with."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(wrapped, options=full)
    optim_state = get_optimizer_state_dict(wrapped, optimizers, options=full)
    if rank != 0:
        return
    shared = {f"drafter.{name}" for name in target_tensors(config)}
    trainable = {k: v for k, v in model_state.items() if k not in shared}
    extra = {
        "model": trainable,
        "optimizer": optim_state,
        "scheduler": [x.state_dict() for x in schedulers],
        "state": dict(state),
        "rng": rng_state(),
    }
    # The copy written out is built on the CPU, and building it initialises weights from torch's RNG.
    with torch.random.fork_rng(devices=[]):
        drafter = config.make_drafter()
    drafter.load_state_dict({k.removeprefix("drafter."): v for k, v in model_state.items()})
    save_checkpoint(drafter, path, meta, extra)


def load_training(path: Path, wrapped, optimizers: list, schedulers: list) -> dict:
    """Restore what `save_training` wrote at `path` into the model, optimizers and schedulers, and the
    RNG; returns the saved `state`. A trainer state saved as a pickle (trainer.pt) is refused unread."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    extra = load_trainer_state(path)
    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(wrapped, extra["model"], options=full)
    set_optimizer_state_dict(wrapped, optimizers, extra["optimizer"], options=full)
    for scheduler, saved_state in zip(schedulers, extra["scheduler"], strict=True):
        scheduler.load_state_dict(saved_state)
    set_rng_state(extra["rng"])
    return extra["state"]


def load_weights(drafter, path: Path, embed: torch.Tensor | None = None, head: torch.Tensor | None = None):
    """`drafter` (built from the checkpoint's config) with the checkpoint's weights, and the target's
    `embed` (and `head`, the target's lm_head weight, for a drafter sharing it) where the checkpoint
    left them out; in eval mode."""
    path = Path(path)
    state = load_safetensors(path / "model.safetensors", fix=checkpoint_fix(path))
    given = {"embed_tokens.weight": embed, "lm_head.weight": head}
    for name in target_tensors(drafter.config) - set(state):
        if given[name] is None:
            raise ValueError(f"{path}: checkpoint has no {name}; pass the target's")
        state[name] = given[name]
    try:
        drafter.load_state_dict(state)
    except RuntimeError as e:  # torch's list of missing / unexpected keys and shapes
        first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        raise FileError(
            f"{path / 'model.safetensors'}: does not fit config.json's drafter ({first}); {checkpoint_fix(path)}"
        ) from None
    return drafter.eval()
