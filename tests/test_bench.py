"""`specdraft bench` against the real vLLM (CPU build): no speculation, n-gram and EAGLE-3, three
server starts in all. The bench's figures are checked against the engine's own counters: streamed
tokens against `vllm:generation_tokens_total`, acceptance against the raw spec-decode counters,
parsed here independently of the bench's parser.

Run it under the machine's vLLM lock: flock /tmp/specdraft-vllm.lock python -m pytest tests/test_bench.py
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import VLLM_EAGER

from specdraft.cli import main
from specdraft.stages import bench

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

LEVELS = [1, 2]
REQUESTS = 3
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def drafter_run(extracted_run, tmp_path_factory):
    """The tiny recipe's drafter, trained and exported from a copy of the shared extracted run."""
    import shutil

    run = tmp_path_factory.mktemp("bench") / "run"
    shutil.copytree(extracted_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    for stage in ("train", "export"):
        assert main([stage, "--run", str(run)]) == 0
    return run


def raw_counter(text: str, name: str, position: int | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if position is not None and f'position="{position}"' not in line:
            continue
        total += float(line.rsplit(" ", 1)[1])
    return total


def check_level(lv: dict, concurrency: int, K: int | None):
    assert lv["concurrency"] == concurrency
    assert lv["requests"] == max(REQUESTS, concurrency) and lv["failed"] == 0
    assert 0 < lv["output_tokens"] <= lv["requests"] * MAX_TOKENS
    # Every token the engine generated in the level reached us through the stream.
    assert lv["output_tokens"] == lv["generation_tokens_counted"]
    assert lv["ttft_ms"]["p50"] > 0 and lv["tpot_ms"]["p50"] > 0 and lv["itl_ms"]["p99"] >= lv["itl_ms"]["p50"]
    before, after, acc = lv["metrics_before"], lv["metrics_after"], lv["acceptance"]
    drafts = raw_counter(after, "vllm:spec_decode_num_drafts_total") - raw_counter(
        before, "vllm:spec_decode_num_drafts_total"
    )
    assert acc["drafts"] == drafts
    if K is None:
        assert drafts == 0 and acc["mean_acceptance_length"] is None
        return
    accepted = raw_counter(after, "vllm:spec_decode_num_accepted_tokens_total") - raw_counter(
        before, "vllm:spec_decode_num_accepted_tokens_total"
    )
    assert drafts > 0
    assert acc["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert acc["accepted_tokens"] <= acc["draft_tokens"] <= K * drafts
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    per_pos = [(raw_counter(after, name, i) - raw_counter(before, name, i)) / drafts for i in range(K)]
    assert acc["per_position_acceptance"] == pytest.approx(per_pos)
    assert sum(per_pos) == pytest.approx(accepted / drafts)


def test_endpoint_bench_on_plain_target(vllm_target, drafter_run, tmp_path):
    out = tmp_path / "plain"
    assert (
        main(
            [
                "bench",
                "--run",
                str(drafter_run),
                "--endpoint",
                vllm_target.url,
                "--name",
                "none",
                "--concurrency",
                ",".join(map(str, LEVELS)),
                "--requests",
                str(REQUESTS),
                "--max-tokens",
                str(MAX_TOKENS),
                "--prompts",
                "3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads((out / "bench.json").read_text())
    (cfg,) = r["configurations"]
    for lv, c in zip(cfg["levels"], LEVELS, strict=True):
        check_level(lv, c, None)
        assert lv["speedup"] == 1.0
    md = (out / "bench.md").read_text()
    assert md.startswith("# Served benchmark") and "| none | 2 |" in md
    assert (out / "bench_speedup_vs_concurrency.png").stat().st_size > 1000


def test_compare_ngram_and_eagle3_against_raw_counters(vllm_target, drafter_run, target, tmp_path):
    from specdraft.run import RunFolder
    from specdraft.stages.gen import select_prompts

    recipe = RunFolder(drafter_run).recipe()
    prompts = [p["messages"] for p in select_prompts(recipe, target, "eval", 3)[0]]
    args = {"num_requests": REQUESTS, "max_seconds": 300.0, "max_tokens": MAX_TOKENS}
    baseline = {"name": "none", "speculative": None, "levels": bench.sweep(vllm_target.url, prompts, LEVELS, **args)}
    configs = bench.configurations(["ngram:3", "eagle3:3"], str(drafter_run / "export" / "vllm"))
    results = bench.compare(
        str(target.path), configs, prompts, LEVELS, tmp_path / "logs", server_args=VLLM_EAGER, **args
    )
    for r in results:
        for lv, c in zip(r["levels"], LEVELS, strict=True):
            check_level(lv, c, 3)
    report = bench.write_report(
        [baseline, *results],
        tmp_path,
        requests_per_level=REQUESTS,
        max_seconds=300.0,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        prompts=len(prompts),
    )
    assert list(report["tau_vs_k"]) == [3]
    eagle = report["configurations"][2]
    assert report["tau_vs_k"][3] == pytest.approx(
        1
        + sum(lv["acceptance"]["accepted_tokens"] for lv in eagle["levels"])
        / sum(lv["acceptance"]["drafts"] for lv in eagle["levels"]),
        abs=1e-4,
    )
    assert all(lv["speedup"] and lv["speedup"] > 0 for lv in eagle["levels"])
    md = (tmp_path / "bench.md").read_text()
    assert "| ngram:3 | 1 |" in md and "| eagle3:3 | 2 |" in md and "tau vs K" in md
    for png in ("bench_acceptance_per_position.png", "bench_speedup_vs_concurrency.png", "bench_tau_vs_k.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_configuration_names_are_checked():
    assert bench.configurations(["none", "ngram"], None)[1][1]["num_speculative_tokens"] == 3
    assert bench.configurations(["eagle3:5"], "/d")[0][1] == {
        "method": "eagle3",
        "model": "/d",
        "num_speculative_tokens": 5,
    }
    with pytest.raises(ValueError, match="needs a drafter"):
        bench.configurations(["eagle3:3"], None)
    with pytest.raises(ValueError, match="expected none"):
        bench.configurations(["medusa"], None)
    assert bench.concurrency_levels(10) == [1, 2, 4, 8]
    assert re.fullmatch(r"\d+(\.\d+)?", str(bench.percentiles([0.1, 0.2, 0.3])["p50"]))
