"""Hidden states streamed from a vLLM server into the trainer: no hidden-state store on disk.

A states server is vLLM running the target with its `extract_hidden_states` speculative method
(capture.states_server): each one-token completion of a sample's token ids leaves the sample's aux and
layer-L states in one safetensors file. `ServedHidden` is told the order the trainer will consume the
samples in (`expect`), keeps a bounded number of those requests ahead of it, reads each file as it
arrives and deletes it, and hands the trainer the same per-sample tensors the disk store does (the final
norm applied as extract applies it, stored dtype bfloat16), so batching, packing and the loss are the
disk path's. The requests in flight are also bounded by the bytes their files may take
(`served_scratch_bytes`): the server's folder never holds more than that.

Faults: a failed request is retried (on the next endpoint where there are several) and counted; a server
specdraft started that died (kill -9, out of memory) is restarted first, and the requests it lost are
asked again. The order is fixed, so each position of it is handed out exactly once: nothing is skipped or
seen twice. A resumed trainer asks for the order from its step onwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from specdraft.config import Recipe
from specdraft.data.tokens import load_tokens
from specdraft.engines import READY_TIMEOUT_S, ServerError, VllmServer
from specdraft.hidden.capture import FinalNorm, NotStatesServer, request_states, resolved, states_server
from specdraft.run import RunFolder
from specdraft.targets import Target

# A state file beyond its tensors: the safetensors header (two tensor entries, ~200 bytes) rounded up.
FILE_OVERHEAD = 1024
# The connector writes the token ids as int64 beside the states.
TOKEN_ID_BYTES = 8
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Retry backoff: BACKOFF_S * 2**attempt seconds, capped.
BACKOFF_S, BACKOFF_MAX_S = 0.5, 10.0
# The probe request: a few tokens of the first sample.
PROBE_TOKENS = 4
# Where a server train started records its PID: the next run stops it if a killed trainer left it running.
PID_FILE = "server.pid"


def state_file_bytes(tokens: int, num_states: int, hidden_size: int, dtype: str) -> int:
    """Bytes of the connector's file for one request of `tokens` tokens."""
    return tokens * (num_states * hidden_size * DTYPE_BYTES[dtype] + TOKEN_ID_BYTES) + FILE_OVERHEAD


def memory_bytes(tokens: int, num_states: int, hidden_size: int) -> int:
    """Bytes of one sample's states as the trainer holds them (bfloat16), with its ids and mask."""
    return tokens * (num_states * hidden_size * 2 + 5)


def _one_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


class Endpoint:
    """One states server: its URL and served model name; `server` when specdraft started it or was handed
    it (then it is restarted when found dead); `owned`: started here, so stopped at the end."""

    def __init__(self, url: str, model: str = "", server: VllmServer | None = None, owned: bool = False):
        self.url, self.model, self.server, self.owned = url.rstrip("/"), model, server, owned
        self.lock = threading.Lock()
        self.restarts = 0
        self.closed = False  # stopped on purpose: never restarted

    def wait_back(self, timeout: float) -> None:
        """An endpoint someone else runs (rank 0's server under torchrun, or the user's) that refused a
        connection: wait for it to answer again (its restart) before the next try, at most `timeout` s."""
        import httpx

        t0 = time.time()
        while time.time() - t0 < timeout and not self.closed:
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)

    def recover(self) -> bool:
        """Restart the server if it is ours and has died; True when it did."""
        with self.lock:
            if self.closed or self.server is None or self.server.process is None or self.server.process.poll() is None:
                return False
            self.server.stop()
            for stale in self.server.log_path.parent.glob("*.safetensors*"):  # the dead server's requests
                stale.unlink(missing_ok=True)
            log = self.server.log_path
            start(self.server)
            if self.owned:
                (log.parent / PID_FILE).write_text(str(self.server.process.pid))
            print(
                f"train: the states server died and was restarted ({self.server.ready_seconds:.0f} s); its log: {log}",
                flush=True,
            )
            self.restarts += 1
            return True


