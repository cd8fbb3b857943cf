"""Rounds of speculative decoding: draft, verify with one target forward, keep the accepted path.

decode() is the one round loop of every drafter method (prefill, then rounds of draft, verify, accept,
keep and drafter advance, timed and synced alike for every kind of round); a RoundPolicy says which
drafter state a decode keeps (made by the method's DecodeStates on the runner's engine), what a round
drafts and what it accepts. GreedyTree keeps the longest drafted path of a tree (or chain) whose tokens
the target itself picks, plus the target's own next token; SampledChain drafts a chain by sampling and
accepts with exact rejection sampling (Leviathan et al. 2023), so the output is distributed as the
target's own sampling; a block method's policy (methods/dflash/decode.py's GreedyBlock) drafts a whole
block in one drafter forward and accepts it as GreedyTree does a chain.
Greedy output is checked against plain greedy decoding on the same engine (check_exact): a divergence
at a logit gap below the tolerance is a numerical tie (bf16 verification passes can flip near-ties),
anything else is a bug. Stats turns the rounds into tau, the accepted-length histogram and
per-position acceptance; alpha_from_tau and leviathan_bound turn tau into the expected speedup.
RoundClock splits a round's time into its parts (ROUND_PARTS): the drafter's forwards, the target's
verification, the host's reads of device results (host_read marks them wherever a policy or a state
makes one) and its work on them, keeping the cache's accepted slots, and the drafter's advance.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from specdraft.decoding.clock import ROUND_PARTS, RoundClock, host_read, timing
from specdraft.decoding.runners import TargetRunner
from specdraft.decoding.tree import Tree, TreeShape, cache_tokens, draft_tree

# Bisection steps to invert tau(α) = (1 − α^(K+1)) / (1 − α): 60 halvings reach float precision.
ALPHA_BISECTION_STEPS = 60

Draft = TypeVar("Draft")
Verdict = TypeVar("Verdict")


class ExactnessError(AssertionError):
    """Speculative output differs from the target's greedy output beyond a numerical tie."""


@dataclass
class Stats:
    """A decode's rounds. `draft_steps` counts drafter forward passes: an EAGLE-3 round makes one per
    draft depth (the first is the advance over the tokens the last round accepted, whose output is the
    root's), a DFlash round one for its whole block. `draft_seconds` is all the drafter's time in the
    rounds: those forwards and the advance (for DFlash, projecting the accepted positions into its
    context keys and values). So draft_step_seconds is the cost of one drafter forward, and
    draft_seconds / rounds the drafting cost of a round, whatever the method."""

    K: int  # the deepest draft position
    rounds: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ROUND_PARTS, 0.0))  # by part
    round_seconds: float = 0.0  # the rounds' whole time: their parts and the loop's own Python

    def __post_init__(self):
        self.accepted_hist = [0] * (self.K + 1)
        self.accepted_at = [0] * self.K

    @property
    def draft_seconds(self) -> float:
        """The drafter's time in the rounds: its forwards and its advance, not the host's reads."""
        return self.seconds["draft"] + self.seconds["advance"]

    @property
    def verify_seconds(self) -> float:
        return self.seconds["verify"]

    def add(self, accepted: int):
        self.rounds += 1
        self.accepted_hist[accepted] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    @property
    def tau(self) -> float:
        return sum((a + 1) * c for a, c in enumerate(self.accepted_hist)) / max(1, self.rounds)

    def summary(self) -> dict:
        return {
            "tau": round(self.tau, 4),
            "accepted_length_histogram": self.accepted_hist,
            "per_position_acceptance": [round(c / max(1, self.rounds), 4) for c in self.accepted_at],
            "rounds": self.rounds,
            "draft_step_seconds": round(self.draft_seconds / max(1, self.draft_steps), 6),
            "verify_seconds": round(self.verify_seconds / max(1, self.rounds), 6),
            "round_seconds": {
                **{k: round(v / max(1, self.rounds), 6) for k, v in self.seconds.items()},
                "round": round(self.round_seconds / max(1, self.rounds), 6),
            },
        }


def greedy(runner: TargetRunner, prompt: list[int], max_new: int, eos: int) -> tuple[list[int], list[float]]:
    """Plain greedy decoding; also the top-1/top-2 logit gap at each step (for the tie check)."""
    runner.reserve(len(prompt) + max_new)
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


