"""eval: a reference speculative decoder (chain drafting, greedy) on the target, exact by construction.

Each round the drafter proposes K tokens from the target's aux states; one target forward over
[last token, d_1..d_K] verifies them; the longest agreeing prefix is kept plus the target's own next
token. The output is checked token for token against the target's plain greedy decoding with the same
engine (same model, same cache code); a divergence at a logit gap below `tie_tolerance` is reported as
a numerical tie (FACTS.md: greedy exactness needs identical numerics), any other one is an error.

Figures: tau (tokens per target forward), the histogram of accepted lengths, per-position acceptance
(share of rounds whose draft position i was accepted, as vLLM counts it), decode speed with and
without speculation, and the draft/target cost ratio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import Recipe
from ..data.generate import select_prompts
from ..run import Run, atomic_path, write_json, write_text
from ..targets import Target, get_attr, tap_hidden_states
from ..train import load_trained

EVAL_DIR = "eval"


class ExactnessError(AssertionError):
    """Speculative output differs from the target's greedy output beyond a numerical tie."""


class TargetRunner:
    """The target with a KV cache, returning logits and aux states for the tokens it is fed."""

    def __init__(self, target: Target, model):
        self.target, self.model = target, model
        self.base = get_attr(model, target.family.decoder)
        self.cache = None

    def reset(self):
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n, V] and aux states [n, n_aux*H] for `ids` appended to the cache."""
        x = torch.tensor([ids])
        with tap_hidden_states(self.model, self.target.family, self.target.aux_layer_ids) as cap:
            out = self.base(input_ids=x, past_key_values=self.cache, use_cache=True)
        logits = self.model.lm_head(out.last_hidden_state)[0].float()
        aux = torch.cat([cap[k] for k in self.target.aux_layer_ids], dim=-1)[0]
        return logits, aux

    def crop(self, length: int):
        """Keep the first `length` positions (transformers crops by a negative count of tokens)."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)


@dataclass
class Stats:
    K: int
    rounds: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    draft_steps: int = 0
    verify_seconds: float = 0.0

    def __post_init__(self):
        self.accepted_hist = [0] * (self.K + 1)
        self.accepted_at = [0] * self.K

    def add(self, accepted: int):
        self.rounds += 1
        self.accepted_hist[accepted] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1


def greedy(runner: TargetRunner, prompt: list[int], max_new: int, eos: int) -> tuple[list[int], list[float]]:
    """Plain greedy decoding; also the top-1/top-2 logit gap at each step (for the tie check)."""
    runner.reset()
    logits, _ = runner.forward(prompt)
    out, gaps = [], []
    while True:
        top2 = logits[-1].topk(2).values
        gaps.append((top2[0] - top2[1]).item())
        out.append(int(logits[-1].argmax()))
        if out[-1] == eos or len(out) >= max_new:
            return out, gaps
        logits, _ = runner.forward([out[-1]])


@torch.inference_mode()
def speculative(runner: TargetRunner, drafter, prompt: list[int], max_new: int, eos: int, K: int,
                stats: Stats) -> list[int]:
    runner.reset()
    logits, aux = runner.forward(prompt)
    out = [int(logits[-1].argmax())]
    n = len(prompt)  # target cache length; out[-1] is x_n, not yet fed to the target
    # Drafter step 0 over the prompt: position t reads (h_t, x_{t+1}).
    new_hidden = drafter.project(aux)
    new_tokens = prompt[1:] + out[-1:]
    new_positions = list(range(n))
    dcache = None
    while out[-1] != eos and len(out) < max_new:
        t0 = time.perf_counter()
        pos = torch.tensor([new_positions])
        logits_d, h, kv = drafter(new_hidden[None], torch.tensor([new_tokens]), pos, base=dcache)
        dcache = kv if dcache is None else (torch.cat([dcache[0], kv[0]], 2), torch.cat([dcache[1], kv[1]], 2))
        drafts = [int(drafter.to_target_ids(logits_d[0, -1].argmax()))]
        h, diag, p = h[:, -1:], [], new_positions[-1]
        for i in range(1, K):
            logits_d, h, kv = drafter(h, torch.tensor([[drafts[-1]]]), torch.tensor([[p + i]]), base=dcache,
                                      diag=diag, q_offset=dcache[0].shape[2] - 1)
            diag = diag + [kv]
            drafts.append(int(drafter.to_target_ids(logits_d[0, -1].argmax())))
        stats.draft_seconds += time.perf_counter() - t0
        stats.draft_steps += K
        t0 = time.perf_counter()
        logits, aux = runner.forward([out[-1]] + drafts)
        stats.verify_seconds += time.perf_counter() - t0
        choice = logits.argmax(-1).tolist()  # target's token after each fed position
        a = 0
        while a < K and drafts[a] == choice[a]:
            a += 1
        stats.add(a)
        accepted = drafts[:a] + [choice[a]]
        runner.crop(n + 1 + a)
        new_hidden = drafter.project(aux[: a + 1])
        new_tokens = accepted
        new_positions = list(range(n, n + a + 1))
        n += a + 1
        out += accepted
        if eos in accepted:
            break
    if eos in out:
        out = out[: out.index(eos) + 1]
    return out[:max_new]


