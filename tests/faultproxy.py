"""A real HTTP proxy on loopback that breaks requests on purpose, in front of a real server.

Every `fault_every`-th POST is broken, cycling through the faults a client meets in production:
- "delay": hold the request past the client's timeout, then close without answering;
- "drop":  forward it, then close the connection halfway through the response body;
- "500" / "429": answer with that status without forwarding.
It can also rewrite successful chat responses the way other servers shape reasoning: split the answer
into a reasoning part and an answer part and put the reasoning in `reasoning`, `reasoning_content`, or
inline between `<think>` markers, removing the other field (the incident: `reasoning` filled,
`reasoning_content` absent). What it injected is logged so tests can check what the client kept.

    with FaultProxy(upstream_url, fault_every=7) as proxy:
        ... proxy.url ... proxy.counts
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import httpx

FAULTS = ("delay", "drop", "500", "429")
REASONING_FIELDS = ("reasoning", "reasoning_content")
REASONS = {200: "OK", 429: "Too Many Requests", 500: "Internal Server Error"}


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        fault_every: int = 0,
        faults: tuple[str, ...] = FAULTS,
        delay_s: float = 30.0,
        reasoning_field: str | None = None,
        think: tuple[str, str] = ("<think>", "</think>"),
    ):
        self.upstream = upstream.rstrip("/")
        self.fault_every = fault_every
        self.faults = faults
        self.delay_s = delay_s
        self.reasoning_field = reasoning_field  # None, "reasoning", "reasoning_content" or "inline"
        self.think = think
        self.counts: Counter[str] = Counter()
        self.injected: list[tuple[str, str]] = []  # (reasoning, answer) per rewritten response
        self.raw_messages: list[dict] = []  # the messages as the client received them
        self._posts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.port = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.port = fut.result(timeout=30)
        return self

    async def _start(self) -> int:
        self._client = httpx.AsyncClient(base_url=self.upstream, timeout=None, limits=httpx.Limits(max_connections=256))
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        async def _stop():
            self._server.close()
            await self._client.aclose()

        asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- one connection: requests in turn (HTTP/1.1 keep-alive) ----

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self._handle(method, path, headers, body, writer):
                    return
        finally:
            writer.close()

    def _next_fault(self) -> str | None:
        self._posts += 1
        self.counts["posts"] += 1
        if self.fault_every and self._posts % self.fault_every == 0:
            fault = self.faults[(self._posts // self.fault_every) % len(self.faults)]
            self.counts[fault] += 1
            return fault
        return None

    async def _handle(self, method, path, headers, body, writer) -> bool:
        """Answer one request; False when the connection was closed on purpose."""
        fault = self._next_fault() if method == "POST" else None
        if fault == "delay":
            await asyncio.sleep(self.delay_s)
            return False
        if fault in ("500", "429"):
            status = int(fault)
            payload = json.dumps({"error": {"message": f"injected {status}"}}).encode()
            extra = {"retry-after": "0"} if status == 429 else {}
            await self._respond(writer, status, payload, "application/json", extra)
            return True
        forward = {k: v for k, v in headers.items() if k in ("content-type", "authorization", "accept")}
        r = await self._client.request(method, path, content=body, headers=forward)
        payload = r.content
        if r.status_code == 200 and path.endswith("/chat/completions"):
            payload = self._rewrite(payload)
        if fault == "drop":
            # Headers promise the whole body; half of it arrives, then the connection is gone.
            head = self._head(r.status_code, len(payload), r.headers.get("content-type", ""), {})
            writer.write(head + payload[: len(payload) // 2])
            await writer.drain()
            return False
        await self._respond(writer, r.status_code, payload, r.headers.get("content-type", "application/json"), {})
        return True

    def _rewrite(self, payload: bytes) -> bytes:
        data = json.loads(payload)
        message = data["choices"][0]["message"]
        if self.reasoning_field is not None:
            words = (message.get("content") or "").split(" ")
            half = max(1, len(words) // 2)
            reasoning, answer = " ".join(words[:half]), " ".join(words[half:])
            for name in REASONING_FIELDS:
                message.pop(name, None)
            if self.reasoning_field == "inline":
                start, end = self.think
                message["content"] = f"{start}{reasoning}{end}{answer}"
            else:
                message[self.reasoning_field] = reasoning
                message["content"] = answer
            self.injected.append((reasoning, answer))
        self.raw_messages.append(message)
        return json.dumps(data).encode()

    @staticmethod
    def _head(status: int, length: int, content_type: str, extra: dict) -> bytes:
        lines = [
            f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}",
            f"content-type: {content_type}",
            f"content-length: {length}",
            *(f"{k}: {v}" for k, v in extra.items()),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _respond(self, writer, status, payload, content_type, extra) -> None:
        writer.write(self._head(status, len(payload), content_type, extra) + payload)
        await writer.drain()