class RoundPolicy(Protocol[Draft, Verdict]):
    """What differs between greedy and sampled rounds, and between drafter methods; decode() runs the
    rest. `shape` sizes the cache (a block drafter's K drafts are a chain); `forwards` is the drafter
    forwards a round counts in Stats.draft_steps."""

    shape: TreeShape
    forwards: int

    def start(self, runner: TargetRunner, drafter):
        """The drafter's state for one decode: advance(aux, next tokens, first position) feeds it the
        target's states of newly accepted positions, and draft() reads it."""

    def first_token(self, logits: torch.Tensor) -> int:
        """The token after the prompt, from the prefill's last logits [V]."""

    def draft(self, state) -> Draft:
        """This round's draft from the drafter's root (the last accepted token)."""

    def verify(self, runner: TargetRunner, root: int, draft: Draft, n: int) -> tuple[Verdict, torch.Tensor]:
        """One target forward over the root (cache position n) and the draft -> what accept reads of its
        logits, and the aux states [1 + drafted, n_aux*H]. Timed as verification, so what it computes on
        the logits (an argmax, a softmax) is charged to the target; its reads of them on the host go
        inside clock.host_read(), charged to the host."""

    def accept(self, draft: Draft, verdict: Verdict) -> tuple[list[int], list[int]]:
        """-> the accepted drafted nodes (indices into the draft, root to leaf) and the accepted tokens:
        theirs, then the target's own next one."""


