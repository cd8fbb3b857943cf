"""gen against a real vLLM server (the bundled SmolLM2), with a real fault proxy on loopback in between.

Run under the machine's vLLM lock: `flock /tmp/specdraft-vllm.lock python -m pytest tests/test_gen_server.py`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from faultproxy import FaultProxy

from specdraft.config import load_recipe
from specdraft.run import RunFolder
from specdraft.stages import gen as generate
from specdraft.stages.gen import GenStopped

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

# Small answers keep a 200-conversation run to a minute or two on a 2-core CPU.
SERVER_RECIPE = """
name = "gen-server"
[data]
max_prompt_tokens = 256
[gen]
max_new_tokens = {max_new_tokens}
num_samples = {num_samples}
max_turns = {max_turns}
concurrency = {concurrency}
timeout_s = {timeout_s}
max_retries = 8
backoff_s = 0.2
backoff_max_s = 2.0
"""


def make_recipe(
    tmp_path: Path,
    endpoint: str,
    *,
    num_samples: int,
    max_new_tokens: int = 16,
    timeout_s: float = 20.0,
    max_turns: int = 1,
    concurrency: int = 8,
    extra: str = "",
    data: str = "",
) -> Path:
    path = tmp_path / "recipe.toml"
    text = SERVER_RECIPE.format(
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        timeout_s=timeout_s,
        max_turns=max_turns,
        concurrency=concurrency,
    )
    text = text.replace("[gen]\n", f"[gen]\nendpoints = [\"{endpoint}\"]\n{extra}\n")
    path.write_text(text.replace("[data]\n", f"[data]\n{data}\n"))
    return path


def gen_inline(tmp_path: Path, recipe_path: Path, **overrides) -> RunFolder:
    recipe = load_recipe(str(recipe_path))
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(recipe, section), name, value)
    run = RunFolder(tmp_path / "run")
    run.init(recipe)
    generate.run(recipe, run)
    return run


def records(run_path: Path) -> list[dict]:
    return [json.loads(line) for line in (RunFolder(run_path).conversations).read_text().splitlines()]


def line_count(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_faults_kill_and_resume_end_with_exactly_the_target(vllm_target, target, tmp_path):
    """The bar: >= 10 % faults, one kill -9 mid-run, a resume: exactly 200 saved, no duplicates."""
    with FaultProxy(vllm_target.url, fault_every=7, delay_s=12.0) as proxy:
        recipe = make_recipe(tmp_path, proxy.url, num_samples=200, timeout_s=8.0)
        run_dir = tmp_path / "run"
        cmd = [sys.executable, "-m", "specdraft.cli", "gen", "--recipe", str(recipe), "--run", str(run_dir)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
        first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out = RunFolder(run_dir).conversations
        deadline = time.time() + 600
        while line_count(out) < 60 and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert first.poll() is None, first.stdout.read().decode()[-3000:]
        first.send_signal(signal.SIGKILL)
        first.wait()
        killed_at = line_count(out)
        assert 60 <= killed_at < 200
        # Whatever the kill left, also leave a torn last line, as a kill during the write would.
        with open(out, "ab") as f:
            f.write(b'{"id": "torn-by-kill", "messages": [{"role": "us')
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert "next: specdraft render" in second.stdout

        faults = sum(proxy.counts[f] for f in ("delay", "drop", "500", "429"))
        assert faults / proxy.counts["posts"] >= 0.10
        assert all(proxy.counts[f] > 0 for f in ("delay", "drop", "500", "429"))

    recs = records(run_dir)
    ids = [r["id"] for r in recs]
    assert len(recs) == 200 and len(set(ids)) == 200 and "torn-by-kill" not in ids
    eos = target.eos_token_id
    for r in recs:
        user, answer = r["messages"][-2:]
        assert user["role"] == "user" and answer["role"] == "assistant"
        assert answer["reasoning"] == "" and answer["reasoning_source"] == "none"
        assert 0 < len(answer["token_ids"]) <= 16
        # vLLM's ids are the target's own: eos ends a stopped answer, and they decode to the text.
        assert (r["finish_reason"] == "stop") == (answer["token_ids"][-1] == eos)
        assert target.tokenizer.decode(answer["token_ids"], skip_special_tokens=True) == answer["content"]
        assert r["generator"]["kind"] == "server" and r["generator"]["sampling"]["max_tokens"] == 16
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"]["gen"]
    assert stage["state"] == "done" and stage["counts"]["records"] == 200
    assert stage["counts"]["already_done"] == killed_at
    assert sum(stage["counts"]["retries"].values()) > 0
    assert stage["requested"]["sampling"]["return_token_ids"] is True


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", "inline"])
def test_reasoning_is_kept_whatever_the_server_calls_it(vllm_target, tmp_path, monkeypatch, field):
    from specdraft import targets

    # SmolLM2 does not think; give its family markers so `inline` has something to find (and expect).
    monkeypatch.setitem(targets.FAMILIES, "llama", targets.Family(thinking=("<think>", "</think>")))
    with FaultProxy(vllm_target.url, reasoning_field=field) as proxy:
        recipe = make_recipe(tmp_path, proxy.url, num_samples=3, max_new_tokens=32)
        run = gen_inline(tmp_path, recipe)
    recs = records(run.path)
    assert len(recs) == 3
    kept = [(r["messages"][-1]["reasoning"], r["messages"][-1]["content"]) for r in recs]
    injected = proxy.injected
    if field == "inline":
        # Inline reasoning is trimmed of the newlines templates put around the markers.
        injected = [(r.strip("\n"), a.lstrip("\n")) for r, a in injected]
    assert all(pair in injected for pair in kept)
    assert all(reasoning for reasoning, _ in kept)
    assert {r["messages"][-1]["reasoning_source"] for r in recs} == {field}
    if field == "reasoning":
        # The incident: the server filled `reasoning` only; a client reading reasoning_content got nothing.
        assert all("reasoning_content" not in m and m["reasoning"] for m in proxy.raw_messages)


def test_expect_reasoning_stops_with_the_likely_cause(vllm_target, tmp_path):
    recipe = make_recipe(tmp_path, vllm_target.url, num_samples=10, extra='expect_reasoning = "true"')
    with pytest.raises(GenStopped, match="reasoning parser"):
        gen_inline(tmp_path, recipe)
    run_dir = tmp_path / "run"
    assert line_count(RunFolder(run_dir).conversations) == 0
    errors = [json.loads(line) for line in (RunFolder(run_dir).gen_errors).read_text().splitlines()]
    assert len(errors) >= 10 and all("empty reasoning" in e["reason"] for e in errors)
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"]["gen"]
    assert stage["state"] == "failed" and "without reasoning" in stage["stopped"]


def test_4xx_is_not_retried(vllm_target, tmp_path):
    # An unknown model name is the request's fault (vLLM answers 404): retrying cannot help.
    recipe = make_recipe(tmp_path, vllm_target.url, num_samples=5, extra='model = "no-such-model"')
    with pytest.raises(GenStopped, match="failed after retries"):
        gen_inline(tmp_path, recipe)
    run_dir = tmp_path / "run"
    errors = [json.loads(line) for line in (RunFolder(run_dir).gen_errors).read_text().splitlines()]
    assert len(errors) >= 5
    assert all(e["status"] == 404 and e["attempts"] == 1 for e in errors)
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"]["gen"]
    assert stage["counts"]["retries"] == {}


def test_multi_turn_is_replayed_on_the_targets_own_answers(vllm_target, tmp_path):
    source = tmp_path / "convs.jsonl"
    convs = [
        [("user", "Name a colour."), ("assistant", "ORIGINAL ANSWER"), ("user", "Now name another one.")],
        [("user", "What is 2 + 2?"), ("assistant", "ORIGINAL ANSWER"), ("user", "And times 3?")],
    ]
    source.write_text(
        "".join(
            json.dumps({"id": f"c{i}", "messages": [{"role": r, "content": c} for r, c in conv]}) + "\n"
            for i, conv in enumerate(convs)
        )
    )
    # One request at a time, here and when asking again: greedy text is then the same (docs/engine-facts.md:
    # bf16 batches of other shapes can flip near-ties).
    recipe = make_recipe(
        tmp_path,
        vllm_target.url,
        num_samples=2,
        max_new_tokens=24,
        max_turns=0,
        concurrency=1,
        data=f'source = "{source}"\neval_fraction = 0.0',
    )
    run = gen_inline(tmp_path, recipe)
    recs = {r["id"]: r for r in records(run.path)}
    assert set(recs) == {"c0", "c1"}
    for r in recs.values():
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant", "user", "assistant"]
        first, second = r["messages"][1], r["messages"][3]
        assert first["content"] != "ORIGINAL ANSWER" and first["token_ids"] and second["token_ids"]
        # Greedy: asking the server again with the target's own first answer gives the same second answer.
        wire = [{"role": m["role"], "content": m["content"]} for m in r["messages"][:3]]
        again = httpx.post(
            f"{vllm_target.url}/v1/chat/completions",
            timeout=120,
            json={"model": str(vllm_target.model), "messages": wire, "max_tokens": 24, "temperature": 0},
        ).json()
        assert again["choices"][0]["message"]["content"] == second["content"]


def test_self_instruct_writes_distinct_prompts(vllm_target, tmp_path):
    recipe = make_recipe(
        tmp_path, vllm_target.url, num_samples=4, max_new_tokens=64, extra="self_instruct = true\ntemperature = 0.7"
    )
    run = gen_inline(tmp_path, recipe)
    recs = records(run.path)
    assert len(recs) == 4
    users = [r["messages"][-2]["content"] for r in recs]
    assert all(r["id"].startswith("magpie-") for r in recs) and len(set(users)) == 4
    assert all(u.strip() and r["messages"][-1]["token_ids"] for u, r in zip(users, recs))


def test_self_instruct_samples_follow_the_sources_conversations(vllm_target, tmp_path):
    """gen.self_instruct_samples through a server: the source's conversations first, then as many the target
    wrote itself, counted apart (a rerun asking one more writes one more, not one fewer)."""
    recipe = make_recipe(
        tmp_path,
        vllm_target.url,
        num_samples=2,
        max_new_tokens=64,
        extra="self_instruct_samples = 2\ntemperature = 0.7",
    )
    run = gen_inline(tmp_path, recipe)
    recs = records(run.path)
    written = [r for r in recs if r["id"].startswith("magpie-")]
    assert len(recs) == 4 and len(written) == 2 and len({r["id"] for r in recs}) == 4
    assert all(r["messages"][-1]["token_ids"] for r in recs)
    run = gen_inline(tmp_path, recipe, gen__self_instruct_samples=3)
    again = records(run.path)
    assert again[:4] == recs and len(again) == 5 and again[4]["id"].startswith("magpie-")
