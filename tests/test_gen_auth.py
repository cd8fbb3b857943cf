"""Servers that need a key: a real vLLM started with `--api-key`. gen, render's --verify-endpoint and bench
--endpoint send the key named by gen.api_key_env; without it (or with a wrong one) each stops at once
with one line that says the server refused the key; the key lands in no file of the run folder.

Run under the machine's vLLM lock: `flock /tmp/specdraft-vllm.lock python -m pytest tests/test_gen_auth.py`.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from faultproxy import FaultProxy

from specdraft.run import RunFolder

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-specdraft-test-" + secrets.token_hex(16)
KEY_ENV = "SPECDRAFT_TEST_SERVER_KEY"
RECIPE = """
name = "keyed"
[data]
max_prompt_tokens = 256
[gen]
num_samples = 4
max_new_tokens = 8
timeout_s = 60
max_retries = 3
backoff_s = 0.2
"""


class KeyCheckingProxy(FaultProxy):
    """A real proxy in front of the keyed vLLM that notes, per request, whether it carried the key; with
    `guard`, it refuses any request without it (401) on every path, as servers that guard all routes do
    (vLLM guards /v1 only, so render's /tokenize is checked here)."""

    def __init__(self, upstream: str, *, guard: bool):
        super().__init__(upstream)
        self.guard = guard
        self.seen: list[tuple[str, str, bool]] = []  # (method, path, carried the key)

    async def _handle(self, method, path, headers, body, writer) -> bool:
        keyed = headers.get("authorization") == f"Bearer {KEY}"
        self.seen.append((method, path, keyed))
        if self.guard and not keyed:
            await self._respond(writer, 401, b'{"error": "Unauthorized"}', "application/json", {})
            return True
        return await super()._handle(method, path, headers, body, writer)


@pytest.fixture(scope="module")
def keyed_vllm(target, tmp_path_factory):
    from conftest import VLLM_EAGER, need_vllm

    from specdraft.engines import VllmServer

    need_vllm()
    # The server's log stays outside every run folder (vLLM redacts the key there anyway).
    with VllmServer(
        target.path, log_path=tmp_path_factory.mktemp("vllm-keyed") / "vllm.log", api_key=KEY, extra=VLLM_EAGER
    ) as server:
        yield server


def specdraft(args: list[str], env_extra: dict, cwd: Path) -> subprocess.CompletedProcess:
    """The command line, with no key in the environment but what `env_extra` gives."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", KEY_ENV)}
    env.update({"PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1", **env_extra})
    return subprocess.run(
        [sys.executable, "-m", "specdraft.cli", *args],
        check=False,
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=900,
    )


def files_holding(folder: Path, secret: str) -> list[str]:
    return [str(p) for p in sorted(folder.rglob("*")) if p.is_file() and secret.encode() in p.read_bytes()]


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The command failed with exit 2 and one `specdraft: error:` line, no traceback."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specdraft: error: "), result.stderr[-3000:]
    return lines[0]


def conversations(run: Path) -> list[dict]:
    path = RunFolder(run).conversations
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_gen_render_and_bench_carry_the_key_and_write_it_nowhere(keyed_vllm, tmp_path):
    (tmp_path / "keyed.toml").write_text(RECIPE)
    run = tmp_path / "run"
    env = {KEY_ENV: KEY}
    outputs = []
    gen = specdraft(
        [
            "gen",
            "--recipe",
            str(tmp_path / "keyed.toml"),
            "--run",
            str(run),
            "--endpoint",
            keyed_vllm.url,
            "--api-key-env",
            KEY_ENV,
        ],
        env,
        tmp_path,
    )
    outputs.append(gen)
    assert gen.returncode == 0, gen.stdout[-2000:] + gen.stderr[-3000:]
    recs = conversations(run)
    assert len(recs) == 4 and all(r["messages"][-1]["token_ids"] for r in recs)
    requested = json.loads((run / "manifest.json").read_text())["stages"]["gen"]["requested"]
    assert requested["auth"] == {"api_key_env": KEY_ENV, "key_sent": True, "headers": []}

    # render checks every prompt against the server's /tokenize, through a proxy that demands the key there
    with KeyCheckingProxy(keyed_vllm.url, guard=True) as proxy:
        render = specdraft(["render", "--run", str(run), "--verify-endpoint", proxy.url], env, tmp_path)
    outputs.append(render)
    assert render.returncode == 0, render.stdout[-2000:] + render.stderr[-3000:]
    tokenize = [keyed for _, path, keyed in proxy.seen if path == "/tokenize"]
    assert len(tokenize) == 4 and all(tokenize)
    assert json.loads((run / "manifest.json").read_text())["stages"]["render"]["counts"]["vllm_checked"] == 4

    bench = specdraft(
        [
            "bench",
            "--run",
            str(run),
            "--endpoint",
            keyed_vllm.url,
            "--concurrency",
            "1",
            "--requests",
            "2",
            "--max-tokens",
            "8",
            "--prompts",
            "2",
        ],
        env,
        tmp_path,
    )
    outputs.append(bench)
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-3000:]
    level = json.loads((run / "eval" / "bench.json").read_text())["configurations"][0]["levels"][0]
    assert level["requests"] == 2 and level["failed"] == 0 and level["output_tokens"] > 0

    status = specdraft(["status", str(run)], env, tmp_path)
    outputs.append(status)
    assert status.returncode == 0 and (run / "STATUS.md").exists()
    assert files_holding(run, KEY) == []
    assert not any(KEY in r.stdout + r.stderr for r in outputs)


@pytest.mark.parametrize("case", ["no key, model listed", "wrong key, model named"])
def test_gen_without_the_right_key_stops_at_once_with_one_line(keyed_vllm, tmp_path, case):
    """No key in the default variable (the first request, /v1/models, is refused), or a wrong key in it (the
    chat requests are refused): one line, nothing saved, no request retried, the wrong key written nowhere."""
    wrong = "sk-wrong-" + secrets.token_hex(8)
    env = {} if case.startswith("no key") else {"OPENAI_API_KEY": wrong}
    (tmp_path / "keyed.toml").write_text(RECIPE)
    run = tmp_path / "run"
    args = ["gen", "--recipe", str(tmp_path / "keyed.toml"), "--run", str(run)]
    if case.endswith("named"):
        args += [
            "--model",
            httpx.get(f"{keyed_vllm.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()[
                "data"
            ][0]["id"],
        ]
    with KeyCheckingProxy(keyed_vllm.url, guard=False) as proxy:
        result = specdraft([*args, "--endpoint", proxy.url], env, tmp_path)
    line = one_error_line(result)
    assert " 401 " in line and "gen.api_key_env" in line
    assert (
        "OPENAI_API_KEY is not set" if case.startswith("no key") else "refused the API key in $OPENAI_API_KEY"
    ) in line
    assert conversations(run) == []
    gen_errors = RunFolder(run).gen_errors
    assert not gen_errors.exists() or gen_errors.read_text() == ""
    # Not retried: one request per conversation asked at most (4 wanted, all in flight at once), or the one GET.
    asked = [(m, p) for m, p, _ in proxy.seen]
    if case.startswith("no key"):
        assert asked == [("GET", "/v1/models")]
    else:
        assert 1 <= len(asked) <= 4 and all(a == ("POST", "/v1/chat/completions") for a in asked)
    stage = json.loads((run / "manifest.json").read_text())["stages"]["gen"]
    assert stage["state"] == "failed" and "401" in stage["error"]
    assert files_holding(run, wrong) == [] and wrong not in result.stdout + result.stderr


def test_render_and_bench_without_the_key_stop_with_one_line(keyed_vllm, tmp_path):
    """gen ran with the key in $KEY_ENV; in a shell without it, render --verify-endpoint and bench --endpoint
    stop before asking the server (the variable gen.api_key_env names is not set), and a server that refuses
    the request without a key (the default variable, unset) stops render at once with its 401."""
    (tmp_path / "keyed.toml").write_text(RECIPE)
    run = tmp_path / "run"
    gen = specdraft(
        [
            "gen",
            "--recipe",
            str(tmp_path / "keyed.toml"),
            "--run",
            str(run),
            "--endpoint",
            keyed_vllm.url,
            "--api-key-env",
            KEY_ENV,
        ],
        {KEY_ENV: KEY},
        tmp_path,
    )
    assert gen.returncode == 0, gen.stderr[-3000:]
    with KeyCheckingProxy(keyed_vllm.url, guard=True) as proxy:
        render = specdraft(["render", "--run", str(run), "--verify-endpoint", proxy.url], {}, tmp_path)
        line = one_error_line(render)
        assert "gen.api_key_env" in line and "not set" in line and proxy.seen == []
        bench = specdraft(
            [
                "bench",
                "--run",
                str(run),
                "--endpoint",
                proxy.url,
                "--concurrency",
                "1",
                "--requests",
                "1",
                "--max-tokens",
                "8",
                "--prompts",
                "1",
            ],
            {},
            tmp_path,
        )
        line = one_error_line(bench)
        assert "gen.api_key_env" in line and "not set" in line and proxy.seen == []
        # the default variable, unset: no key sent, and the server's 401 stops render at once
        render = specdraft(
            ["render", "--run", str(run), "--verify-endpoint", proxy.url, "--set", "gen.api_key_env=OPENAI_API_KEY"],
            {},
            tmp_path,
        )
    line = one_error_line(render)
    assert "/tokenize answered 401" in line and "$OPENAI_API_KEY is not set" in line and "gen.api_key_env" in line
    assert not RunFolder(run).tokens.exists() or not any(RunFolder(run).tokens.iterdir())
    assert not (run / "eval" / "bench.json").exists()


def test_a_key_pasted_where_its_variables_name_belongs_is_refused_before_anything_is_written(tmp_path):
    run = tmp_path / "run"
    result = specdraft(
        ["gen", "--run", str(run), "--endpoint", "http://127.0.0.1:9", "--api-key-env", KEY], {}, tmp_path
    )
    line = one_error_line(result)
    assert "gen.api_key_env" in line and "name of an environment variable" in line and KEY not in line
    assert not run.exists() or files_holding(run, KEY) == []
