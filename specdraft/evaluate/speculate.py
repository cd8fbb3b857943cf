"""eval: a reference speculative decoder (chain and EAGLE-2 dynamic tree; greedy and sampled), exact.

Each round the drafter proposes a tree of tokens from the target's aux states: the root is the last
accepted token; every depth expands the `tree_topk` best nodes so far (by cumulative draft log-prob)
into their `tree_topk` best children, for `tree_depth` depths, and the `tree_tokens` best nodes of all
drafted ones are verified by ONE target forward with a tree attention mask (each node sees the cache,
its ancestors and itself; its position is the cache length plus its depth). The longest path whose
tokens the target itself picks is kept, plus the target's own next token; the cache keeps only that
path. A chain of K tokens is the tree with top-k 1, depth K and K tokens, so both run the same code.

Greedy output is checked token for token against the target's plain greedy decoding with the same
engine; a divergence at a logit gap below `tie_tolerance` is reported as a numerical tie (FACTS.md:
greedy exactness needs identical numerics), any other one is an error. Sampled decoding (temperature
> 0) drafts a chain by sampling and accepts with exact rejection sampling (Leviathan et al. 2023), so
its output distribution is the target's.

Figures: tau (tokens per target forward), the histogram of accepted lengths, per-position acceptance
(share of rounds whose draft at depth i was accepted, as vLLM counts it), decode speed with and
without speculation, the draft/target cost ratio c, and Leviathan's bound for the measured α and c.

Engines (make_runner): the eager one here (transformers' DynamicCache and masks), and engine.py's
static KV caches with CUDA graphs on the GPU. Both decode with the same functions below; greedy and
speculative decoding of one evaluation always share one engine.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import Recipe
from ..data.generate import select_prompts
from ..run import Run, atomic_path, write_json, write_text
from ..targets import Target, get_attr, resolve_device, tap_hidden_states
from ..train import load_trained

EVAL_DIR = "eval"
ENGINES = ("auto", "eager", "static", "cuda-graphs")
# Bisection steps to invert tau(α) = (1 − α^(K+1)) / (1 − α): 60 halvings reach float precision.
ALPHA_BISECTION_STEPS = 60


class ExactnessError(AssertionError):
    """Speculative output differs from the target's greedy output beyond a numerical tie."""


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TargetRunner:
    """The target with a KV cache, returning logits and aux states for the tokens it is fed: the eager
    engine (transformers' DynamicCache and its own masks). engine.StaticTargetRunner is the fast one."""

    engine = "eager"

    def __init__(self, target: Target, model):
        self.target, self.model = target, model
        self.base = get_attr(model, target.family.decoder)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = None

    def reserve(self, tokens: int):
        """The dynamic cache grows as it goes: nothing to reserve."""

    def drafter_state(self, drafter, max_accepted: int) -> DrafterState:
        return DrafterState(drafter)

    def reset(self):
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, ids: list[int], positions: list[int] | None = None,
                visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n, V] and aux states [n, n_aux*H] for `ids` appended to the cache. `visible` [n, n]
        says which of the new tokens each new token sees; None (a chain, or plain decoding) is causal and
        goes the model's own way, which also knows sliding windows and attention sinks (gpt-oss) that a
        custom 4-D mask bypasses. `positions` go with `visible`."""
        x = torch.tensor([ids], device=self.device)
        kwargs = {}
        if visible is not None:
            past = self.length
            allowed = torch.cat([torch.ones(len(ids), past, dtype=torch.bool, device=self.device),
                                 visible.to(self.device)], dim=1)  # [n, past+n]
            # A 4-D additive mask is used as given by transformers (eager and sdpa alike).
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill(~allowed, torch.finfo(self.dtype).min)[None, None]  # [1, 1, n, past+n]
            kwargs = {"attention_mask": mask, "position_ids": torch.tensor([positions], device=self.device)}
        with tap_hidden_states(self.model, self.target.family, self.target.aux_layer_ids) as cap:
            out = self.base(input_ids=x, past_key_values=self.cache, use_cache=True, **kwargs)
        logits = self.model.lm_head(out.last_hidden_state)[0].float()
        aux = torch.cat([cap[k] for k in self.target.aux_layer_ids], dim=-1)[0]
        return logits, aux

    def keep(self, length: int, extra: list[int]):
        """Keep cache positions [0, length) followed by the positions `extra` (the accepted tree path)."""
        idx = torch.cat([torch.arange(length), torch.tensor(extra, dtype=torch.long)]).to(self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, idx)
            layer.values = layer.values.index_select(-2, idx)


def make_runner(target: Target, model, engine: str):
    """The engine named by EvalConfig.engine: "eager", "static" (preallocated caches, eager kernels),
    "cuda-graphs" (static, with decode steps replayed as CUDA graphs), or "auto": cuda-graphs on CUDA,
    eager elsewhere (on the CPU there are no graphs and attending over the whole static capacity costs
    more than it saves). Sliding-window targets (gpt-oss) stay eager: their windows live in the model's
    own masks, which the static engine replaces with one full-attention mask."""
    from .engine import StaticTargetRunner

    if engine not in ENGINES:
        raise ValueError(f"eval.engine {engine!r}: expected one of {ENGINES}")
    on_cuda = next(model.parameters()).device.type == "cuda"
    sliding = "sliding" in target.family.attention
    if engine == "auto":
        engine = "cuda-graphs" if on_cuda and not sliding else "eager"
        if on_cuda and sliding:
            print(f"eval: {target.family.attention} attention: the eager engine (no static cache, no CUDA graphs)")
    if engine != "eager" and sliding:
        raise ValueError(f"eval.engine {engine!r}: {target.family.attention} attention needs the eager engine")
    if engine == "cuda-graphs" and not on_cuda:
        raise ValueError("eval.engine 'cuda-graphs' needs the model on a CUDA device")
    if engine == "eager":
        return TargetRunner(target, model)
    return StaticTargetRunner(target, model, graphs=engine == "cuda-graphs")


def cache_tokens(prompt_len: int, max_new: int, shape: TreeShape) -> int:
    """Cache slots a decode of `prompt_len` + `max_new` tokens may write: a verification writes the
    tree's tokens past the last accepted one, and the drafter's padded step-0 rows (at most depth + 1)
    past it too; twice the tree covers both."""
    return prompt_len + max_new + 2 * (shape.tokens + 1)


def decode_capacity(prompts: list[dict], cfg) -> int:
    """Cache slots enough for evaluating every prompt with `cfg` (chain and tree)."""
    shapes = (TreeShape.chain(cfg.draft_tokens), TreeShape(cfg.tree_topk, cfg.tree_depth, cfg.tree_tokens))
    return max(cache_tokens(len(p["prompt_ids"]), cfg.max_new_tokens, s) for p in prompts for s in shapes)


@dataclass
class TreeShape:
    """EAGLE-2 dynamic tree: expand `topk` nodes per depth, `depth` depths, verify the best `tokens`."""
    topk: int
    depth: int
    tokens: int

    @classmethod
    def chain(cls, K: int) -> TreeShape:
        return cls(topk=1, depth=K, tokens=K)


@dataclass
class Tree:
    tokens: list[int]  # target ids, one per node
    parents: list[int]  # index of the parent node; -1 = the root (the last accepted token)
    depths: list[int]  # 1 for the root's children

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def visible(self) -> torch.Tensor:
        """[1+N, 1+N] bool: row r (0 = root, 1+i = node i) sees the root, its ancestors and itself."""
        parent = torch.tensor([0] + [p + 1 for p in self.parents])  # [1+N] each row's parent row (root: itself)
        vis = torch.eye(len(parent), dtype=torch.bool)
        for _ in range(max(self.depths, default=0)):  # each pass adds one generation of ancestors (a few
            vis |= vis[parent]  # tensor ops per depth instead of a row copy per node: it runs every round)
        return vis


@dataclass
class Stats:
    K: int  # the deepest draft position
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


class DrafterState:
    """The drafter's own cache of step-0 keys (one per target position) and its root for the next round."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.cache = None
        self.root_hidden = self.root_logits = None
        self.root_position = -1

    @torch.inference_mode()
    def advance(self, aux: torch.Tensor, next_tokens: list[int], first_position: int):
        """Step 0 over newly accepted positions: position t reads (target aux h_t, token x_{t+1})."""
        d = self.drafter
        positions = torch.arange(first_position, first_position + len(next_tokens), device=aux.device)[None]
        tokens = torch.tensor([next_tokens], device=aux.device)
        logits, h, kv = d(d.project(aux.to(d.fc.weight.dtype))[None], tokens, positions, base=self.cache)
        self.cache = kv if self.cache is None else (torch.cat([self.cache[0], kv[0]], 2),
                                                    torch.cat([self.cache[1], kv[1]], 2))
        self.root_hidden, self.root_logits = h[:, -1:], logits[0, -1]  # [1, 1, H], [Vd]
        self.root_position = first_position + len(next_tokens) - 1

    @torch.inference_mode()
    def step(self, hidden, tokens: torch.Tensor, depth: int, diag: list):
        """One drafting step for sibling nodes at `depth`: each of `tokens` [1, F] reads its parent's output
        state `hidden` [1, F, H] and sees the whole step-0 cache plus its ancestors' keys (`diag`) and its own."""
        positions = torch.full(tokens.shape, self.root_position + depth, device=hidden.device)  # [1, F]
        return self.drafter(hidden, tokens, positions, base=self.cache, diag=diag, q_offset=self.cache[0].shape[2] - 1)

    def draft(self, shape: TreeShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every node of this round's dynamic tree (grow_tree)."""
        return grow_tree(self.drafter, self.step, self.root_hidden, self.root_logits, shape)


def grow_tree(drafter, step, root_hidden: torch.Tensor, root_logits: torch.Tensor, shape: TreeShape
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device half of EAGLE-2 drafting, with no host sync, so one CUDA graph can hold it: the root's
    `topk` best children form the frontier; at every further depth each frontier node gets its `topk`
    best children (by cumulative draft log-prob), and the `topk` best of those form the next frontier.
    `step` is the state's drafting step. -> scores, target ids and parents [N] of every drafted node in
    creation order: the root's children, then each depth's topk*topk children row by row (-1 = root)."""
    k = shape.topk
    top = torch.log_softmax(root_logits.float(), -1).topk(k)  # [k]
    ids = drafter.to_target_ids(top.indices)  # [k]
    scores, tokens, parents = [top.values], [ids], [torch.full_like(ids, -1)]
    frontier = torch.arange(k, device=ids.device)  # [k] node index of each frontier node
    front_scores, front_ids = top.values, ids
    hidden = root_hidden.expand(1, k, -1)  # [1, k, H]
    diag: list = []
    for depth in range(1, shape.depth):
        logits, h, kv = step(hidden, front_ids[None], depth, diag)
        cum = front_scores[:, None] + torch.log_softmax(logits[0].float(), -1)  # [k, Vd]
        child = cum.topk(k, dim=-1)  # each frontier node's best children: [k, k]
        first = k + (depth - 1) * k * k  # node index of this depth's first child
        scores.append(child.values.flatten())  # [k*k]
        tokens.append(drafter.to_target_ids(child.indices).flatten())  # [k*k]
        parents.append(frontier[:, None].expand(k, k).flatten())  # [k*k]
        best = scores[-1].topk(k)  # the next frontier among them
        rows = best.indices // k  # [k] the frontier row each chosen child came from
        frontier, front_scores, front_ids = first + best.indices, best.values, tokens[-1][best.indices]
        hidden = h[:, rows]  # [1, k, H]: each chosen child's parent output
        diag = [(dk[:, :, rows], dv[:, :, rows]) for dk, dv in diag + [kv]]  # ancestors' keys per chosen child
    return torch.cat(scores), torch.cat(tokens), torch.cat(parents)


@torch.inference_mode()
def draft_tree(state: DrafterState, shape: TreeShape) -> Tree:
    scores, tokens, parents = (t.tolist() for t in state.draft(shape))
    k = shape.topk
    depths = [1] * k + [depth for depth in range(2, shape.depth + 1) for _ in range(k * k)]
    # The best `tokens` nodes; a child never outscores its parent (log-probs add), and on an exact tie
    # the shallower node comes first, so every kept node's parent is kept too.
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[: shape.tokens]
    order.sort(key=lambda i: (depths[i], i))
    new_index = {old: j for j, old in enumerate(order)}
    return Tree(tokens=[tokens[i] for i in order],
                parents=[new_index[parents[i]] if parents[i] >= 0 else -1 for i in order],
                depths=[depths[i] for i in order])


@torch.inference_mode()
def speculative(runner: TargetRunner, drafter, prompt: list[int], max_new: int, eos: int, shape: TreeShape,
                stats: Stats) -> list[int]:
    """Greedy speculative decoding with tree (or chain) drafts; returns the generated ids."""
    dev = runner.device
    runner.reserve(cache_tokens(len(prompt), max_new, shape))
    runner.reset()
    logits, aux = runner.forward(prompt)
    out = [int(logits[-1].argmax())]
    n = len(prompt)  # target cache length; out[-1] is x_n, not yet fed to the target
    state = runner.drafter_state(drafter, shape.depth + 1)
    state.advance(aux, prompt[1:] + out[-1:], 0)
    while out[-1] != eos and len(out) < max_new:
        sync(dev)
        t0 = time.perf_counter()
        tree = draft_tree(state, shape)
        sync(dev)
        stats.draft_seconds += time.perf_counter() - t0
        stats.draft_steps += shape.depth
        t0 = time.perf_counter()
        if tree.is_chain:  # causal: the model's own mask
            logits, aux = runner.forward([out[-1]] + tree.tokens)
        else:
            logits, aux = runner.forward([out[-1]] + tree.tokens, [n] + [n + dep for dep in tree.depths],
                                         tree.visible())
        choice = logits.argmax(-1).tolist()  # the target's token after each fed row (0 = root)
        sync(dev)
        stats.verify_seconds += time.perf_counter() - t0
        children = defaultdict(dict)
        for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
            children[p].setdefault(t, i)
        path, node = [], -1
        while choice[node + 1] in children[node]:
            node = children[node][choice[node + 1]]
            path.append(node)
        stats.add(len(path))
        accepted = [tree.tokens[i] for i in path] + [choice[node + 1]]
        runner.keep(n + 1, [n + 1 + i for i in path])
        t0 = time.perf_counter()
        state.advance(aux[[0] + [1 + i for i in path]], accepted, n)
        sync(dev)
        stats.draft_seconds += time.perf_counter() - t0  # step 0 is a drafting step too
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
    return torch.zeros(vocab, device=q.device).index_add_(0, drafter.to_target_ids(
        torch.arange(q.shape[0], device=q.device)), q)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: torch.Generator
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


@torch.inference_mode()
def speculative_sampled(runner: TargetRunner, drafter, prompt: list[int], max_new: int, eos: int, K: int,
                        temperature: float, stats: Stats, generator: torch.Generator) -> list[int]:
    """Chain drafting by sampling, exact rejection sampling: token i of the draft is kept with probability
    min(1, p(x)/q(x)); the first rejected one is replaced by a sample of norm(max(0, p − q)); when all K
    are kept a bonus token is sampled from p. The output is distributed as the target's own sampling."""
    dev = runner.device

    def sample(probs):
        return int(torch.multinomial(probs, 1, generator=generator))

    runner.reserve(cache_tokens(len(prompt), max_new, TreeShape.chain(K)))
    runner.reset()
    logits, aux = runner.forward(prompt)
    V = logits.shape[-1]
    out = [sample(torch.softmax(logits[-1] / temperature, -1))]
    n = len(prompt)
    state = runner.drafter_state(drafter, K + 1)
    state.advance(aux, prompt[1:] + out[-1:], 0)
    while out[-1] != eos and len(out) < max_new:
        sync(dev)
        t0 = time.perf_counter()
        drafts, qs, diag = [], [], []
        hidden, d_logits = state.root_hidden, state.root_logits
        for depth in range(1, K + 1):
            qs.append(draft_probs(drafter, d_logits, temperature, V))
            drafts.append(sample(qs[-1]))
            if depth < K:
                d_logits, hidden, kv = state.step(hidden, torch.tensor([[drafts[-1]]], device=dev), depth, diag)
                d_logits, diag = d_logits[0, -1], diag + [kv]
        sync(dev)
        stats.draft_seconds += time.perf_counter() - t0
        stats.draft_steps += K
        t0 = time.perf_counter()
        logits, aux = runner.forward([out[-1]] + drafts)
        p = torch.softmax(logits / temperature, -1)  # [K+1, V]
        sync(dev)
        stats.verify_seconds += time.perf_counter() - t0
        a, nxt = rejection_sample(p, torch.stack(qs), drafts, generator)
        stats.add(a)
        accepted = drafts[:a] + [nxt]
        runner.keep(n + 1 + a, [])
        t0 = time.perf_counter()
        state.advance(aux[: a + 1], accepted, n)
        sync(dev)
        stats.draft_seconds += time.perf_counter() - t0
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


def alpha_from_tau(tau: float, K: int) -> float:
    """The per-token acceptance α for which a K-token chain yields tau = (1 − α^(K+1)) / (1 − α)."""
    lo, hi = 0.0, 1.0
    for _ in range(ALPHA_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(K + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return lo


def leviathan_bound(alpha: float, K: int, c: float) -> float:
    """Expected walltime improvement S = (1 − α^(K+1)) / ((1 − α)(Kc + 1)) (Leviathan et al. 2023, Thm 3.8)."""
    return sum(alpha ** i for i in range(K + 1)) / (K * c + 1)


def load_prompts(recipe: Recipe, target: Target) -> list[dict]:
    """The held-out split of the run's data, or `eval.prompts_file`: JSONL with a `prompt` string or
    `messages`, optional `id` and the category field."""
    cfg = recipe.eval
    if not cfg.prompts_file:
        prompts, _ = select_prompts(recipe, target, "eval", cfg.num_prompts)
        return prompts
    chosen = []
    path = Path(cfg.prompts_file)
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not (isinstance(rec.get("prompt"), str) or
                                                 isinstance(rec.get("messages"), list)):
                raise ValueError(f"{path}:{lineno}: expected an object with a 'prompt' string or 'messages' list")
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
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def evaluate(runner: TargetRunner, drafter, prompts: list[dict], cfg, eos: int) -> dict:
    """Greedy AR, chain and tree decoding of every prompt with the same engine: exactness and figures."""
    from tqdm import tqdm

    chain, tree = TreeShape.chain(cfg.draft_tokens), TreeShape(cfg.tree_topk, cfg.tree_depth, cfg.tree_tokens)
    if "sliding" in runner.target.family.attention and tree.topk > 1:
        # A tree's 4-D mask replaces the model's own, which is where sliding windows and attention
        # sinks live (gpt-oss): verified that way the tree is not exact. Such targets are measured with
        # chains (a chain's mask is the model's causal one).
        print(f"eval: {runner.target.family.attention} attention: tree drafting measured as a chain of {tree.depth}")
        tree = TreeShape.chain(tree.depth)
    stats = {"chain": Stats(chain.depth), "tree": Stats(tree.depth)}
    seconds = {"ar": 0.0, "chain": 0.0, "tree": 0.0}
    tokens = {"ar": 0, "chain": 0, "tree": 0}
    ties = {"chain": 0, "tree": 0}
    per_prompt = []
    by_category = defaultdict(lambda: {"prompts": 0, "chain": Stats(chain.depth), "tree": Stats(tree.depth)})
    # Sized once for every prompt: a static cache that grew mid-run would recapture its graphs in the timing.
    runner.reserve(decode_capacity(prompts, cfg))
    for p in tqdm(prompts, desc="eval", unit="prompt"):
        sync(runner.device)
        t0 = time.perf_counter()
        ref, gaps = greedy(runner, p["prompt_ids"], cfg.max_new_tokens, eos)
        sync(runner.device)
        took = {"ar": time.perf_counter() - t0}
        seconds["ar"] += took["ar"]
        tokens["ar"] += len(ref)
        row = {"id": p["id"], "tokens": len(ref)}
        cat = by_category[p.get("category", "all")]
        cat["prompts"] += 1
        for name, shape in (("chain", chain), ("tree", tree)):
            rounds_before, hist_before = stats[name].rounds, list(stats[name].accepted_hist)
            t0 = time.perf_counter()
            spec = speculative(runner, drafter, p["prompt_ids"], cfg.max_new_tokens, eos, shape, stats[name])
            sync(runner.device)
            took[name] = time.perf_counter() - t0
            seconds[name] += took[name]
            tokens[name] += len(spec)
            check = check_exact(spec, ref, gaps, cfg.tie_tolerance, p["id"])
            ties[name] += not check["exact"]
            row[name] = {"rounds": stats[name].rounds - rounds_before, **check}
            for a, (after, before) in enumerate(zip(stats[name].accepted_hist, hist_before)):
                for _ in range(after - before):
                    cat[name].add(a)
        row["seconds"] = {k: round(v, 4) for k, v in took.items()}
        per_prompt.append(row)
    ar_tps = tokens["ar"] / seconds["ar"]
    ar_step = seconds["ar"] / max(1, tokens["ar"])  # one target forward of one token (prefill amortised)
    # The engine as it ran: a CUDA graph capture that failed mid-run shows here.
    report = {"prompts": len(prompts), "engine": runner.engine, "autoregressive_tokens_per_s": round(ar_tps, 2),
              "seconds_per_prompt": {k: round(v / len(prompts), 4) for k, v in seconds.items()}}
    for name, shape in (("chain", chain), ("tree", tree)):
        s = stats[name]
        c = s.draft_seconds / max(1, s.draft_steps) / ar_step
        tps = tokens[name] / seconds[name]
        K = shape.depth
        alpha = alpha_from_tau(s.tau, K)
        report[name] = {
            **s.summary(), "shape": vars(shape), "exact_prompts": len(prompts) - ties[name],
            "numerical_ties": ties[name], "speculative_tokens_per_s": round(tps, 2),
            "speedup": round(tps / ar_tps, 3), "draft_to_target_cost": round(c, 4),
            "alpha": round(alpha, 4), "leviathan_bound": round(leviathan_bound(alpha, K, c), 3),
        }
    if len(by_category) > 1 or "all" not in by_category:
        report["per_category"] = {k: {"prompts": v["prompts"], "tau_chain": round(v["chain"].tau, 4),
                                      "tau_tree": round(v["tree"].tau, 4),
                                      "per_position_acceptance_chain": v["chain"].summary()["per_position_acceptance"]}
                                  for k, v in sorted(by_category.items())}
    report["per_prompt"] = per_prompt
    return report


def sampled_tau(runner, drafter, prompts, cfg, eos, seed: int) -> dict:
    stats = Stats(cfg.draft_tokens)
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    for p in prompts:
        speculative_sampled(runner, drafter, p["prompt_ids"], cfg.max_new_tokens, eos, cfg.draft_tokens,
                            cfg.temperature, stats, gen)
    return {"temperature": cfg.temperature, **stats.summary()}


def run(recipe: Recipe, run: Run) -> dict:
    from .. import environment

    cfg = recipe.eval
    t_start = time.time()
    device = torch.device(resolve_device(cfg.device))
    drafter, target, _ = load_trained(recipe, run)
    drafter = drafter.to(device=device, dtype=getattr(torch, cfg.dtype))
    runner = make_runner(target, target.load_model(cfg.dtype, device=str(device)), cfg.engine)
    prompts = load_prompts(recipe, target)
    report = evaluate(runner, drafter, prompts, cfg, target.eos_token_id)
    # Top-level figures are the chain's: what vLLM's num_speculative_tokens = K serves.
    report = {"prompts": report["prompts"], "draft_tokens": cfg.draft_tokens,
              **{k: v for k, v in report["chain"].items() if k != "shape"},
              "autoregressive_tokens_per_s": report["autoregressive_tokens_per_s"],
              **{k: v for k, v in report.items() if k not in ("prompts", "autoregressive_tokens_per_s")}}
    if cfg.temperature > 0:
        report["sampled"] = sampled_tau(runner, drafter, prompts, cfg, target.eos_token_id, recipe.train.seed)
    report.update({"dtype": cfg.dtype, "device": str(device), "hardware": environment.hardware_line()})
    out = run.path / EVAL_DIR
    write_json(out / "report.json", report)
    plot_histogram({"chain": report["chain"]["accepted_length_histogram"],
                    "tree": report["tree"]["accepted_length_histogram"]}, out / "accepted_lengths.png")
    write_text(out / "report.md", render_markdown(report))
    metrics = {k: report[k] for k in ("tau", "per_position_acceptance", "speedup", "autoregressive_tokens_per_s",
                                      "speculative_tokens_per_s", "draft_to_target_cost", "leviathan_bound")}
    metrics["tau_tree"] = report["tree"]["tau"]
    print(f"eval: tau chain {report['tau']:.3f}, tree {report['tree']['tau']:.3f}; report {out / 'report.md'}")
    print(f"next: measure the served drafter: specdraft bench --run {run.path} --endpoint URL")
    return run.record("eval", state="done", config=cfg, metrics=metrics,
                      counts={"prompts": len(prompts), "exact": report["exact_prompts"],
                              "ties": report["numerical_ties"]},
                      seconds=time.time() - t_start)


def render_markdown(r: dict) -> str:
    lines = [
        "# Drafter evaluation (reference decoder, greedy, exact)",
        "",
        f"- prompts: {r['prompts']}; dtype {r['dtype']}; device {r['device']}; hardware: {r['hardware']}",
        f"- engine: {r['engine']}; autoregressive decode (same engine): {r['autoregressive_tokens_per_s']} tok/s",
        "",
        "| drafting | shape | tau | per-position acceptance | exact / ties | tok/s | speedup | c | α | bound |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("chain", "tree"):
        s = r[name]
        shape = s["shape"]
        pos = " / ".join(f"{a:.2f}" for a in s["per_position_acceptance"])
        lines.append(f"| {name} | top-k {shape['topk']}, depth {shape['depth']}, {shape['tokens']} tokens | "
                     f"**{s['tau']:.3f}** | {pos} | {s['exact_prompts']} / {s['numerical_ties']} | "
                     f"{s['speculative_tokens_per_s']} | {s['speedup']}x | {s['draft_to_target_cost']} | "
                     f"{s['alpha']} | {s['leviathan_bound']}x |")
    lines += ["", "Accepted-length histograms (0..depth): "
              f"chain {r['chain']['accepted_length_histogram']}, tree {r['tree']['accepted_length_histogram']}.",
              "The bound is Leviathan et al.'s S = (1 − α^(γ+1)) / ((1 − α)(γc + 1)) with γ = depth, α from tau, "
              "c = one drafting step / one autoregressive target step."]
    if "sampled" in r:
        s = r["sampled"]
        lines.append(f"\nSampled chain (temperature {s['temperature']}, exact rejection sampling): tau {s['tau']:.3f}, "
                     f"per-position acceptance {' / '.join(f'{a:.2f}' for a in s['per_position_acceptance'])}")
    if "per_category" in r:
        lines += ["", "| category | prompts | tau chain | tau tree |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['prompts']} | {v['tau_chain']} | {v['tau_tree']} |" for k, v in r["per_category"].items()]
    lines += ["", "![accepted lengths](accepted_lengths.png)", ""]
    return "\n".join(lines)
