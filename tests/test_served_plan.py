"""The bill of train.hidden = "served" (no vLLM needed): the scratch cap instead of the hidden-state store,
the server's passes, and where the states server and the trainer go on the Kimi-K2.5 recipe's 8 GPUs."""

from __future__ import annotations

from pathlib import Path

from specdraft.billing import make_plan
from specdraft.config import load_recipe

CONFIGS = Path(__file__).parent / "data" / "configs"
KIMI = str(Path(__file__).parents[1] / "recipes" / "kimi-k2.5-8gpu.toml")
GiB, TiB = 2**30, 2**40


def kimi_plan(**train):
    recipe = load_recipe(KIMI)
    for k, v in train.items():
        setattr(recipe.train, k, v)
    return make_plan(recipe, target=str(CONFIGS / "kimi-k2.5.json"), tokens_per_sample=4096, gpus=8, gpu_memory_gib=141)


def test_kimi_recipe_is_served_and_bills_its_scratch_not_the_store():
    served, disk = kimi_plan(), kimi_plan(hidden="disk")
    assert served["hidden"]["mode"] == "served"
    # The store it replaces: 1.07 TiB in the recipe's fp8 (2.1 TiB in bf16); the served bill is the scratch cap.
    assert disk["hidden"]["disk_bytes"] > 1 * TiB
    assert served["hidden"]["disk_bytes"] == served["served"]["scratch_cap_bytes"] < 10 * GiB
    assert served["served"]["scratch_ok"] and served["served"]["passes"] == 4.0
    disk_check = next(c for c in served["checks"] if c["check"] == "disk")
    assert disk_check["need_bytes"] < 10 * GiB
    extract = next(r for r in served["time"] if r["phase"] == "extract")
    train = next(r for r in served["time"] if r["phase"] == "train")
    assert extract["seconds"] == 0 and train["serving"]["passes"] == 4.0
    # On GPUs the server runs beside the trainer: the train phase is the longer of the two, not their sum.
    assert train["seconds"] == max(train["serving"]["seconds"], train["seconds"])


def test_kimi_topology_says_what_fits_and_by_how_much():
    topo = kimi_plan()["served"]["topology"]
    assert topo["tensor_parallel"] == 8
    # 553 GiB of INT4 weights over 8 GPUs, the trainer (FSDP over the same 8) beside it at the recipe's batch.
    assert 65 * GiB < topo["server_per_gpu_bytes"] < 75 * GiB
    assert topo["beside_fits"] and topo["left_per_gpu_bytes"] > topo["trainer_per_gpu_bytes"]
    assert "fits beside it" in topo["text"] and "--gpu-memory-utilization" in topo["text"]
    assert topo["own_gpus"] == 0 and "does not fit" in topo["text"]  # TP = 4 would not hold the weights
    # A batch too large to fit beside the server is told the one that does.
    big = kimi_plan(batch_tokens=8192)["served"]["topology"]
    assert not big["beside_fits"] and 0 < big["beside_batch_tokens"] < 8192
    assert f"--batch-tokens {big['beside_batch_tokens']:,}" in big["text"]


def test_memory_cache_cuts_the_passes_and_is_billed_in_host_memory():
    recipe = load_recipe("smollm2-cpu")
    recipe.train.hidden = "served"
    base = make_plan(recipe)
    recipe.train.served_cache, recipe.train.served_cache_bytes = "memory", 2**40
    cached = make_plan(recipe)
    assert base["served"]["passes"] == recipe.train.epochs and cached["served"]["passes"] == 1.0
    assert cached["served"]["host_memory_bytes"] - base["served"]["host_memory_bytes"] == 2**40
    # On the CPU the server and the trainer share the cores: the train phase is their sum.
    train = next(r for r in base["time"] if r["phase"] == "train")
    assert train["serving"]["wait_share"] is None and train["seconds"] > train["serving"]["seconds"]


def test_status_of_a_served_run_does_not_ask_for_extract(tmp_path):
    from specdraft.run import RunFolder
    from specdraft.stages import status

    recipe = load_recipe("smollm2-cpu")
    recipe.train.hidden = "served"
    folder = RunFolder(tmp_path / "run")
    folder.init(recipe)
    for stage in ("gen", "render"):
        folder.record(stage, state="done")
    s = status.collect(folder)
    extract = next(r for r in s["stages"] if r["stage"] == "extract")
    assert extract["state"] == "not needed"
    assert s["next"]["command"].startswith("specdraft train")


def test_the_servers_measured_rate_replaces_the_reference(tmp_path):
    from specdraft.run import RunFolder

    recipe = load_recipe("smollm2-cpu")
    recipe.train.hidden = "served"
    folder = RunFolder(tmp_path / "run")
    folder.init(recipe)
    before = next(r for r in make_plan(recipe, folder)["time"] if r["phase"] == "train")
    folder.record("train", state="done", metrics={"tokens_per_s": 500.0, "served": {"tokens_per_s": 123.0}})
    after = next(r for r in make_plan(recipe, folder)["time"] if r["phase"] == "train")
    assert before["serving"]["rate_per_s"] != 123.0 and after["serving"]["rate_per_s"] == 123.0
    assert "measured: stages.train.metrics.served.tokens_per_s" in after["source"]
