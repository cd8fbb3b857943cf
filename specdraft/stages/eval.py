"""eval: the trained drafter measured with the reference speculative decoder (specdraft.decoding), exact.

Every held-out prompt (or one of `eval.prompts_file`) is decoded on one engine plainly (greedy) and in
each way its method drafts (its package under specdraft/methods/ says which: chains and EAGLE-2 dynamic
trees, with `temperature` > 0 sampled chains too; or one block of drafts per round, verified by one
target forward). Writes eval/report.json, report.md (both naming the method) and the accepted-length histogram.

Greedy output is checked token for token against the target's plain greedy decoding with the same
engine; a divergence at a logit gap below `tie_tolerance` is reported as a numerical tie (greedy
exactness needs identical numerics: docs/engine-facts.md), any other one is an error. Sampled decoding
(temperature > 0) drafts a chain by sampling and accepts with exact rejection sampling (Leviathan et al.
2023), so its output distribution is the target's.

Figures: tau (tokens per target forward), the histogram of accepted lengths, per-position acceptance
(share of rounds whose draft at depth i was accepted, as vLLM counts it), decode speed with and
without speculation, the draft/target cost ratio c, and Leviathan's bound for the measured α and c.

Engines (decoding.runners.make_runner): the eager one (transformers' DynamicCache and masks), and
decoding.static's preallocated KV caches with CUDA graphs on the GPU. Both decode with the same rounds
(decoding.rounds); greedy and speculative decoding of one evaluation always share one engine.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from specdraft import environment
from specdraft.config import Recipe
from specdraft.data.prompts import select_prompts
from specdraft.decoding.rounds import (
    Stats,
    alpha_from_tau,
    check_exact,
    greedy,
    leviathan_bound,
)
from specdraft.decoding.runners import TargetRunner, make_runner, sync
from specdraft.decoding.tree import decode_capacity
from specdraft.files import read_jsonl
from specdraft.methods import for_drafter, load_trained
from specdraft.run import RunFolder, staged_files
from specdraft.targets import Target, resolve_device


def load_prompts(recipe: Recipe, target: Target) -> list[dict]:
    """The held-out split of the run's data, or `eval.prompts_file`: JSONL with a `prompt` string or
    `messages`, optional `id` and the category field."""
    cfg = recipe.eval
    if not cfg.prompts_file:
        prompts, _ = select_prompts(recipe, target, "eval", cfg.num_prompts)
        return prompts
    chosen = []
    path = Path(cfg.prompts_file)
    # A line that is not JSON (or not UTF-8) is named with its line.
    for lineno, rec in read_jsonl(path, fix="fix the line (eval.prompts_file)", kind=None):
        if not isinstance(rec, dict) or not (
            isinstance(rec.get("prompt"), str) or isinstance(rec.get("messages"), list)
        ):
            # ValueError, not TypeError: a bad line of the user's file, which the CLI reports as such.
            raise ValueError(  # noqa: TRY004
                f"{path}:{lineno}: expected an object with a 'prompt' string or 'messages' list"
            )
        messages = rec.get("messages") or [{"role": "user", "content": rec["prompt"]}]
        ids = target.chat_ids(messages, add_generation_prompt=True)
        if len(ids) > recipe.data.max_prompt_tokens:
            continue
        item = {"id": str(rec.get("id", f"{path.name}:{lineno}")), "messages": messages, "prompt_ids": ids}
        if cfg.category_field in rec:
            item["category"] = str(rec[cfg.category_field])
        chosen.append(item)
        if len(chosen) >= cfg.num_prompts:
            break
    if not chosen:
        raise ValueError(f"{path}: no prompt of at most {recipe.data.max_prompt_tokens} tokens")
    return chosen


def plot_histogram(hists: dict[str, list[int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    width = 0.8 / len(hists)
    for j, (name, hist) in enumerate(hists.items()):
        total = max(1, sum(hist))
        ax.bar([i + j * width for i in range(len(hist))], [h / total for h in hist], width, label=name)
    ax.set_xlabel("draft tokens accepted per round")
    ax.set_ylabel("share of rounds")
    ax.set_title("Accepted lengths")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def evaluate(runner: TargetRunner, drafter, prompts: list[dict], cfg, eos: int, ways: int | None = None) -> dict:
    """Greedy AR and every drafting of the drafter's method (chain and tree, or block), or its first
    `ways`, on every prompt with the same engine: exactness and figures."""
    from tqdm import tqdm

    shapes = dict(list(for_drafter(drafter).decodings(runner, drafter, cfg).items())[:ways])
    stats = {name: Stats(shape.depth) for name, shape in shapes.items()}
    seconds, tokens = dict.fromkeys(("ar", *shapes), 0.0), dict.fromkeys(("ar", *shapes), 0)
    ties = dict.fromkeys(shapes, 0)
    per_prompt = []
    by_category = defaultdict(lambda: {"prompts": 0, **{name: Stats(shape.depth) for name, shape in shapes.items()}})
    # Sized once for every prompt: a static cache that grew mid-run would recapture its graphs in the timing.
    # A round feeds at most its drafts and the last token past the kept ones.
    runner.reserve(
        max(
            decode_capacity(prompts, cfg),
            max(len(p["prompt_ids"]) for p in prompts)
            + cfg.max_new_tokens
            + 1
            + max(shape.depth for shape in shapes.values()),
        )
    )
    for p in tqdm(prompts, desc="eval", unit="prompt"):
        sync(runner.device)
        t0 = time.perf_counter()
        ref, gaps = greedy(runner, p["prompt_ids"], cfg.max_new_tokens, eos)
        sync(runner.device)
        took = {"ar": time.perf_counter() - t0}
        tokens["ar"] += len(ref)
        row = {"id": p["id"], "tokens": len(ref)}
        cat = by_category[p.get("category", "all")]
        cat["prompts"] += 1
        for name, shape in shapes.items():
            rounds_before, hist_before = stats[name].rounds, list(stats[name].accepted_hist)
            t0 = time.perf_counter()
            spec = shape.run(runner, drafter, p["prompt_ids"], cfg.max_new_tokens, eos, stats[name])
            sync(runner.device)
            took[name] = time.perf_counter() - t0
            tokens[name] += len(spec)
            check = check_exact(spec, ref, gaps, cfg.tie_tolerance, p["id"])
            ties[name] += not check["exact"]
            row[name] = {"rounds": stats[name].rounds - rounds_before, **check}
            for a, (after, before) in enumerate(zip(stats[name].accepted_hist, hist_before)):
                for _ in range(after - before):
                    cat[name].add(a)
        for k, v in took.items():
            seconds[k] += v
        row["seconds"] = {k: round(v, 4) for k, v in took.items()}
        per_prompt.append(row)
    ar_tps = tokens["ar"] / seconds["ar"]
    ar_step = seconds["ar"] / max(1, tokens["ar"])  # one target forward of one token (prefill amortised)
    # The engine as it ran: a CUDA graph capture that failed mid-run shows here.
    report = {
        "prompts": len(prompts),
        "draft_tokens": next(iter(shapes.values())).depth,
        "engine": runner.engine,
        "autoregressive_tokens_per_s": round(ar_tps, 2),
        "seconds_per_prompt": {k: round(v / len(prompts), 4) for k, v in seconds.items()},
    }
    for name, shape in shapes.items():
        tps = tokens[name] / seconds[name]
        report[name] = {
            **stats[name].summary(),
            "shape": shape.shape,
            "described": shape.describe,
            "exact_prompts": len(prompts) - ties[name],
            "numerical_ties": ties[name],
            "speculative_tokens_per_s": round(tps, 2),
            **speed_figures(stats[name], shape.depth, tps / ar_tps, ar_step, seconds[name]),
        }
    if len(by_category) > 1 or "all" not in by_category:
        first = next(iter(shapes))
        report["per_category"] = {
            k: {
                "prompts": v["prompts"],
                **{f"tau_{n}": round(v[n].tau, 4) for n in shapes},
                f"per_position_acceptance_{first}": v[first].summary()["per_position_acceptance"],
            }
            for k, v in sorted(by_category.items())
        }
    report["per_prompt"] = per_prompt
    return report


def speed_figures(s: Stats, K: int, speedup: float, ar_step: float, seconds: float) -> dict:
    """The measured speedup beside what Leviathan's bound expects of the measured α (from tau) and cost
    ratio. Reported: one drafter forward over one autoregressive target step (`ar_step` seconds). The
    bound's c is a round's drafting cost per drafted position: the same for EAGLE-3 (one forward per
    position), a K-th of the block's forward for a block drafter (rounds.Stats says what is counted). The bound
    takes a verification to cost one target step; `round_cost` says where a round's time went, each part
    in target steps (decoding/clock.py's ROUND_PARTS: drafting, verification, the host's reads and work on
    them, keeping the cache, the drafter's advance), `round` the rounds' whole time and `whole` the
    decodes' (`seconds`: all the speculative decodes, prefills included) per round."""
    rounds = max(1, s.rounds)
    c = s.draft_seconds / max(1, s.draft_steps) / ar_step
    c_position = s.draft_seconds / rounds / K / ar_step
    alpha = alpha_from_tau(s.tau, K)
    bound = leviathan_bound(alpha, K, c_position)
    return {
        "speedup": round(speedup, 3),
        "draft_to_target_cost": round(c, 4),
        "alpha": round(alpha, 4),
        "leviathan_bound": round(bound, 3),
        "share_of_bound": round(speedup / bound, 3),
        "round_cost": {
            **{part: round(t / rounds / ar_step, 3) for part, t in s.seconds.items()},
            "round": round(s.round_seconds / rounds / ar_step, 3),
            "whole": round(seconds / rounds / ar_step, 3),
        },
    }


def sampled_tau(runner, drafter, prompts, cfg, eos, seed: int) -> dict:
    stats = Stats(cfg.draft_tokens)
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    method = for_drafter(drafter)
    for p in prompts:
        method.sampled(
            runner, drafter, p["prompt_ids"], cfg.max_new_tokens, eos, cfg.draft_tokens, cfg.temperature, stats, gen
        )
    return {"temperature": cfg.temperature, **stats.summary()}


def run(recipe: Recipe, folder: RunFolder) -> dict:

    cfg = recipe.eval
    t_start = time.time()
    device = torch.device(resolve_device(cfg.device, "eval.device"))
    drafter, target, _ = load_trained(recipe, folder)
    target.check_fits(recipe)
    drafter = drafter.to(device=device, dtype=getattr(torch, cfg.dtype))
    runner = make_runner(target, target.load_model(cfg.dtype, device=str(device)), cfg.engine)
    prompts = load_prompts(recipe, target)
    report = evaluate(runner, drafter, prompts, cfg, target.eos_token_id)
    names = [k for k in report if isinstance(report[k], dict) and "tau" in report[k]]  # the drafting ways
    # Top-level figures are the first drafting's (a chain, or a block): what vLLM's
    # num_speculative_tokens = K serves.
    report = {
        "method": drafter.METHOD,
        "drafting": names,
        "prompts": report["prompts"],
        "draft_tokens": report["draft_tokens"],
        **{k: v for k, v in report[names[0]].items() if k not in ("shape", "described")},
        "autoregressive_tokens_per_s": report["autoregressive_tokens_per_s"],
        **{k: v for k, v in report.items() if k not in ("prompts", "autoregressive_tokens_per_s")},
    }
    if cfg.temperature > 0 and for_drafter(drafter).samples:
        report["sampled"] = sampled_tau(runner, drafter, prompts, cfg, target.eos_token_id, recipe.train.seed)
    report.update({"dtype": cfg.dtype, "device": str(device), "hardware": environment.hardware_line()})
    out = folder.eval
    # The three files as one set, renamed in only when all are written: the last good report stays whole.
    with staged_files(out / "report.json", out / "accepted_lengths.png", out / "report.md") as (js, png, md):
        js.write_text(json.dumps(report, indent=2) + "\n")
        plot_histogram({n: report[n]["accepted_length_histogram"] for n in names}, png)
        md.write_text(render_markdown(report))
    metrics = {
        k: report[k]
        for k in (
            "method",
            "tau",
            "per_position_acceptance",
            "speedup",
            "autoregressive_tokens_per_s",
            "speculative_tokens_per_s",
            "draft_to_target_cost",
            "leviathan_bound",
        )
    }
    metrics.update({f"tau_{n}": report[n]["tau"] for n in names[1:]})
    print(
        f"eval: {drafter.METHOD} drafter, "
        + ", ".join(f"tau {n} {report[n]['tau']:.3f}" for n in names)
        + f"; report {out / 'report.md'}"
    )
    print(f"next: measure the served drafter: specdraft bench --run {folder.path} --endpoint URL")
    return folder.record(
        "eval",
        state="done",
        config=cfg,
        metrics=metrics,
        counts={"prompts": len(prompts), "exact": report["exact_prompts"], "ties": report["numerical_ties"]},
        seconds=time.time() - t_start,
    )


def render_markdown(r: dict) -> str:
    lines = [
        f"# Drafter evaluation: {r['method']} (reference decoder, greedy, exact)",
        "",
        f"- prompts: {r['prompts']}; dtype {r['dtype']}; device {r['device']}; hardware: {r['hardware']}",
        f"- engine: {r['engine']}; autoregressive decode (same engine): {r['autoregressive_tokens_per_s']} tok/s",
        "",
        "| drafting | shape | tau | per-position acceptance | exact / ties | tok/s | speedup | c | α | bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in r["drafting"]:
        s = r[name]
        pos = " / ".join(f"{a:.2f}" for a in s["per_position_acceptance"])
        lines.append(
            f"| {name} | {s['described']} | "
            f"**{s['tau']:.3f}** | {pos} | {s['exact_prompts']} / {s['numerical_ties']} | "
            f"{s['speculative_tokens_per_s']} | {s['speedup']}x | {s['draft_to_target_cost']} | "
            f"{s['alpha']} | {s['leviathan_bound']}x |"
        )
    lines += [
        "",
        (
            "Accepted-length histograms (0..depth): "
            + ", ".join(f"{n} {r[n]['accepted_length_histogram']}" for n in r["drafting"])
            + "."
        ),
        (
            "The bound is Leviathan et al.'s S = (1 − α^(γ+1)) / ((1 − α)(γc + 1)) with γ = depth, α from tau, "
            "c = one drafting step / one autoregressive target step."
        ),
    ]
    if "sampled" in r:
        s = r["sampled"]
        lines.append(
            f"\nSampled chain (temperature {s['temperature']}, exact rejection sampling): tau {s['tau']:.3f}, "
            f"per-position acceptance {' / '.join(f'{a:.2f}' for a in s['per_position_acceptance'])}"
        )
    if "per_category" in r:
        names = r["drafting"]
        lines += [
            "",
            "| category | prompts | " + " | ".join(f"tau {n}" for n in names) + " |",
            "|---|---|" + "---|" * len(names),
        ]
        lines += [
            f"| {k} | {v['prompts']} | " + " | ".join(str(v[f"tau_{n}"]) for n in names) + " |"
            for k, v in r["per_category"].items()
        ]
    lines += ["", "![accepted lengths](accepted_lengths.png)", ""]
    return "\n".join(lines)