def stop_stale(pid_file: Path) -> None:
    """Stop the states server a killed trainer left running (its process group), found by the PID it
    recorded and checked to still be that vLLM (a PID is reused once its process is gone)."""
    import os
    import signal

    try:
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        return
    if "vllm.entrypoints" in cmdline and str(pid_file.parent) in cmdline:
        print(f"train: stopping the states server a killed run left running (pid {pid})", flush=True)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pid_file.unlink(missing_ok=True)


def start(server: VllmServer) -> VllmServer:
    """Start a states server; a start that fails is one line naming its log."""
    try:
        return server.start()
    except ServerError as e:
        why = _one_line(server.log_tail()) or str(e).splitlines()[0]
        raise RuntimeError(
            f"the states server (vLLM, extract_hidden_states) did not start: {why}; its log: {server.log_path}"
        ) from None


class ServedHidden:
    """The rendered samples' hidden states, asked from states servers as the trainer needs them. Same
    interface as HiddenStore, plus `expect(order)` (the consumption order) and `close()`.

    `servers`: states servers already started (capture.states_server), restarted here when they die and
    left running at the end; else train.served_endpoints; else one server started under the run's `served/` folder.
    `on_arrival(i, item)`, when set, runs in the fetching thread for each sample as it arrives (the
    trainer derives the target's top tokens there, off its own thread)."""

    def __init__(self, recipe: Recipe, folder: RunFolder, servers: list[VllmServer] | None = None):
        folder.require("render")
        self.cfg = cfg = recipe.train
        extract = resolved(recipe.extract)
        self.target = Target(recipe.target.model, recipe.target.aux_layer_ids)
        _, self.samples = load_tokens(folder.tokens)
        self.lengths = [len(ids) for ids, _ in self.samples]
        self.aux_layer_ids: list[int] = self.target.aux_layer_ids
        self.hidden_size: int = self.target.hidden_size
        self.store_dtype = "bfloat16"  # what the reader hands out, as the disk store's bfloat16 shards
        self.num_states = len(self.aux_layer_ids) + 1
        self.server_dtype = extract.dtype
        self.norm = FinalNorm(self.target, extract.dtype)
        self.on_arrival: Callable | None = None
        self.stats = {
            "requests": 0,
            "retries": 0,
            "restarts": 0,
            "samples": 0,
            "tokens": 0,
            "cache_hits": 0,
            "wait_s": 0.0,
            "fetch_s": 0.0,
            "peak_scratch_bytes": 0,
            "first_request": None,
            "last_arrival": None,
        }
        self._stats_lock = threading.Lock()
        self.pipeline: _Pipeline | None = None
        self.kept: dict[int, dict] = {}  # held-out samples kept by the memory cache (asked at every scoring)
        self.keep_outside: set[int] = set()
        self.cache_left = cfg.served_cache_bytes if cfg.served_cache == "memory" else 0
        self._check_scratch()
        self.endpoints = self._endpoints(recipe, folder, servers, extract)
        try:
            for ep in self.endpoints:
                self._probe(ep)
        except BaseException:
            self.close()
            raise

    # -- set-up and the checks before any step

    def file_bytes(self, i: int) -> int:
        return state_file_bytes(self.lengths[i], self.num_states, self.hidden_size, self.server_dtype)

    def _check_scratch(self) -> None:
        longest = max(range(len(self.lengths)), key=self.lengths.__getitem__)
        need = self.file_bytes(longest)
        if need > self.cfg.served_scratch_bytes:
            raise ValueError(
                f"train.served_scratch_bytes = {self.cfg.served_scratch_bytes:,} is smaller than one "
                f"sample's states: sample {longest} ({self.lengths[longest]:,} tokens) needs "
                f"{need:,} bytes; set it to at least that (a few times it keeps requests in flight)"
            )

    def _endpoints(self, recipe: Recipe, folder: RunFolder, servers, extract) -> list[Endpoint]:
        if servers:
            return [Endpoint(s.url, s.model, s) for s in servers]  # restarted when they die, left running
        if self.cfg.served_endpoints:
            return [Endpoint(url) for url in self.cfg.served_endpoints]
        server = states_server(self.target, extract.dtype, folder.served, max(self.lengths) + 1, extract.vllm_args)
        stop_stale(folder.served / PID_FILE)
        print(
            f"train: starting a states server (vLLM, extract_hidden_states, aux layers {self.aux_layer_ids}); "
            f"its log: {server.log_path}",
            flush=True,
        )
        start(server)
        (folder.served / PID_FILE).write_text(str(server.process.pid))
        return [Endpoint(server.url, server.model, server, owned=True)]

    def _probe(self, ep: Endpoint) -> None:
        """Before any step: the endpoint is a states server for this target's layers, and takes the longest
        sample."""
        import httpx

        fix = "start it with specdraft's states server (docs/hidden-states.md) or leave train.served_endpoints empty"
        try:
            models = httpx.get(f"{ep.url}/v1/models", timeout=30).json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise ValueError(
                f"train.served_endpoints: {ep.url} is not a vLLM server answering /v1/models "
                f"({type(e).__name__}); {fix}"
            ) from None
        ep.model = ep.model or models["id"]
        limit = models.get("max_model_len")
        longest = max(range(len(self.lengths)), key=self.lengths.__getitem__)
        if limit is not None and self.lengths[longest] + 1 > limit:
            raise ValueError(
                f"train.served_endpoints: {ep.url} takes at most {limit:,} tokens (max_model_len) but "
                f"sample {longest} has {self.lengths[longest]:,} (+1 generated); restart it with "
                f"--max-model-len {self.lengths[longest] + 1} or render with a smaller max_length"
            )
        try:
            states = request_states(ep.url, ep.model, self.samples[0][0][:PROBE_TOKENS], timeout=120)
        except NotStatesServer:
            raise ValueError(
                f"train.served_endpoints: {ep.url} is not a vLLM server with the "
                f"extract_hidden_states method and a hidden-states connector; {fix}"
            ) from None
        except (httpx.HTTPError, OSError) as e:
            raise ValueError(
                f"train.served_endpoints: {ep.url} failed a states request ({type(e).__name__}: {e}); {fix}"
            ) from None
        n, width = states.shape[1], states.shape[2]
        if (n, width) != (self.num_states, self.hidden_size):
            raise ValueError(
                f"train.served_endpoints: {ep.url} returns {n} states of width {width} per token, but the recipe's "
                f"aux layers {self.aux_layer_ids} and the last layer of this target need {self.num_states} of "
                f"width {self.hidden_size}: start it with eagle_aux_hidden_state_layer_ids = "
                f"{[*self.aux_layer_ids, self.target.num_layers]}, or set target.aux_layer_ids to the server's"
            )

    # -- fetching

    def fetch(self, i: int, position: int = 0) -> dict:
        """Sample i's tensors, asked from an endpoint (retried and counted, restarting a dead server of
        ours), as HiddenStore[i] gives them."""
        import torch

        ids, mask = self.samples[i]
        t0 = time.time()
        with self._stats_lock:
            self.stats["first_request"] = self.stats["first_request"] or t0
        states = self._ask(i, list(ids), position)
        aux, last = self.norm.split(states)
        item = {
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": torch.tensor(mask, dtype=torch.uint8),
            "aux": aux.to(torch.bfloat16),
            "last": last.to(torch.bfloat16),
        }
        if self.on_arrival is not None:
            self.on_arrival(i, item)
        with self._stats_lock:
            self.stats["samples"] += 1
            self.stats["tokens"] += len(ids)
            self.stats["fetch_s"] += time.time() - t0
            self.stats["last_arrival"] = time.time()
        return item

    def _ask(self, i: int, row: list[int], position: int):
        """The states of sample i's tokens `row`: tried on the endpoints in turn from `position`'s."""
        import httpx

        waited = False
        for attempt in range(self.cfg.served_max_retries + 1):
            ep = self.endpoints[(position + attempt) % len(self.endpoints)]
            if ep.closed:
                raise RuntimeError("served hidden states: the source is closed")
            with self._stats_lock:
                self.stats["requests"] += 1
            try:
                return request_states(ep.url, ep.model, row, on_file=self._scratch_seen)
            except (httpx.HTTPError, OSError, NotStatesServer) as e:
                with self._stats_lock:
                    self.stats["retries"] += 1
                if attempt == self.cfg.served_max_retries:
                    raise RuntimeError(
                        f"served hidden states: sample {i} failed {attempt + 1} times; last: {type(e).__name__}: {e}"
                    ) from None
                waited = self._before_retry(ep, e, attempt, waited)

    @staticmethod
    def _before_retry(ep: Endpoint, error: Exception, attempt: int, waited: bool) -> bool:
        """Restart a dead server of ours; wait for one we cannot restart to answer again (once per sample:
        a server gone for good fails the run); else back off. Returns whether it has waited."""
        import httpx

        if ep.recover():
            return waited
        if isinstance(error, httpx.ConnectError) and ep.server is None and not waited:
            ep.wait_back(READY_TIMEOUT_S)
            return True
        time.sleep(min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt))
        return waited

    def _scratch_seen(self, path: Path) -> None:
        """The bytes of state files in the server's folder as one is read: the scratch the cap bounds."""
        total = 0
        for f in path.parent.glob("*.safetensors"):
            try:
                total += f.stat().st_size
            except FileNotFoundError:  # read and deleted by another request meanwhile
                pass
        with self._stats_lock:
            self.stats["peak_scratch_bytes"] = max(self.stats["peak_scratch_bytes"], total)

    def held_out(self, indices: list[int]) -> None:
        """The samples asked for outside the order (the held-out ones, at every scoring): the memory cache
        keeps them first, as far as served_cache_bytes goes; the training samples get what is left."""
        for i in indices:
            size = memory_bytes(self.lengths[i], self.num_states, self.hidden_size)
            if size <= self.cache_left:
                self.keep_outside.add(i)
                self.cache_left -= size

    def expect(self, order: list[int]) -> None:
        """The samples the trainer will take, in order (every epoch left): requests start, ahead of it."""
        if self.pipeline is not None:
            self.pipeline.close()
        self.pipeline = _Pipeline(self, order)

    # -- the HiddenStore interface

    def __len__(self) -> int:
        return len(self.samples)

    def tokens(self, i: int) -> tuple[list[int], list[int]]:
        return list(self.samples[i][0]), list(self.samples[i][1])

    def __getitem__(self, i: int) -> dict:
        """The next sample of the expected order when it is i; any other sample (held-out ones) is asked
        for now, outside the order."""
        if not 0 <= i < len(self.samples):
            raise IndexError(f"sample {i} outside 0..{len(self.samples) - 1}")
        if self.pipeline is not None and self.pipeline.next() == i:
            t0 = time.time()
            item = self.pipeline.take()
            with self._stats_lock:
                self.stats["wait_s"] += time.time() - t0
            return item
        if i in self.kept:
            with self._stats_lock:
                self.stats["cache_hits"] += 1
            return self.kept[i]
        item = self.fetch(i)
        if i in self.keep_outside:
            self.kept[i] = item
        return item

    def last(self, i: int, device=None):
        last = self[i]["last"]
        return last.to(device) if device is not None else last

    def batch(self, indices: list[int]) -> list[dict]:
        return [self[i] for i in indices]

    def report(self) -> dict:
        """What the served source did, for the manifest: requests, retries, restarts, the rate states
        arrived at, the time the trainer waited and the scratch it used."""
        s = dict(self.stats)
        span = (s.pop("last_arrival") or 0) - (s.pop("first_request") or 0)
        s["tokens_per_s"] = round(s["tokens"] / span, 1) if span > 0 else None
        s["restarts"] = sum(ep.restarts for ep in self.endpoints)
        s["wait_s"], s["fetch_s"] = round(s["wait_s"], 2), round(s["fetch_s"], 2)
        s["endpoints"] = len(self.endpoints)
        s["scratch_cap_bytes"] = self.cfg.served_scratch_bytes
        return s

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close(wait=False)
        for ep in getattr(self, "endpoints", []):
            ep.closed = True
            if ep.owned:
                ep.server.stop()
                (ep.server.log_path.parent / PID_FILE).unlink(missing_ok=True)


