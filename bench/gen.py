"""specdraft's generation client against a minimal plain client, on the same server and the same prompts.

    flock /tmp/specdraft-vllm.lock python bench/gen.py               # serves the bundled target with vLLM
    python bench/gen.py --endpoint http://127.0.0.1:8000 --samples 1024 --concurrency 1,8,32,128

Prints one JSON line: samples/s and output tokens/s of specdraft's gen (ServerGen: retries, reasoning
split, one flushed JSON line per conversation) and of a plain `openai` (or, where it is not installed,
plain httpx) loop with a semaphore, at each concurrency, and their ratio (the goal: >= 0.95). Both ask
for exactly the same thing (greedy, the same max tokens, token ids returned). Every prompt is sent once
before measuring so the server's prefix cache favours neither client; each client then runs `--repeats`
times per concurrency in A-B-B-A order and its best run counts, so load from other processes on the
machine is less likely to decide the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from specdraft import environment
from specdraft.config import load_recipe
from specdraft.engines import VllmServer
from specdraft.run import RunFolder
from specdraft.stages.gen import ServerGen, select_prompts
from specdraft.targets import Target


async def plain_loop(url: str, model: str, prompts: list[dict], concurrency: int, body: dict) -> dict:
    """The loop anyone would write first: a semaphore, one request per prompt, no retries, nothing saved."""
    try:
        from openai import AsyncOpenAI
    except ImportError:
        AsyncOpenAI = None
    slots = asyncio.Semaphore(concurrency)
    tokens = 0
    if AsyncOpenAI is not None:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
        extra = {k: v for k, v in body.items() if k not in ("max_tokens", "temperature", "top_p", "seed")}

        async def one(p):
            nonlocal tokens
            async with slots:
                r = await client.chat.completions.create(
                    model=model,
                    messages=p["messages"],
                    max_tokens=body["max_tokens"],
                    temperature=body["temperature"],
                    top_p=body["top_p"],
                    seed=body["seed"],
                    extra_body=extra,
                )
                tokens += r.usage.completion_tokens
    else:
        client = httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency))

        async def one(p):
            nonlocal tokens
            async with slots:
                r = await client.post("/v1/chat/completions", json={"model": model, "messages": p["messages"], **body})
                tokens += r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - t0
    await (client.close() if AsyncOpenAI is not None else client.aclose())
    return {
        "samples_per_s": round(len(prompts) / seconds, 3),
        "output_tok_s": round(tokens / seconds, 1),
        "seconds": round(seconds, 2),
    }


def ours(recipe, target: Target, prompts: list[dict], concurrency: int) -> dict:
    recipe.gen.concurrency = concurrency
    items = [{"id": p["id"], "system": [], "users": [p["messages"][-1]["content"]]} for p in prompts]
    with tempfile.TemporaryDirectory() as tmp:
        gen = ServerGen(recipe, RunFolder(Path(tmp)), target)
        t0 = time.perf_counter()
        stop = asyncio.run(gen.run(len(items), set(), items=items))
        seconds = time.perf_counter() - t0
        saved = sum(1 for _ in open(Path(tmp) / "conversations.jsonl"))
    if stop is not None or saved != len(items):
        raise RuntimeError(f"specdraft gen saved {saved} of {len(items)}: {stop}")
    return {
        "samples_per_s": round(len(items) / seconds, 3),
        "output_tok_s": round(gen.tokens / seconds, 1),
        "seconds": round(seconds, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", help="a running OpenAI-compatible server (default: start vLLM on the target)")
    ap.add_argument("--target", default="smollm2", help="the target (its tokenizer picks and checks the prompts)")
    ap.add_argument("--model", default="", help="served model name (default: the server's first)")
    ap.add_argument("--samples", type=int, default=64, help="prompts per client and concurrency")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=2, help="runs per client and concurrency; the best counts")
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    levels = [int(c) for c in args.concurrency.split(",")]

    recipe = load_recipe("smollm2-cpu")
    recipe.target.model = args.target
    recipe.gen.max_new_tokens = args.max_tokens
    recipe.gen.max_turns = 1
    recipe.gen.temperature = 0.0
    target = Target(args.target)
    prompts, _ = select_prompts(recipe, target, "train", args.samples)
    prompts = [{"id": p["id"], "messages": p["messages"][-1:]} for p in prompts]  # the template's own system prompt

    def measure(url: str) -> dict:
        model = args.model or httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        recipe.gen.endpoints, recipe.gen.model = [url], model
        body = ServerGen(recipe, RunFolder(Path(tempfile.gettempdir())), target).sampling()
        asyncio.run(plain_loop(url, model, prompts, max(levels), body))  # warm the prefix cache for both
        rows = []
        for c in levels:
            mine, plain = [], []
            for i in range(args.repeats):
                order = ["ours", "plain"] if i % 2 == 0 else ["plain", "ours"]
                for who in order:
                    if who == "ours":
                        mine.append(ours(recipe, target, prompts, c))
                    else:
                        plain.append(asyncio.run(plain_loop(url, model, prompts, c, body)))
            mine, plain = (max(runs, key=lambda r: r["output_tok_s"]) for runs in (mine, plain))
            rows.append(
                {
                    "concurrency": c,
                    "specdraft": mine,
                    "plain": plain,
                    "ratio_samples": round(mine["samples_per_s"] / plain["samples_per_s"], 3),
                    "ratio_tok_s": round(mine["output_tok_s"] / plain["output_tok_s"], 3),
                }
            )
        return {"model": model, "rows": rows}

    if args.endpoint:
        server_name, result = args.endpoint, measure(args.endpoint.rstrip("/"))
    else:
        log = Path(tempfile.gettempdir()) / f"bench-gen-vllm-{os.getpid()}.log"
        with VllmServer(target.path, log_path=log) as server:
            server_name, result = "vllm (started by the bench)", measure(server.url)
    try:
        import openai  # noqa: F401

        plain_client = "openai"
    except ImportError:
        plain_client = "httpx"
    print(
        json.dumps(
            {
                "bench": "gen",
                "hardware": environment.hardware_line(),
                "server": server_name,
                "model": result["model"],
                "samples": len(prompts),
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
                "plain_client": plain_client,
                "results": result["rows"],
                "min_ratio_tok_s": min(r["ratio_tok_s"] for r in result["rows"]),
            }
        )
    )


if __name__ == "__main__":
    main()
