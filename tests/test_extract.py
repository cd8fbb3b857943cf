"""extract and the hidden-state store, on the real SmolLM2 target and real ShareGPT conversations.

The runs here skip `gen` (the ShareGPT answers stand in for the target's own; extraction does not care
whose tokens they are) so that each test costs seconds of forward passes, not minutes of generation.
"""

from __future__ import annotations

import dataclasses
import json
from itertools import islice
from pathlib import Path

import pytest
import torch
from pausing import kill_at
from states import Reference, rel

from specdraft.config import Recipe
from specdraft.hidden.store import (
    FP8_E4M3_MAX,
    INDEX,
    HiddenStore,
    bytes_per_token,
    dequantize_fp8,
    quantize_fp8,
)
from specdraft.run import RunFolder
from specdraft.stages import extract as ex

pytestmark = pytest.mark.slow

NUM_SAMPLES = 12
MAX_LENGTH = 192
# Small shards so that a dozen samples make several of them (resume has something to skip).
SHARD_BYTES = 2**20
# Prompts short enough that every sample keeps answer tokens within MAX_LENGTH.
SHORT_PROMPT_CHARS = 400


def _recipe(**extract) -> Recipe:
    recipe = Recipe(name="extract-test")
    recipe.render.max_length = MAX_LENGTH
    # Within render.max_length, as the recipe check requires (gen is skipped here: no prompt is cut by them).
    recipe.data.max_prompt_tokens, recipe.gen.max_new_tokens = 128, 64
    recipe.extract = dataclasses.replace(recipe.extract, shard_bytes=SHARD_BYTES, batch_tokens=1024, **extract)
    return recipe


def _rendered_run(root: Path, recipe: Recipe) -> RunFolder:
    """A run with real ShareGPT conversations rendered by the target's template (gen skipped)."""
    from specdraft.data.sources import read_sharegpt
    from specdraft.stages import render

    run = RunFolder(root)
    run.init(recipe)
    records = [
        r
        for r in islice(read_sharegpt(), 200)
        if len(r["messages"]) >= 2
        and r["messages"][0]["role"] == "user"
        and r["messages"][1]["role"] == "assistant"
        and len(r["messages"][0]["content"]) < SHORT_PROMPT_CHARS
    ][:NUM_SAMPLES]
    with open(root / "conversations.jsonl", "w") as f:
        f.writelines(json.dumps({"id": r["id"], "messages": r["messages"][:2]}) + "\n" for r in records)
    run.record("gen", state="done")
    render.run(recipe, run)
    assert run.stage("render")["counts"]["samples"] == NUM_SAMPLES
    return run


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    return _rendered_run(tmp_path_factory.mktemp("rendered"), _recipe())


def _copy_run(src: RunFolder, dst: Path, recipe: Recipe) -> RunFolder:
    import shutil

    shutil.copytree(src.path, dst, ignore=shutil.ignore_patterns("hidden"))
    run = RunFolder(dst)
    run.init(recipe)
    return run


@pytest.fixture(scope="module")
def bf16_run(rendered, tmp_path_factory):
    recipe = _recipe()
    run = _copy_run(rendered, tmp_path_factory.mktemp("bf16") / "run", recipe)
    ex.run(recipe, run)
    return run


@pytest.fixture(scope="module")
def fp8_run(rendered, tmp_path_factory):
    recipe = _recipe(store_dtype="fp8_e4m3")
    run = _copy_run(rendered, tmp_path_factory.mktemp("fp8") / "run", recipe)
    ex.run(recipe, run)
    return run


def _assert_same_store(a: HiddenStore, b: HiddenStore, atol: float = 0.0) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        for name in ("aux", "last"):
            if atol == 0:
                assert torch.equal(x[name], y[name]), (i, name)
            else:
                torch.testing.assert_close(x[name].float(), y[name].float(), atol=atol, rtol=0)


def test_index_ties_samples_layers_and_target(bf16_run, target):
    from specdraft.data.tokens import load_tokens

    index = json.loads((bf16_run.hidden / INDEX).read_text())
    _, samples = load_tokens(bf16_run.tokens)
    assert index["state"] == "done" and index["store_dtype"] == "bfloat16"
    assert index["aux_layer_ids"] == [2, 15, 27] and index["last"] == "final_norm_output"
    assert index["target"]["fingerprint"] == target.fingerprint()
    assert index["bytes_per_token"] == bytes_per_token(4, 576, "bfloat16") == 4 * 576 * 2
    assert index["disk_bytes_per_token"] == 4 * 576 * 2 + 5  # + int32 id + uint8 loss mask
    assert len(index["shards"]) > 2, "the test needs several shards"
    assert sum(s["tokens"] for s in index["shards"]) == sum(len(ids) for ids, _ in samples)
    # Offsets tile each shard exactly: samples sorted by offset run back to back from 0.
    for shard in index["shards"]:
        members = sorted((s for s in index["samples"] if s["shard"] == shard["name"]), key=lambda s: s["offset"])
        assert [s["offset"] for s in members] == [sum(m["tokens"] for m in members[:k]) for k in range(len(members))]
    store = HiddenStore(bf16_run.hidden)
    for i, (ids, mask) in enumerate(samples):
        assert store.tokens(i) == (ids, mask)
        item = store[i]
        assert item["aux"].shape == (len(ids), 3 * 576) and item["last"].shape == (len(ids), 576)
        assert item["aux"].dtype == item["last"].dtype == torch.bfloat16
    m = bf16_run.manifest()["stages"]["extract"]
    assert m["counts"]["disk_bytes"] == sum((bf16_run.hidden / s["name"]).stat().st_size for s in index["shards"])