class GreedyTree:
    """Greedy rounds on an EAGLE-2 tree (a chain is the tree of top-k 1): the longest drafted path whose
    tokens the target itself picks, plus the target's own next token."""

    def __init__(self, shape: TreeShape, states):
        self.shape, self.states = shape, states  # states: the method's contract.DecodeStates

    @property
    def forwards(self) -> int:
        return self.shape.depth

    def start(self, runner: TargetRunner, drafter):
        return runner.drafter_state(drafter, self.states, self.shape.depth + 1)

    def first_token(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def draft(self, state) -> Tree:
        return draft_tree(state, self.shape)

    def verify(self, runner: TargetRunner, root: int, draft: Tree, n: int) -> tuple[list[int], torch.Tensor]:
        if draft.is_chain:  # causal: the model's own mask
            logits, aux = runner.forward([root] + draft.tokens)
        else:
            logits, aux = runner.forward(
                [root] + draft.tokens, [n] + [n + dep for dep in draft.depths], draft.visible()
            )
        choice = logits.argmax(-1)  # the target's token after each fed row (0 = root)
        with host_read():
            return choice.tolist(), aux

    def accept(self, draft: Tree, choice: list[int]) -> tuple[list[int], list[int]]:
        children = defaultdict(dict)
        for i, (t, p) in enumerate(zip(draft.tokens, draft.parents)):
            children[p].setdefault(t, i)
        path, node = [], -1
        while choice[node + 1] in children[node]:
            node = children[node][choice[node + 1]]
            path.append(node)
        return path, [draft.tokens[i] for i in path] + [choice[node + 1]]


@dataclass
class SampledDraft:
    tokens: list[int]  # K target ids, each sampled from the drafter given the ones before
    probs: list[torch.Tensor]  # K draft distributions [V] they were sampled from


class SampledChain:
    """Sampled rounds: a chain of K tokens sampled from the drafter at `temperature`, accepted by exact
    rejection sampling, so the output is distributed as the target's own sampling."""

    def __init__(self, K: int, temperature: float, generator: torch.Generator, states):
        self.shape, self.states = TreeShape.chain(K), states  # states: the method's contract.DecodeStates
        self.temperature, self.generator = temperature, generator
        self.vocab = 0  # the target's, from the prefill: draft_probs spreads the draft vocab over it

    @property
    def forwards(self) -> int:
        return self.shape.depth

    def start(self, runner: TargetRunner, drafter):
        return runner.drafter_state(drafter, self.states, self.shape.depth + 1)

    def sample(self, probs: torch.Tensor) -> int:
        token = torch.multinomial(probs, 1, generator=self.generator)
        with host_read():
            return int(token)

    def first_token(self, logits: torch.Tensor) -> int:
        self.vocab = logits.shape[-1]
        return self.sample(torch.softmax(logits / self.temperature, -1))

    def draft(self, state) -> SampledDraft:
        K, drafter = self.shape.depth, state.drafter
        drafts, qs, diag = [], [], []
        hidden, d_logits = state.root_hidden, state.root_logits
        for depth in range(1, K + 1):
            qs.append(draft_probs(drafter, d_logits, self.temperature, self.vocab))
            drafts.append(self.sample(qs[-1]))
            if depth < K:
                ids = torch.tensor([[drafts[-1]]], device=d_logits.device)
                d_logits, hidden, kv = state.step(hidden, ids, depth, diag)
                d_logits, diag = d_logits[0, -1], diag + [kv]
        return SampledDraft(drafts, qs)

    def verify(self, runner: TargetRunner, root: int, draft: SampledDraft, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        logits, aux = runner.forward([root] + draft.tokens)
        return torch.softmax(logits / self.temperature, -1), aux  # p [K+1, V]

    def accept(self, draft: SampledDraft, p: torch.Tensor) -> tuple[list[int], list[int]]:
        a, nxt = rejection_sample(p, torch.stack(draft.probs), draft.tokens, self.generator)
        return list(range(a)), draft.tokens[:a] + [nxt]


@torch.inference_mode()
def decode(
    runner: TargetRunner, drafter, prompt: list[int], max_new: int, eos: int, policy: RoundPolicy, stats: Stats
) -> list[int]:
    """Speculative decoding of `prompt`, rounds drafted and accepted by `policy`; returns the generated ids.
    Each part of a round is timed by a RoundClock (the device synced around it, so the timings measure
    the work and not its launch)."""
    dev = runner.device
    runner.reserve(cache_tokens(len(prompt), max_new, policy.shape))
    runner.reset()
    logits, aux = runner.forward(prompt)
    out = [policy.first_token(logits[-1])]
    n = len(prompt)  # target cache length; out[-1] is x_n, not yet fed to the target
    state = policy.start(runner, drafter)
    state.advance(aux, prompt[1:] + out[-1:], 0)
    clock = RoundClock(dev, stats.seconds)
    with timing(clock):
        while out[-1] != eos and len(out) < max_new:
            t0 = time.perf_counter()
            with clock("draft"):
                draft = policy.draft(state)
            stats.draft_steps += policy.forwards
            with clock("verify"):
                verdict, aux = policy.verify(runner, out[-1], draft, n)
            with clock("host"):
                path, accepted = policy.accept(draft, verdict)
            stats.add(len(path))
            with clock("keep"):
                runner.keep(n + 1, [n + 1 + i for i in path])
            with clock("advance"):  # the advance is drafting work too
                state.advance(aux[[0] + [1 + i for i in path]], accepted, n)
            stats.round_seconds += time.perf_counter() - t0
            n += len(accepted)
            out += accepted
            if eos in accepted:
                break
    if eos in out:
        out = out[: out.index(eos) + 1]
    return out[:max_new]


@torch.inference_mode()
def draft_probs(drafter, logits: torch.Tensor, temperature: float, vocab: int) -> torch.Tensor:
    """The drafter's sampling distribution over the target vocabulary [V] (zero outside the draft vocab)."""
    q = torch.softmax(logits.float() / temperature, -1)
    return torch.zeros(vocab, device=q.device).index_add_(
        0, drafter.to_target_ids(torch.arange(q.shape[0], device=q.device)), q
    )


def rejection_sample(
    p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: torch.Generator
) -> tuple[int, int]:
    """Target probs p [K+1, V], draft probs q [K, V] the drafts were sampled from -> (accepted count a,
    the token after them): draft i is kept with probability min(1, p_i(x)/q_i(x)); the first rejected
    one is replaced by a sample of norm(max(0, p_i − q_i)); when all K are kept, the bonus is a sample
    of p_K. Each output token is then distributed as p (Leviathan et al. 2023, Appendix A.1)."""
    K = len(drafts)
    u = torch.rand(K, generator=generator, device=generator.device).tolist()
    a = 0
    while a < K and u[a] * float(q[a, drafts[a]]) < float(p[a, drafts[a]]):
        a += 1
    if a == K:
        return a, int(torch.multinomial(p[K], 1, generator=generator))
    residual = (p[a] - q[a]).clamp_min(0)
    return a, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def check_exact(spec: list[int], ref: list[int], gaps: list[float], tol: float, pid: str) -> dict:
    if spec == ref:
        return {"exact": True}
    j = next((i for i, (a, b) in enumerate(zip(spec, ref)) if a != b), min(len(spec), len(ref)))
    gap = gaps[j] if j < len(gaps) else float("inf")
    if gap < tol:
        return {"exact": False, "tie_at": j, "logit_gap": gap}
    raise ExactnessError(
        f"prompt {pid}: speculative output differs from greedy at token {j} "
        f"(logit gap {gap:.3g} >= {tol}): the decoder is wrong, not the numerics"
    )


def alpha_from_tau(tau: float, K: int) -> float:
    """The per-token acceptance α for which a K-token chain yields tau = (1 − α^(K+1)) / (1 − α)."""
    lo, hi = 0.0, 1.0
    for _ in range(ALPHA_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(K + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return lo


def leviathan_bound(alpha: float, K: int, c: float) -> float:
    """Expected walltime improvement S = (1 − α^(K+1)) / ((1 − α)(Kc + 1)) (Leviathan et al. 2023, Thm 3.8)."""
    return sum(alpha**i for i in range(K + 1)) / (K * c + 1)
