"""A real vLLM server on loopback, started and stopped by us: for tests, benchmarks and local serving.

vLLM lives in its own virtualenv (it pins its own torch; FACTS.md), so it runs as a subprocess of
that interpreter. The server is ready when `/v1/models` answers; it is stopped by its PID (and its
process group, which holds vLLM's engine workers), whatever happened in between.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

VLLM_PYTHON = Path(os.environ.get("SPECDRAFT_VLLM_PYTHON",
                                  Path.home() / ".cache" / "specdraft" / "vllm-venv" / "bin" / "python"))
# The CPU backend's KV cache in GiB: 2 holds 2,048-token contexts for dozens of concurrent requests.
CPU_KVCACHE_GIB = 2
READY_TIMEOUT_S = 900.0


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message ends with its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_available(python: Path = VLLM_PYTHON) -> bool:
    return Path(python).exists()


def serve_args(model: str | Path, *, max_model_len: int = 2048, dtype: str = "bfloat16",
               speculative: dict | None = None, extra: list[str] | None = None) -> list[str]:
    """The arguments after `vllm serve` (also what we print for users to run themselves)."""
    args = [str(model), "--max-model-len", str(max_model_len), "--dtype", dtype]
    if speculative:
        args += ["--speculative-config", json.dumps(speculative)]
    return args + list(extra or [])


class VllmServer:
    """`with VllmServer(model, speculative={...}) as s: httpx.get(s.url + "/metrics")`."""

    def __init__(self, model: str | Path, *, log_path: Path, speculative: dict | None = None,
                 max_model_len: int = 2048, dtype: str = "auto", extra: list[str] | None = None,
                 python: Path = VLLM_PYTHON, port: int | None = None, env: dict | None = None):
        from ..targets import resolve_device, resolve_dtype

        self.model = str(model)
        # "auto": bfloat16 where the machine multiplies it in hardware, else float32 (on a CPU without
        # bf16 instructions, vLLM's CPU backend in bf16 is several times slower than in float32).
        self.dtype = resolve_dtype(dtype, resolve_device("auto"))
        self.args = serve_args(model, max_model_len=max_model_len, dtype=self.dtype, speculative=speculative,
                               extra=extra)
        self.python = Path(python)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None
        self.ready_seconds: float | None = None
        self.env = dict(env or {})  # set in the server's environment, over ours

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def start(self) -> "VllmServer":
        import httpx

        if not self.python.exists():
            raise ServerError(f"no vLLM interpreter at {self.python} (bash scripts/install_vllm.sh)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        model, *rest = self.args
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), *rest]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(CPU_KVCACHE_GIB)),
               **self.env}
        t0 = time.time()
        with open(self.log_path, "w") as log:
            # A session of its own, so stop() can end vLLM's worker processes with it.
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        while True:
            if self.process.poll() is not None:
                raise ServerError(f"vLLM exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > READY_TIMEOUT_S:
                self.stop()
                raise ServerError(f"vLLM not ready after {READY_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(2)
        self.ready_seconds = time.time() - t0
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            pass

    def metrics_text(self) -> str:
        import httpx

        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