def check_exact(spec: list[int], ref: list[int], gaps: list[float], tol: float, pid: str) -> dict:
    if spec == ref:
        return {"exact": True}
    j = next((i for i, (a, b) in enumerate(zip(spec, ref)) if a != b), min(len(spec), len(ref)))
    gap = gaps[j] if j < len(gaps) else float("inf")
    if gap < tol:
        return {"exact": False, "tie_at": j, "logit_gap": gap}
    raise ExactnessError(f"prompt {pid}: speculative output differs from greedy at token {j} "
                         f"(logit gap {gap:.3g} >= {tol}): the decoder is wrong, not the numerics")


def plot_histogram(hist: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(range(len(hist)), hist)
    ax.set_xlabel("draft tokens accepted per round")
    ax.set_ylabel("rounds")
    ax.set_title("Accepted lengths")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def run(recipe: Recipe, run: Run) -> dict:
    from tqdm import tqdm

    from .. import environment

    cfg = recipe.eval
    t_start = time.time()
    drafter, target, _ = load_trained(recipe, run)
    drafter = drafter.to(getattr(torch, cfg.dtype))
    runner = TargetRunner(target, target.load_model(cfg.dtype))
    prompts, _ = select_prompts(recipe, target, "eval", cfg.num_prompts)
    eos = target.eos_token_id
    stats = Stats(cfg.draft_tokens)
    per_prompt, ties = [], 0
    ar_seconds = spec_seconds = 0.0
    ar_tokens = spec_tokens = 0
    for p in tqdm(prompts, desc="eval", unit="prompt"):
        t0 = time.perf_counter()
        ref, gaps = greedy(runner, p["prompt_ids"], cfg.max_new_tokens, eos)
        ar_seconds += time.perf_counter() - t0
        ar_tokens += len(ref)
        rounds_before = stats.rounds
        t0 = time.perf_counter()
        spec = speculative(runner, drafter, p["prompt_ids"], cfg.max_new_tokens, eos, cfg.draft_tokens, stats)
        spec_seconds += time.perf_counter() - t0
        spec_tokens += len(spec)
        check = check_exact(spec, ref, gaps, cfg.tie_tolerance, p["id"])
        ties += not check["exact"]
        per_prompt.append({"id": p["id"], "tokens": len(spec), "rounds": stats.rounds - rounds_before, **check})
    K = cfg.draft_tokens
    tau = sum((a + 1) * c for a, c in enumerate(stats.accepted_hist)) / max(1, stats.rounds)
    target_step = stats.verify_seconds / max(1, stats.rounds)
    report = {
        "prompts": len(prompts),
        "draft_tokens": K,
        "tau": round(tau, 4),
        "accepted_length_histogram": stats.accepted_hist,
        "per_position_acceptance": [round(c / max(1, stats.rounds), 4) for c in stats.accepted_at],
        "rounds": stats.rounds,
        "exact_prompts": len(prompts) - ties,
        "numerical_ties": ties,
        "autoregressive_tokens_per_s": round(ar_tokens / ar_seconds, 2),
        "speculative_tokens_per_s": round(spec_tokens / spec_seconds, 2),
        "speedup": round((spec_tokens / spec_seconds) / (ar_tokens / ar_seconds), 3),
        "draft_step_seconds": round(stats.draft_seconds / max(1, stats.draft_steps), 5),
        "verify_seconds": round(target_step, 5),
        "draft_to_target_cost": round(stats.draft_seconds / max(1, stats.draft_steps) / target_step, 4),
        "dtype": cfg.dtype,
        "hardware": environment.hardware_line(),
        "per_prompt": per_prompt,
    }
    out = run.path / EVAL_DIR
    write_json(out / "report.json", report)
    plot_histogram(stats.accepted_hist, out / "accepted_lengths.png")
    write_text(out / "report.md", render_markdown(report))
    metrics = {k: report[k] for k in ("tau", "per_position_acceptance", "speedup", "autoregressive_tokens_per_s",
                                      "speculative_tokens_per_s", "draft_to_target_cost")}
    return run.record("eval", state="done", config=cfg, metrics=metrics,
                      counts={"prompts": len(prompts), "exact": len(prompts) - ties, "ties": ties},
                      seconds=time.time() - t_start)


def render_markdown(r: dict) -> str:
    pos = " / ".join(f"{a:.3f}" for a in r["per_position_acceptance"])
    return "\n".join([
        "# Drafter evaluation (reference decoder, chain, greedy)",
        "",
        f"- prompts: {r['prompts']} held-out; draft tokens per round K = {r['draft_tokens']}; dtype {r['dtype']}",
        f"- **tau (tokens per target forward): {r['tau']:.3f}**",
        f"- per-position acceptance: {pos}",
        f"- accepted-length histogram (0..K): {r['accepted_length_histogram']}",
        f"- exactness: {r['exact_prompts']}/{r['prompts']} identical to greedy, "
        f"{r['numerical_ties']} numerical ties",
        f"- decode: {r['speculative_tokens_per_s']} tok/s speculative vs {r['autoregressive_tokens_per_s']} "
        f"tok/s autoregressive = {r['speedup']}x; draft/target cost ratio c = {r['draft_to_target_cost']}",
        f"- hardware: {r['hardware']}",
        "",
        "![accepted lengths](accepted_lengths.png)",
        "",
    ])
