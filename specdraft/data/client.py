"""An async client for OpenAI-compatible servers: bounded concurrency per endpoint, retries that hold.

One `httpx.AsyncClient` per endpoint, a semaphore per endpoint, and each request goes to the endpoint
with the most free slots, so work spreads over servers by how fast they answer. Timeouts, dropped
connections, 429 and 5xx are retried with exponential backoff and full jitter (a 429's Retry-After is
honoured); any other 4xx is the request's own fault and is not retried. Every retry is counted by
its reason, so a run can report how healthy its servers were.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass

import httpx

RETRY_STATUSES = {429} | set(range(500, 600))
# How much of a failed response's body goes into the error record: enough for the server's message.
ERROR_BODY_CHARS = 500


class RequestFailed(Exception):
    """A request that cannot succeed: a 4xx other than 429, or retries exhausted."""

    def __init__(self, reason: str, *, status: int | None = None, attempts: int = 1, endpoint: str = ""):
        super().__init__(reason)
        self.reason, self.status, self.attempts, self.endpoint = reason, status, attempts, endpoint


def base_url(endpoint: str) -> str:
    """`http://host:port`, `http://host:port/` and `http://host:port/v1` all name the same server."""
    url = endpoint.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class _Endpoint:
    url: str
    client: httpx.AsyncClient
    slots: asyncio.Semaphore
    in_flight: int = 0


class ServerPool:
    """`async with ServerPool(urls, concurrency=8) as pool: body = await pool.post("/v1/chat/completions", {...})`."""

    def __init__(self, endpoints: list[str], *, concurrency: int, timeout_s: float, max_retries: int,
                 backoff_s: float, backoff_max_s: float, seed: int = 0):
        if not endpoints:
            raise ValueError("no endpoint given")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.urls = [base_url(e) for e in endpoints]
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.rng = random.Random(seed)
        self.retries: Counter[str] = Counter()
        self.requests = 0
        self._endpoints: list[_Endpoint] = []

    @property
    def slots(self) -> int:
        return self.concurrency * len(self.urls)

    async def __aenter__(self) -> "ServerPool":
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        self._endpoints = [
            _Endpoint(url, httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(self.timeout_s), limits=limits),
                      asyncio.Semaphore(self.concurrency))
            for url in self.urls]
        return self

    async def __aexit__(self, *exc) -> None:
        for e in self._endpoints:
            await e.client.aclose()

    def _pick(self) -> _Endpoint:
        # Least loaded first; ties go to a random one so equal servers share the work.
        least = min(e.in_flight for e in self._endpoints)
        return self.rng.choice([e for e in self._endpoints if e.in_flight == least])

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        delay = self.rng.uniform(0, min(self.backoff_max_s, self.backoff_s * 2**attempt))
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.backoff_max_s))
        return delay

    async def get(self, path: str) -> dict:
        endpoint = self._endpoints[0]
        r = await endpoint.client.get(path)
        r.raise_for_status()
        return r.json()

    async def post(self, path: str, body: dict) -> tuple[dict, str]:
        """POST `body` as JSON; return (the decoded response, the endpoint that answered)."""
        for attempt in range(self.max_retries + 1):
            endpoint = self._pick()
            endpoint.in_flight += 1
            retry_after = None
            try:
                async with endpoint.slots:
                    self.requests += 1
                    r = await asyncio.wait_for(endpoint.client.post(path, json=body), self.timeout_s)
                if r.status_code == 200:
                    try:
                        return r.json(), endpoint.url
                    except json.JSONDecodeError:
                        reason = "invalid JSON in a 200 response"
                elif r.status_code in RETRY_STATUSES:
                    reason = f"HTTP {r.status_code}"
                    header = r.headers.get("retry-after")
                    retry_after = float(header) if header and header.replace(".", "", 1).isdigit() else None
                else:
                    raise RequestFailed(f"HTTP {r.status_code}: {r.text[:ERROR_BODY_CHARS]}", status=r.status_code,
                                        attempts=attempt + 1, endpoint=endpoint.url)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                reason = "timeout"
            except httpx.TransportError as e:
                # Refused, reset, or closed mid-response: the server (or the path to it) failed, not the request.
                reason = f"connection: {type(e).__name__}"
            finally:
                endpoint.in_flight -= 1
            if attempt == self.max_retries:
                raise RequestFailed(f"{reason} (after {attempt + 1} attempts)", attempts=attempt + 1,
                                    endpoint=endpoint.url)
            self.retries[reason.split(":")[0]] += 1
            await asyncio.sleep(self._backoff(attempt, retry_after))
