"""bench: measure a served engine (vLLM, SGLang: any OpenAI-compatible endpoint) under load.

For each concurrency of a sweep (1, 2, 4 … max) it keeps that many streaming chat requests in flight
until a request count or a duration is reached, and measures output tokens/s, time to first token
(TTFT), time per output token after the first (TPOT) and inter-token latency (ITL, between streamed
chunks) percentiles. Acceptance comes from the engine's Prometheus `/metrics`: vLLM exports
`vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`
and `..._num_accepted_tokens_per_pos_total{position="i"}`; the figures of a level are the deltas of
these counters between a scrape before and one after it.

`compare` starts vLLM once per configuration (no speculation, n-gram, the drafter with K = 1…7, served
as its method says) through `VllmServer` and sweeps each, so one report shows them side by side:
speedup over no speculation at each concurrency, acceptance per position, tau against K.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdraft import environment
from specdraft.data.client import REFUSED, Auth, ServerRefused
from specdraft.data.prompts import select_prompts
from specdraft.engines import (
    ServerError,
    VllmServer,
    acceptance,
    metrics_text,
    served_model,
    settled_metrics_text,
    spec_decode_counters,
    spec_lines,
)
from specdraft.methods import METHODS as DRAFTER_METHODS
from specdraft.run import atomic_path, check_new_or_ours, open_run, remove_stale_temporaries, write_json, write_text
from specdraft.targets import Target

PERCENTILES = (50, 90, 99)
# A streamed request that sends nothing for this long is failed rather than waited on forever.
REQUEST_TIMEOUT_S = 600.0
# Failed requests are retried this many times before they count as failed (and are reported).
RETRIES = 2


def percentiles(values: list[float]) -> dict:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {f"p{p}": round(qs[p - 1] * 1000, 2) for p in PERCENTILES} | {
        "mean": round(statistics.fmean(values) * 1000, 2)
    }


@dataclass
class RequestResult:
    ok: bool
    tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(
    client, url: str, model: str, messages: list[dict], max_tokens: int, temperature: float, auth: Auth | None = None
) -> RequestResult:
    """One streaming chat completion: TTFT to the first content chunk, the gaps between chunks, and
    the engine's own count of completion tokens (a chunk may carry several tokens when drafts are
    accepted, so chunks are not tokens). A 401/403 raises ServerRefused: no retry can help."""
    auth = auth or Auth()
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code in REFUSED:
            raise auth.refused(url, resp.status_code)
        if resp.status_code != 200:
            body = auth.scrub((await resp.aread())[:200].decode(errors="replace"))
            return RequestResult(ok=False, error=f"HTTP {resp.status_code}: {body!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"):
                    arrivals.append(time.perf_counter())
    if not arrivals:
        return RequestResult(ok=True, tokens=tokens)
    ttft = arrivals[0] - t0
    tpot = (arrivals[-1] - arrivals[0]) / (tokens - 1) if tokens > 1 else None
    return RequestResult(
        ok=True, tokens=tokens, ttft=ttft, tpot=tpot, itl=[b - a for a, b in itertools.pairwise(arrivals)]
    )


async def _level(
    url: str,
    model: str,
    prompts: list[list[dict]],
    concurrency: int,
    num_requests: int,
    max_seconds: float,
    max_tokens: int,
    temperature: float,
    auth: Auth | None = None,
) -> dict:
    import httpx

    auth = auth or Auth()
    results: list[RequestResult] = []
    retries = 0
    next_prompt = 0
    refused: list[ServerRefused] = []  # the first 401/403 stops every worker
    t0 = time.perf_counter()

    async def worker(client):
        nonlocal next_prompt, retries
        while next_prompt < num_requests and time.perf_counter() - t0 < max_seconds and not refused:
            messages = prompts[next_prompt % len(prompts)]
            next_prompt += 1
            for attempt in range(RETRIES + 1):
                try:
                    r = await one_request(client, url, model, messages, max_tokens, temperature, auth)
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    r = RequestResult(ok=False, error=f"{type(e).__name__}: {e}")
                except ServerRefused as e:
                    refused.append(e)
                    return
                if r.ok:
                    break
                retries += attempt < RETRIES
            results.append(r)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, headers=auth.headers) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    if refused:
        raise refused[0]
    seconds = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(ok),
        "failed": len(results) - len(ok),
        "retries": retries,
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "seconds": round(seconds, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / seconds, 2),
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
    }


def sweep(
    url: str,
    prompts: list[list[dict]],
    concurrencies: list[int],
    *,
    num_requests: int,
    max_seconds: float,
    max_tokens: int,
    temperature: float = 0.0,
    model: str | None = None,
    auth: Auth | None = None,
) -> list[dict]:
    """One row per concurrency: latency and throughput figures, and acceptance from counter deltas.
    `auth`: the key and headers every request carries (none by default). A server that does not answer
    (nothing listening, gone mid-sweep) is a ServerError naming `url`."""
    import httpx
    from tqdm import tqdm

    try:
        model = model or served_model(url, auth)
    except httpx.TransportError as e:
        raise ServerError(
            f"bench: nothing answers at {url} ({type(e).__name__}: {e}); start the server "
            "first, or check the URL and port"
        ) from None
    rows = []
    for c in tqdm(concurrencies, desc="bench", unit="level"):
        try:
            before = metrics_text(url, auth)
            row = asyncio.run(
                _level(url, model, prompts, c, max(num_requests, c), max_seconds, max_tokens, temperature, auth)
            )
            after = settled_metrics_text(url, auth)
        except httpx.TransportError as e:
            raise ServerError(f"bench: {url} stopped answering at concurrency {c} ({type(e).__name__}: {e})") from None
        counters = (spec_decode_counters(before), spec_decode_counters(after))
        row["acceptance"] = acceptance(*counters)
        row["generation_tokens_counted"] = counters[1]["generation_tokens"] - counters[0]["generation_tokens"]
        row["metrics_before"], row["metrics_after"] = spec_lines(before), spec_lines(after)
        rows.append(row)
    return rows


# What `--compare` takes: K is a whole number of speculative tokens, 1 or more (vLLM refuses 0).
CONFIGURATIONS = ("none", "ngram", *DRAFTER_METHODS)
DEFAULT_K = 3


def parse_compare(spec: str) -> list[tuple[str, str, int | None]]:
    """`--compare` ("none,ngram:3,<method>:1,<method>:3") -> (name, method, K) each, checked before
    anything starts: a known method (none, ngram or a drafter method's name), K a whole number of at least
    1 (none takes no K), no configuration twice."""
    out, seen = [], set()
    for name in (n.strip() for n in spec.split(",")):
        method, colon, k = name.partition(":")
        if method not in CONFIGURATIONS:
            drafters = " or ".join(f"{m}[:K]" for m in DRAFTER_METHODS)
            raise ValueError(
                f"bench --compare {spec!r}: {name!r} is not a configuration; expected none, "
                f"ngram[:K] or {drafters} (K speculative tokens, 1 or more), comma-separated"
            )
        if method == "none":
            if colon:
                raise ValueError(f"bench --compare {spec!r}: {name!r}: none takes no K; write none")
            count = None
        elif not colon:
            count = DEFAULT_K
        elif not k.isdigit() or int(k) < 1:
            raise ValueError(
                f"bench --compare {spec!r}: {name!r}: K must be a whole number of speculative "
                f"tokens, 1 or more, got {k!r}"
            )
        else:
            count = int(k)
        key = (method, count)
        if key in seen:
            raise ValueError(f"bench --compare {spec!r}: {name!r} is given twice")
        seen.add(key)
        out.append((name, method, count))
    return out


def configurations(names: list[str], drafter: str | None) -> list[tuple[str, dict | None]]:
    """ "none", "ngram[:K]", "<method>[:K]" (a drafter method of specdraft/methods/, serving the drafter
    folder as it says) -> (name, vLLM speculative config), checked (parse_compare)."""
    out = []
    for name, method, k in parse_compare(",".join(names)):
        if method == "none":
            out.append((name, None))
        elif method == "ngram":
            # prompt_lookup_max: the longest n-gram matched against the context; 4 is vLLM's usual choice.
            out.append(
                (name, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
            )
        else:
            if not drafter:
                raise ValueError(f"{name}: needs a drafter folder (--drafter, or --run with an export)")
            out.append((name, DRAFTER_METHODS[method].serve_config(str(drafter), k)))
    return out


def compare(
    target_path: str,
    configs: list[tuple[str, dict | None]],
    prompts: list[list[dict]],
    concurrencies: list[int],
    log_dir: Path,
    server_args: list[str] | None = None,
    **sweep_args,
) -> list[dict]:
    """Start vLLM once per configuration (one server at a time, each given `server_args` too) and sweep
    each."""

    results = []
    for name, spec in configs:
        with VllmServer(
            target_path,
            speculative=spec,
            extra=server_args,
            log_path=Path(log_dir) / f"vllm-{name.replace(':', '-')}.log",
        ) as server:
            rows = sweep(server.url, prompts, concurrencies, **sweep_args)
        results.append(
            {
                "name": name,
                "speculative": spec,
                "server_ready_s": round(server.ready_seconds, 1),
                "dtype": server.dtype,
                "levels": rows,
            }
        )
    return results


def summarise(results: list[dict]) -> dict:
    """Speedup over the "none" configuration at each concurrency, tau per K (from acceptance)."""
    base = next((r for r in results if r["name"] == "none"), None)
    base_tps = {lv["concurrency"]: lv["output_tokens_per_s"] for lv in base["levels"]} if base else {}
    for r in results:
        for lv in r["levels"]:
            b = base_tps.get(lv["concurrency"])
            lv["speedup"] = round(lv["output_tokens_per_s"] / b, 3) if b else None
    tau_vs_k = {}
    for r in results:
        if r["speculative"] and "model" in r["speculative"]:  # a drafter's configuration
            acc = [lv["acceptance"] for lv in r["levels"] if lv["acceptance"]["drafts"]]
            drafts = sum(a["drafts"] for a in acc)
            if drafts:
                tau_vs_k[r["speculative"]["num_speculative_tokens"]] = round(
                    1 + sum(a["accepted_tokens"] for a in acc) / drafts, 4
                )
    return {"configurations": results, "tau_vs_k": dict(sorted(tau_vs_k.items()))}


def plot(report: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def save(fig, name):
        with atomic_path(out / name) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
        made.append(name)

    fig, ax = plt.subplots(figsize=(5, 3))
    for r in report["configurations"]:
        acc = r["levels"][0]["acceptance"]["per_position_acceptance"] if r["levels"] else []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["name"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_title("Acceptance per position (lowest concurrency)")
    if ax.lines:  # a configuration without speculation draws nothing here
        ax.legend()
    fig.tight_layout()
    save(fig, "bench_acceptance_per_position.png")

    fig, ax = plt.subplots(figsize=(5, 3))
    for r in report["configurations"]:
        pts = [(lv["concurrency"], lv["speedup"]) for lv in r["levels"] if lv.get("speedup")]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=r["name"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s vs no speculation")
    ax.set_title("Speedup vs concurrency")
    if ax.lines:  # a configuration without speculation draws nothing here
        ax.legend()
    fig.tight_layout()
    save(fig, "bench_speedup_vs_concurrency.png")

    if report["tau_vs_k"]:
        fig, ax = plt.subplots(figsize=(5, 3))
        ks = list(report["tau_vs_k"])
        ax.plot(ks, [report["tau_vs_k"][k] for k in ks], marker="o")
        ax.set_xlabel("speculative tokens K")
        ax.set_ylabel("mean acceptance length (tau)")
        ax.set_title("tau vs K (the drafter)")
        fig.tight_layout()
        save(fig, "bench_tau_vs_k.png")
    return made


def _ms(p: dict) -> str:
    return "–" if p["p50"] is None else f"{p['p50']} / {p['p90']} / {p['p99']}"


def render_markdown(report: dict, plots: list[str]) -> str:
    lines = [
        "# Served benchmark",
        "",
        f"- hardware: {report['hardware']}",
        (
            f"- {report['requests_per_level']} requests or {report['max_seconds']} s per level, "
            f"{report['max_tokens']} output tokens max, temperature {report['temperature']}"
        ),
        "",
        (
            "| configuration | concurrency | output tok/s | speedup | TTFT ms p50/p90/p99 | TPOT ms p50/p90/p99 "
            "| ITL ms p50/p90/p99 | tau | per-position acceptance | failed |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["configurations"]:
        for lv in r["levels"]:
            acc = lv["acceptance"]
            tau = f"{acc['mean_acceptance_length']:.3f}" if acc["mean_acceptance_length"] else "–"
            pos = " / ".join(f"{a:.2f}" for a in acc["per_position_acceptance"]) or "–"
            lines.append(
                f"| {r['name']} | {lv['concurrency']} | {lv['output_tokens_per_s']} | "
                f"{lv.get('speedup') or '–'} | {_ms(lv['ttft_ms'])} | {_ms(lv['tpot_ms'])} | "
                f"{_ms(lv['itl_ms'])} | {tau} | {pos} | {lv['failed']} |"
            )
    if report["tau_vs_k"]:
        lines += ["", "tau vs K (the drafter): " + ", ".join(f"K={k}: {t}" for k, t in report["tau_vs_k"].items())]
    lines += [""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)


def write_report(results: list[dict], out: Path, **settings) -> dict:

    report = {**summarise(results), **settings, "hardware": environment.hardware_line()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot(report, out)
    write_json(out / "bench.json", report)
    write_text(out / "bench.md", render_markdown(report, plots))
    return report


def concurrency_levels(max_concurrency: int) -> list[int]:
    levels = [1]
    while levels[-1] * 2 <= max_concurrency:
        levels.append(levels[-1] * 2)
    return levels


# The files bench writes into its report folder (plots: bench_*.png; server logs: logs/vllm-*.log).
REPORT = "bench.json"


def _earlier_bench(out: Path) -> bool:
    """Whether `out` is a report folder an earlier bench wrote: its bench.json is a bench report."""
    try:
        report = json.loads((out / REPORT).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and "configurations" in report and "tau_vs_k" in report


def run_bench(args) -> int:
    """`specdraft bench`: sweep one endpoint, or start vLLM per configuration and compare them."""

    if args.compare:
        parse_compare(args.compare)  # a malformed configuration is refused before anything starts
    if args.out:
        check_new_or_ours(
            Path(args.out),
            _earlier_bench,
            "bench --out",
            "its report would be written among them: give a new or empty folder, or one an "
            "earlier bench wrote its report in",
        )
    # The served endpoint gets gen's key and headers: their variables are checked before anything is written.
    check = (lambda r: Auth.from_env(r.gen.api_key_env, r.gen.headers)) if args.endpoint else None
    recipe, folder = open_run(args.recipe, args.run, args.set, check=check)
    target = Target(recipe.target.model, recipe.target.aux_layer_ids)
    prompts, _ = select_prompts(recipe, target, "eval", args.prompts or recipe.eval.num_prompts)
    if not prompts:
        raise ValueError(f"no held-out prompts in {recipe.data.source} for run {folder.path}")
    if prompts[0]["messages"] is None:
        raise ValueError(
            f"{recipe.data.source} holds pre-rendered rows: their held-out prompts are token ids, and "
            f"bench asks the server in text; bench a run whose data are conversations"
        )
    messages = [p["messages"] for p in prompts]
    levels = args.concurrency if args.concurrency else concurrency_levels(args.max_concurrency)
    sweep_args = {
        "num_requests": args.requests,
        "max_seconds": args.duration,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    out = Path(args.out) if args.out else folder.eval
    remove_stale_temporaries([out], every_tmp=False)
    if args.endpoint:
        # The served endpoint gets gen's key and headers (gen.api_key_env, gen.headers): the same servers.
        auth = Auth.from_env(recipe.gen.api_key_env, recipe.gen.headers)
        results = [
            {
                "name": args.name,
                "speculative": None,
                "endpoint": args.endpoint,
                "levels": sweep(args.endpoint.rstrip("/"), messages, levels, auth=auth, **sweep_args),
            }
        ]
    else:
        drafter = args.drafter or (folder.export("vllm") if (folder.export("vllm")).exists() else None)
        configs = configurations(args.compare.split(","), drafter)
        if any(spec and "model" in spec for _, spec in configs) and not (Path(drafter) / "config.json").is_file():
            raise ValueError(
                f"bench --drafter {drafter} is not a drafter folder (no config.json); give an exported "
                "one, e.g. runs/<name>/export/vllm"
            )
        results = compare(str(target.path), configs, messages, levels, out / "logs", **sweep_args)
    report = write_report(
        results,
        out,
        requests_per_level=args.requests,
        max_seconds=args.duration,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        prompts=len(messages),
    )
    folder.record(
        "bench",
        state="done",
        counts={"configurations": len(results), "levels": len(levels)},
        metrics={"tau_vs_k": report["tau_vs_k"]},
    )
    for r in report["configurations"]:
        for lv in r["levels"]:
            tau = lv["acceptance"]["mean_acceptance_length"]
            print(
                f"bench: {r['name']:10s} concurrency {lv['concurrency']:4d}: {lv['output_tokens_per_s']:9.1f} tok/s"
                + (f", tau {tau:.3f}" if tau else "")
                + (f", {lv['failed']} failed" if lv["failed"] else "")
            )
    print(f"report: {out / 'bench.md'}")
    print(f"next: specdraft status --run {folder.path}")
    return 0
