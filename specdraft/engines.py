"""A real vLLM server on loopback, started and stopped by us: for tests, benchmarks and local serving.

vLLM lives in its own virtualenv (it pins its own torch), so it runs as a subprocess of
that interpreter. The server is ready when `/v1/models` answers; it is stopped by its PID (and its
process group, which holds vLLM's engine workers), whatever happened in between.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Self

from specdraft.config import refused_server_arg
from specdraft.data.client import REFUSED, Auth
from specdraft.targets import resolve_device, resolve_dtype

VLLM_PYTHON = Path(
    os.environ.get("SPECDRAFT_VLLM_PYTHON", Path.home() / ".cache" / "specdraft" / "vllm-venv" / "bin" / "python")
)
# The CPU backend's KV cache in GiB: 2 holds 2,048-token contexts for dozens of concurrent requests.
CPU_KVCACHE_GIB = 2
READY_TIMEOUT_S = 900.0
# How long a stopped server gets to exit on SIGTERM before its process group is killed; one still
# starting up (which may not answer SIGTERM until it serves) has nothing to finish and gets less.
STOP_TIMEOUT_S = 60.0
STARTING_STOP_TIMEOUT_S = 5.0


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone (PermissionError: macOS's answer for a group of zombies only)


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_args(
    model: str | Path,
    *,
    max_model_len: int = 2048,
    dtype: str = "bfloat16",
    speculative: dict | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    """The arguments after `vllm serve` (also what we print for users to run themselves). `extra` may not
    move the server off 127.0.0.1 or the port specdraft picked (config.refused_server_arg); the recipe's
    vllm_args were refused so when it loaded, and this refuses whatever else reaches here."""
    for arg in extra or []:
        why = refused_server_arg(arg)
        if why:
            raise ValueError(f"vLLM argument {arg.split('=', 1)[0]!r} is not passed through: {why}")
    args = [str(model), "--max-model-len", str(max_model_len), "--dtype", dtype]
    if speculative:
        args += ["--speculative-config", json.dumps(speculative)]
    return args + list(extra or [])


class VllmServer:
    """`with VllmServer(model, speculative={...}) as s: httpx.get(s.url + "/metrics")`.

    `api_key`: the server is started with `--api-key` (it then refuses /v1 requests without
    `Authorization: Bearer KEY`; vLLM redacts it in its own log) and polled with it until ready. The key is
    not part of `args`, the arguments printed for users to run."""

    def __init__(
        self,
        model: str | Path,
        *,
        log_path: Path,
        speculative: dict | None = None,
        max_model_len: int = 2048,
        dtype: str = "auto",
        extra: list[str] | None = None,
        python: Path = VLLM_PYTHON,
        port: int | None = None,
        env: dict | None = None,
        api_key: str | None = None,
    ):

        self.model = str(model)
        # "auto": bfloat16 where the machine multiplies it in hardware, else float32 (on a CPU without
        # bf16 instructions, vLLM's CPU backend in bf16 is several times slower than in float32).
        self.dtype = resolve_dtype(dtype, resolve_device("auto"))
        self.args = serve_args(
            model, max_model_len=max_model_len, dtype=self.dtype, speculative=speculative, extra=extra
        )
        self.python = Path(python)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None
        self.stopped = False
        self.ready_seconds: float | None = None
        self.env = dict(env or {})  # set in the server's environment, over ours
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def start(self) -> Self:
        if not self.python.exists():
            raise ServerError(f"no vLLM interpreter at {self.python} (bash scripts/install_vllm.sh)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        model, *rest = self.args
        cmd = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *rest,
        ]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(CPU_KVCACHE_GIB)),
            **self.env,
        }
        t0 = time.time()
        self.stopped = False
        with open(self.log_path, "w") as log:
            # A session of its own, so stop() can end vLLM's worker processes with it.
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._wait_ready(t0)
        except BaseException:
            # Not ready, or interrupted (Ctrl-C, SIGTERM) while waiting: `with` never reaches __exit__
            # when __enter__ raises, so the server is stopped here.
            self.stop(grace=STARTING_STOP_TIMEOUT_S)
            raise
        self.ready_seconds = time.time() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        import httpx

        while True:
            if self.process.poll() is not None:
                raise ServerError(f"vLLM exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5, headers=self.headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() - t0 > READY_TIMEOUT_S:
                raise ServerError(f"vLLM not ready after {READY_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(2)

    def stop(self, grace: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the server's process group; after `grace` seconds, or at once when interrupted again
        while waiting, SIGKILL; then SIGKILL to whatever of the group outlived its leader (engine workers)."""
        if self.process is None or self.stopped:
            return
        pgid = self.process.pid  # the group start_new_session made: its id is the leader's pid
        try:
            if self.process.poll() is None:
                _signal_group(pgid, signal.SIGTERM)
                self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass  # killed below (a server still starting up may not answer SIGTERM)
        finally:
            # Whatever happened, interrupted again included: the group killed, the leader reaped.
            _signal_group(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
            self.stopped = True  # once: the group's id may be another's after this

    def metrics_text(self) -> str:
        import httpx

        return httpx.get(f"{self.url}/metrics", timeout=30, headers=self.headers).text

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


PREFIX = "vllm:spec_decode_"


GENERATION_TOKENS = "vllm:generation_tokens_total"


_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$')


def spec_decode_counters(metrics_text: str) -> dict:
    """{"drafts", "draft_tokens", "accepted", "accepted_per_pos": [..], "generation_tokens"} summed
    over label sets (one per served model)."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "accepted_per_pos": {}, "generation_tokens": 0.0}
    names = {
        f"{PREFIX}num_drafts_total": "drafts",
        f"{PREFIX}num_draft_tokens_total": "draft_tokens",
        f"{PREFIX}num_accepted_tokens_total": "accepted",
        GENERATION_TOKENS: "generation_tokens",
    }
    for line in metrics_text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        name, labels, value = m["name"], m["labels"] or "", float(m["value"])
        if name in names:
            out[names[name]] += value
        elif name == f"{PREFIX}num_accepted_tokens_per_pos_total":
            pos = int(re.search(r'position="(\d+)"', labels)[1])
            out["accepted_per_pos"][pos] = out["accepted_per_pos"].get(pos, 0.0) + value
    out["accepted_per_pos"] = [out["accepted_per_pos"][k] for k in sorted(out["accepted_per_pos"])]
    return out


def acceptance(before: dict, after: dict) -> dict:
    """Mean acceptance length (1 + accepted per draft, vLLM's definition) and per-position rates."""
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = [
        a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0.0)
        for i, a in enumerate(after["accepted_per_pos"])
    ]
    return {
        "drafts": drafts,
        "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
        "accepted_tokens": accepted,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [p / drafts for p in per_pos] if drafts else [],
    }


def served_model(url: str, auth: Auth | None = None) -> str:
    """The first model `url` serves; ServerRefused (one line) when it refuses `auth`'s key."""
    import httpx

    auth = auth or Auth()
    resp = httpx.get(f"{url}/v1/models", timeout=30, headers=auth.headers)
    if resp.status_code in REFUSED:
        raise auth.refused(url, resp.status_code)
    if resp.status_code != 200:
        raise ServerError(f"{url}/v1/models answered {resp.status_code}: {auth.scrub(resp.text[:300])}")
    return resp.json()["data"][0]["id"]


def metrics_text(url: str, auth: Auth | None = None) -> str:
    import httpx

    resp = httpx.get(f"{url}/metrics", timeout=30, headers=(auth or Auth()).headers)
    return resp.text if resp.status_code == 200 else ""


# The engine updates its counters just after a request's last token is streamed: the scrape after a
# level polls until they stop changing, for at most this many polls of SETTLE_POLL_S.
SETTLE_POLLS = 20


SETTLE_POLL_S = 0.5


def settled_metrics_text(url: str, auth: Auth | None = None) -> str:
    text = metrics_text(url, auth)
    for _ in range(SETTLE_POLLS):
        time.sleep(SETTLE_POLL_S)
        again = metrics_text(url, auth)
        if spec_lines(again) == spec_lines(text):
            return again
        text = again
    return text


def spec_lines(text: str) -> str:
    """The /metrics lines the figures are computed from, kept in the report so they can be checked."""
    return "\n".join(
        line for line in text.splitlines() if line.startswith((PREFIX, GENERATION_TOKENS)) and not line.startswith("#")
    )
