"""EAGLE-2 dynamic draft trees: their shape, the device half of growing one (no host sync, so one
CUDA graph can hold it) and the host half that keeps the best nodes. A chain of K tokens is the tree
with top-k 1, depth K and K tokens, so chains and trees run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.decoding.clock import host_read


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

    @classmethod
    def chain(cls, tokens: list[int]) -> Tree:
        """Tokens drafted one after the other: each node the child of the one before."""
        return cls(
            tokens=list(tokens), parents=list(range(-1, len(tokens) - 1)), depths=list(range(1, len(tokens) + 1))
        )

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


def grow_tree(
    drafter, step, root_hidden: torch.Tensor, root_logits: torch.Tensor, shape: TreeShape
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
def draft_tree(state, shape: TreeShape) -> Tree:
    """The round's tree from a drafter state that grows one (state.draft(shape))."""
    drafted = state.draft(shape)
    with host_read():  # the read and the host's selection of the tree's best nodes
        return select_tree(*(t.tolist() for t in drafted), shape)


def select_tree(scores: list[float], tokens: list[int], parents: list[int], shape: TreeShape) -> Tree:
    """grow_tree's nodes (creation order) -> the best `shape.tokens` of them as a Tree."""
    k = shape.topk
    depths = [1] * k + [depth for depth in range(2, shape.depth + 1) for _ in range(k * k)]
    # The best `tokens` nodes; a child never outscores its parent (log-probs add), and on an exact tie
    # the shallower node comes first, so every kept node's parent is kept too.
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[: shape.tokens]
    order.sort(key=lambda i: (depths[i], i))
    new_index = {old: j for j, old in enumerate(order)}
    return Tree(
        tokens=[tokens[i] for i in order],
        parents=[new_index[parents[i]] if parents[i] >= 0 else -1 for i in order],
        depths=[depths[i] for i in order],
    )
