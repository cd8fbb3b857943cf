"""An async client for OpenAI-compatible servers: bounded concurrency per endpoint, retries that hold.

One `httpx.AsyncClient` per endpoint, a semaphore per endpoint, and each request goes to the endpoint
with the most free slots, so work spreads over servers by how fast they answer. Timeouts, dropped
connections, 429 and 5xx are retried with exponential backoff and full jitter (a 429's Retry-After is
honoured); any other 4xx is the request's own fault and is not retried. Every retry is counted by
its reason, so a run can report how healthy its servers were.

Every request carries the same `Auth`: the API key as `Authorization: Bearer …` (read from the
environment variable the recipe names, `OPENAI_API_KEY` unless told otherwise, never from the recipe
itself) and any extra headers. A 401 or 403 means the server refused the key: no retry can help, and
the run stops at once with one line (`ServerRefused`) saying which variable the key came from. The key
itself goes into no message: a server that echoes it back has it cut out (`Auth.scrub`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Self

import httpx

from specdraft.config import check_key_variable

RETRY_STATUSES = {429} | set(range(500, 600))
# How much of a failed response's body goes into the error record: enough for the server's message.
ERROR_BODY_CHARS = 500


# The key's default home: where the openai client and `vllm bench` look for it too.
DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"
REFUSED = {401: "Unauthorized", 403: "Forbidden"}
# A header value may name environment variables, `${NAME}`, read when the run starts (never recorded).
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class RequestFailed(RuntimeError):
    """A request that cannot succeed: a 4xx other than 401, 403 and 429, or retries exhausted."""

    def __init__(self, reason: str, *, status: int | None = None, attempts: int = 1, endpoint: str = ""):
        super().__init__(reason)
        self.reason, self.status, self.attempts, self.endpoint = reason, status, attempts, endpoint


class ServerRefused(RuntimeError):
    """The server answered 401 or 403: it refused the key (or the lack of one). The message is one line."""

    def __init__(self, message: str, *, status: int, endpoint: str):
        super().__init__(message)
        self.status, self.endpoint = status, endpoint


@dataclass(frozen=True)
class Auth:
    """What every request to an OpenAI-compatible server carries besides its body.

    `Auth.from_env(cfg.api_key_env, cfg.headers)`: the key is the value of the environment variable
    `key_env` (none sent when it is "", or the default variable unset or empty; any other variable unset is
    refused: it may be a key pasted where a name belongs); `headers` are sent as given, `${NAME}` in a value
    replaced by that environment variable's value. The recipe holds only names.
    """

    headers: dict[str, str] = field(default_factory=dict)
    key_env: str = ""  # the variable the key was read from ("" : none named)
    key_set: bool = False  # whether it held a key
    secrets: tuple[str, ...] = ()  # values read from the environment: cut out of any message

    @classmethod
    def from_env(
        cls,
        key_env: str = DEFAULT_API_KEY_ENV,
        headers: Mapping[str, str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Auth:
        environ = os.environ if environ is None else environ
        out: dict[str, str] = {}
        secrets: list[str] = []

        def expand(match: re.Match) -> str:
            name = match[1]
            if not environ.get(name):
                raise ValueError(f"gen.headers: the environment variable {name} (named as ${{{name}}}) is not set")
            secrets.append(environ[name])
            return environ[name]

        for name, value in (headers or {}).items():
            out[str(name)] = _ENV_REFERENCE.sub(expand, str(value))
        check_key_variable(key_env, DEFAULT_API_KEY_ENV, "gen.api_key_env", environ)
        key = environ.get(key_env, "").strip() if key_env else ""
        if key:
            out["Authorization"] = f"Bearer {key}"
            secrets.append(key)
        return cls(out, key_env, bool(key), tuple(s for s in secrets if s))

    def scrub(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "[secret]")
        return text

    def refused(self, endpoint: str, status: int) -> ServerRefused:
        """The one line a 401 / 403 ends the run with: which key was sent, and where to set another."""
        if self.key_set:
            sent = f"it refused the API key in ${self.key_env}"
        elif self.key_env:
            sent = f"no API key was sent (${self.key_env} is not set)"
        else:
            sent = "no API key was sent (gen.api_key_env is empty)"
        return ServerRefused(
            f"{endpoint} answered {status} {REFUSED.get(status, '')}: {sent}; set gen.api_key_env "
            f"to the name of the environment variable that holds the server's key "
            f"(--api-key-env NAME), or export {self.key_env or DEFAULT_API_KEY_ENV}",
            status=status,
            endpoint=endpoint,
        )


def base_url(endpoint: str) -> str:
    """`http://host:port`, `http://host:port/` and `http://host:port/v1` all name the same server."""
    url = endpoint.rstrip("/")
    return url.removesuffix("/v1")


@dataclass
class _Endpoint:
    url: str
    client: httpx.AsyncClient
    slots: asyncio.Semaphore
    in_flight: int = 0


class ServerPool:
    """`async with ServerPool(urls, concurrency=8) as pool: body = await pool.post("/v1/chat/completions", {...})`."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        concurrency: int,
        timeout_s: float,
        max_retries: int,
        backoff_s: float,
        backoff_max_s: float,
        seed: int = 0,
        auth: Auth | None = None,
    ):
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
        self.auth = auth or Auth()
        self.retries: Counter[str] = Counter()
        self.requests = 0
        self._endpoints: list[_Endpoint] = []

    @property
    def slots(self) -> int:
        return self.concurrency * len(self.urls)

    async def __aenter__(self) -> Self:
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        self._endpoints = [
            _Endpoint(
                url,
                httpx.AsyncClient(
                    base_url=url, timeout=httpx.Timeout(self.timeout_s), limits=limits, headers=self.auth.headers
                ),
                asyncio.Semaphore(self.concurrency),
            )
            for url in self.urls
        ]
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
        """GET `path` from the first endpoint, retried like a POST; return the decoded response."""
        body, _ = await self._send("GET", path, None, first=True)
        return body

    async def post(self, path: str, body: dict) -> tuple[dict, str]:
        """POST `body` as JSON; return (the decoded response, the endpoint that answered)."""
        return await self._send("POST", path, body)

    async def _send(self, method: str, path: str, body: dict | None, first: bool = False) -> tuple[dict, str]:
        for attempt in range(self.max_retries + 1):
            endpoint = self._endpoints[0] if first else self._pick()
            endpoint.in_flight += 1
            retry_after = None
            try:
                async with endpoint.slots:
                    self.requests += 1
                    r = await asyncio.wait_for(endpoint.client.request(method, path, json=body), self.timeout_s)
                if r.status_code == 200:
                    try:
                        return r.json(), endpoint.url
                    except json.JSONDecodeError:
                        reason = "invalid JSON in a 200 response"
                elif r.status_code in REFUSED:
                    raise self.auth.refused(endpoint.url, r.status_code)
                elif r.status_code in RETRY_STATUSES:
                    reason = f"HTTP {r.status_code}"
                    header = r.headers.get("retry-after")
                    retry_after = float(header) if header and header.replace(".", "", 1).isdigit() else None
                else:
                    raise RequestFailed(
                        f"HTTP {r.status_code}: {self.auth.scrub(r.text[:ERROR_BODY_CHARS])}",
                        status=r.status_code,
                        attempts=attempt + 1,
                        endpoint=endpoint.url,
                    )
            except (asyncio.TimeoutError, httpx.TimeoutException):
                reason = "timeout"
            except httpx.TransportError as e:
                # Refused, reset, or closed mid-response: the server (or the path to it) failed, not the request.
                reason = f"connection: {type(e).__name__}"
            finally:
                endpoint.in_flight -= 1
            if attempt == self.max_retries:
                raise RequestFailed(
                    f"{reason} (after {attempt + 1} attempts)", attempts=attempt + 1, endpoint=endpoint.url
                )
            self.retries[reason.split(":")[0]] += 1
            await asyncio.sleep(self._backoff(attempt, retry_after))