class _Pipeline:
    """The expected order's requests, at most `ahead` of the consumer (in flight or waiting to be taken)
    and at most `served_scratch_bytes` of their files in flight; positions the memory cache holds are
    not asked again."""

    def __init__(self, source: ServedHidden, order: list[int]):
        cfg = source.cfg
        self.source, self.order = source, list(order)
        self.ahead = max(1, cfg.served_ahead) * len(source.endpoints)
        self.cap = cfg.served_scratch_bytes
        self.cond = threading.Condition()
        self.futures: dict[int, Future] = {}
        self.consumed = self.submitted = self.inflight_bytes = 0
        self.closed = False
        self.cache: dict[int, dict] = {}
        self.keep, self.from_cache = self._cache_plan(cfg)
        self.pool = ThreadPoolExecutor(max_workers=self.ahead, thread_name_prefix="served")
        self.thread = threading.Thread(target=self._feed, daemon=True, name="served-feed")
        self.thread.start()

    def _cache_plan(self, cfg) -> tuple[set[int], set[int]]:
        """(samples to keep in memory at their first arrival, positions served from that copy)."""
        if cfg.served_cache != "memory":
            return set(), set()
        keep, used, seen, from_cache = set(), cfg.served_cache_bytes - self.source.cache_left, set(), set()
        src = self.source
        for p, i in enumerate(self.order):
            if i in seen:
                if i in keep:
                    from_cache.add(p)
                continue
            seen.add(i)
            size = memory_bytes(src.lengths[i], src.num_states, src.hidden_size)
            if used + size <= cfg.served_cache_bytes:
                keep.add(i)
                used += size
        return keep, from_cache

    def next(self) -> int | None:
        return self.order[self.consumed] if self.consumed < len(self.order) else None

    def _feed(self) -> None:
        src = self.source
        while True:
            with self.cond:
                while self.submitted < len(self.order) and self.submitted in self.from_cache:
                    self.submitted += 1
                if self.closed or self.submitted >= len(self.order):
                    return
                p = self.submitted
                size = src.file_bytes(self.order[p])
                self.cond.wait_for(
                    lambda size=size: (
                        self.closed or (len(self.futures) < self.ahead and self.inflight_bytes + size <= self.cap)
                    )
                )
                if self.closed:
                    return
                self.inflight_bytes += size
                self.submitted += 1
                self.futures[p] = self.pool.submit(self._run, p, size)
                self.cond.notify_all()

    def _run(self, p: int, size: int) -> dict:
        try:
            return self.source.fetch(self.order[p], p)
        finally:
            with self.cond:
                self.inflight_bytes -= size
                self.cond.notify_all()

    def take(self) -> dict:
        """The item at the next position of the order (waiting for it to arrive)."""
        p, i = self.consumed, self.order[self.consumed]
        if p in self.from_cache:
            item = self.cache[i]
            with self.source._stats_lock:
                self.source.stats["cache_hits"] += 1
        else:
            with self.cond:
                self.cond.wait_for(lambda: p in self.futures)
                future = self.futures[p]
            item = future.result()
            with self.cond:
                del self.futures[p]
            if i in self.keep:
                self.cache[i] = item
        with self.cond:
            self.consumed += 1
            self.cond.notify_all()
        return item

    def close(self, wait: bool = True) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.pool.shutdown(wait=wait, cancel_futures=True)