def test_stored_states_are_vllms_layers_and_the_final_norm(bf16_run, target):
    """Aux id k = transformers' output_hidden_states[k] (vLLM's convention); last = final-norm output."""
    store = HiddenStore(bf16_run.hidden)
    item = store[3]
    ref = Reference(target, item["input_ids"])
    for j, k in enumerate((2, 15, 27)):
        ref.assert_layer(item["aux"][:, j * 576 : (j + 1) * 576], k)
    ref.assert_layer(item["last"], -1)


def test_fp8_round_trip_error_bound(bf16_run):
    """e4m3 keeps 3 mantissa bits: a value in the normal range comes back within 2^-4 of itself
    (half a unit in the last place); below the smallest normal (2^-6 x scale) the error is at most
    half the subnormal step, 2^-10 x scale. The decode to bf16 (8 significant bits) adds at most half its
    unit in the last place, 2^-8 relative."""
    store = HiddenStore(bf16_run.hidden)
    for i in (0, len(store) // 2, len(store) - 1):
        for name, rows in (("aux", 3), ("last", 1)):
            x = store[i][name].float()
            q, scale = quantize_fp8(x, rows)
            assert q.dtype == torch.float8_e4m3fn and scale.shape == (x.shape[0], rows)
            back = dequantize_fp8(q, scale).float()
            s = scale.repeat_interleave(x.shape[1] // rows, dim=1)
            bound = torch.maximum(x.abs() * 2**-4, s * 2**-10) + back.abs() * 2**-8
            assert ((back - x).abs() <= bound * (1 + 1e-6)).all(), (i, name)
            # The row maxima map to the largest finite e4m3 value: the whole range is used.
            assert torch.allclose(
                q.float().abs().reshape(x.shape[0], rows, -1).amax(-1), torch.full((x.shape[0], rows), FP8_E4M3_MAX)
            )
            rel = ((back - x).norm() / x.norm()).item()
            assert rel < 0.05, rel  # measured ~0.02 on SmolLM2's states


def test_fp8_store_halves_the_disk_and_decodes_close(bf16_run, fp8_run):
    a, b = HiddenStore(bf16_run.hidden), HiddenStore(fp8_run.hidden)
    assert b.store_dtype == "fp8_e4m3"
    bf16_bytes = bf16_run.manifest()["stages"]["extract"]["counts"]["disk_bytes"]
    fp8_bytes = fp8_run.manifest()["stages"]["extract"]["counts"]["disk_bytes"]
    assert 0.45 < fp8_bytes / bf16_bytes < 0.55
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"])
        for name in ("aux", "last"):
            assert y[name].dtype == torch.bfloat16
            rel = ((y[name].float() - x[name].float()).norm() / x[name].float().norm()).item()
            assert rel < 0.05, (i, name, rel)
        # the last layer alone (the target's top tokens) is the same tensor, read without the aux states
        assert torch.equal(a.last(i), x["last"]) and torch.equal(b.last(i), y["last"])
        # given a device, the fp8 rows are copied first and dequantised there: the same values
        assert torch.equal(b.last(i, torch.device("cpu")), y["last"])


def test_disk_check_refuses_a_run_that_does_not_fit(rendered, tmp_path):
    # A margin of a million times the bill: no disk has that much free.
    recipe = _recipe(disk_margin=1e6)
    run = _copy_run(rendered, tmp_path / "run", recipe)
    with pytest.raises(ex.DiskSpaceError) as err:
        ex.run(recipe, run)
    msg = str(err.value)
    assert "GB missing" in msg and "--store-dtype fp8_e4m3" in msg and "--hidden online" in msg
    assert str(run.hidden) in msg
    assert not list((run.hidden).glob("*.safetensors"))
    # The CLI says it in one line and fails.
    from specdraft.cli import main

    assert main(["extract", "--run", str(run.path), "--set", "extract.disk_margin=1e6"]) == 2
    assert run.stage("extract")["state"] == "failed"


def test_torn_shard_is_detected_and_redone(bf16_run, tmp_path):
    import shutil

    recipe = _recipe()
    run = _copy_run(bf16_run, tmp_path / "run", recipe)
    shutil.copytree(bf16_run.hidden, run.hidden)
    shard = run.hidden / json.loads((run.hidden / INDEX).read_text())["shards"][1]["name"]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    entry = ex.run(recipe, run)
    assert entry["counts"]["shards_written"] == 1
    _assert_same_store(HiddenStore(run.hidden), HiddenStore(bf16_run.hidden))
    # Nothing to redo: a rerun writes nothing.
    assert ex.run(recipe, run)["counts"]["shards_written"] == 0


def test_resume_after_a_kill_mid_shard(bf16_run, tmp_path):
    """Kill a real extract process once it has written a shard, resume, and get the same tensors."""
    recipe = _recipe()
    run = _copy_run(bf16_run, tmp_path / "run", recipe)
    out = run.hidden
    # Killed as the third shard is about to be saved: shards 0 and 1 are on disk, the rest are not.
    kill_at("safetensors.torch:save_file", 3, ["extract", "--run", str(run.path)], tmp_path, when="before")
    index = json.loads((out / INDEX).read_text())
    assert index["state"] == "partial"
    written_before = {s["name"] for s in index["shards"] if (out / s["name"]).exists()}
    assert len(written_before) == 2 < len(index["shards"])
    entry = ex.run(recipe, run)
    assert entry["counts"]["shards_written"] == len(index["shards"]) - len(written_before)
    assert not list(out.glob(".shard-*"))
    _assert_same_store(HiddenStore(run.hidden), HiddenStore(bf16_run.hidden))


def test_reader_random_access_prefetch_and_dataloader_workers(bf16_run):
    store = HiddenStore(bf16_run.hidden)
    direct = [store[i] for i in range(len(store))]
    batches = [[5, 0, 11], [3], [7, 8, 1, 2], [10, 9, 6, 4]]  # out of order, across shards
    for workers in (0, 2):
        seen = []
        for batch, items in zip(batches, store.loader(batches, num_workers=workers, prefetch=2)):
            assert len(items) == len(batch)
            for i, item in zip(batch, items):
                for name in ("input_ids", "loss_mask", "aux", "last"):
                    assert torch.equal(item[name], direct[i][name]), (workers, i, name)
                seen.append(i)
        assert sorted(seen) == list(range(len(store)))
    with pytest.raises(IndexError):
        store[len(store)]


def test_online_gives_the_disk_tensors(bf16_run, target):
    """OnlineHidden runs the target on access. With extract's own batches it gives the stored tensors
    exactly; with other batches the padded width changes the compute's rounding only: the two stay
    within the target's own compute noise of each other (tests/states.py; ~2 % on `last` in bf16)."""
    from specdraft.hidden.online import OnlineHidden, open_hidden
    from specdraft.hidden.store import token_batches

    recipe = _recipe()
    recipe.train.hidden = "online"
    online = open_hidden(recipe, bf16_run)
    disk = HiddenStore(bf16_run.hidden)
    assert isinstance(online, OnlineHidden)
    assert len(online) == len(disk) and online.aux_layer_ids == disk.aux_layer_ids
    assert online.hidden_size == disk.hidden_size and online.lengths == disk.lengths
    index = json.loads((bf16_run.hidden / INDEX).read_text())
    shards = ex.plan_shards(disk.lengths, index["disk_bytes_per_token"], SHARD_BYTES)
    same = [b for m in shards for b in token_batches(m, disk.lengths, recipe.extract.batch_tokens)]
    other = [[0, 6, 11], [1, 2, 3, 4, 5], [7, 8, 9, 10]]
    models: dict = {}
    for batches, exact in ((same, True), (other, False)):
        for batch, items in zip(batches, online.loader(batches)):
            for i, item in zip(batch, items):
                ref = disk[i]
                assert online.tokens(i) == disk.tokens(i)
                assert torch.equal(item["input_ids"], ref["input_ids"])
                for name in ("aux", "last"):
                    x, y = item[name], ref[name]
                    assert x.dtype == y.dtype == torch.bfloat16 and x.shape == y.shape
                    if exact:
                        assert torch.equal(x, y), (i, name)
                if not exact and i in (0, 7):
                    noise = Reference(target, ref["input_ids"], models)
                    assert rel(item["aux"], ref["aux"]) < 2 * noise.tolerance(27), (i, "aux")
                    assert rel(item["last"], ref["last"]) < 2 * noise.tolerance(-1), (i, "last")
    for i in (0, len(disk) - 1):  # the last layer alone (the target's top tokens), the sample run by itself
        alone, ref = online.last(i), disk[i]["last"]
        noise = Reference(target, disk[i]["input_ids"], models)
        assert alone.shape == ref.shape and rel(alone, ref) < 2 * noise.tolerance(-1)
    with pytest.raises(ValueError, match="num_workers"):
        online.loader(other, num_workers=2)


def test_device_map_path_gives_the_same_tensors(bf16_run, tmp_path):
    """The big-target path (transformers device_map; here every layer on "cpu") writes the same shards."""
    recipe = _recipe(device_map="cpu")
    run = _copy_run(bf16_run, tmp_path / "run", recipe)
    ex.run(recipe, run)
    _assert_same_store(HiddenStore(run.hidden), HiddenStore(bf16_run.hidden))
