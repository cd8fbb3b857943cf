"""The EAGLE-3 drafter, top to bottom: config, norm, rotary, attention, layer, drafter.

One decoder layer that reads two things per position: the token's embedding and a hidden state,
each normed and concatenated ([B, T, 2H]) before attention. The hidden state is either the target's
aux layers projected by `fc` (first drafting step) or the drafter's own output from the previous
step (later steps). Attention works over two kinds of keys:

- base keys: a causal sequence of keys at positions 0..q_offset+j for query j (the step-0 keys,
  computed from target states), and
- diagonal keys: keys of earlier drafting steps at the query's own position.

That single rule covers training-time test (step i at position t sees step-0 keys <= t and the keys
of steps 1..i at t) and drafting at inference (the drafter's cache plus the chain drafted so far).

Training packs several documents into one row: the base keys are then limited to the query's own
document (`documents`, a [B, T] id per position), so packing is exact. The base part runs as one
attention call per row on CUDA (FlexAttention with a block-sparse document mask) and as one causal
product per document on the CPU, each returning its log-sum-exp; the diagonal keys are merged into it
exactly through that log-sum-exp, so no [T, steps*T] score matrix is ever formed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import nn

from specdraft.drafters.common import MLP, RMSNorm, apply_rotary, rotary, within_vocab


@dataclass
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (rows of the embedding)
    draft_vocab_size: int  # rows of lm_head; d2t maps them to target ids
    target_hidden_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    # vLLM's default in the flat format: the residual is the hidden state before hidden_norm.
    norm_before_residual: bool = False
    # Follow-ups, off by default (engines read these flags by these names): one RMSNorm over the
    # concatenated aux states before fc (`input_norm`), one RMSNorm per aux layer before fc
    # (`fc_norm.{i}`, EAGLE-3.1), and the normed output fed to the next step (EAGLE-3.1).
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    def check(self, where: str) -> DrafterConfig:
        """Refuse a config read from a file whose values are of the wrong kind or out of range, in one
        line naming `where`: sizes are whole numbers above 0, layer ids whole numbers >= 0, eps and theta
        finite and above 0, the norm flags true or false."""
        def fits(kind: str, v) -> bool:
            if kind == "int":
                return type(v) is int and v > 0
            if kind == "float":
                return type(v) in (int, float) and math.isfinite(v) and v > 0
            if kind == "bool":
                return type(v) is bool
            return isinstance(v, list) and bool(v) and all(type(i) is int and i >= 0 for i in v)

        for f in fields(self):
            if not fits(f.type, getattr(self, f.name)):
                raise ValueError(f"{where}: {f.name} = {getattr(self, f.name)!r} is not a valid {f.type}")
        return self

    @classmethod
    def from_target(cls, target, draft_vocab_size: int) -> DrafterConfig:
        c = target.text_config
        rope = getattr(c, "rope_parameters", None) or {}
        return cls(
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=target.drafter_head_dim,  # MLA targets: the value head width (targets.py)
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            draft_vocab_size=within_vocab(draft_vocab_size, c.vocab_size),
            target_hidden_size=c.hidden_size,
            aux_layer_ids=list(target.aux_layer_ids),
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)),
            max_position_embeddings=c.max_position_embeddings,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    def make_drafter(self) -> Eagle3Drafter:
        return Eagle3Drafter(self)


KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class DocumentSpans:
    """The CPU's document mask: each row's documents as [start, end) spans. Attention runs causally
    inside each span, so the scores take sum(length^2) per row rather than the T^2 of a dense mask over
    the packed row (8,192-token rows ran the CPU trainer past 21 GB that way)."""

    spans: tuple[tuple[tuple[int, int], ...], ...]


def document_mask(documents: torch.Tensor):
    """The base-key mask of packed training rows: causal, and inside the query's own document.

    documents [B, T] (an id per position, contiguous per document; padding gets its own id). On CUDA a
    FlexAttention BlockMask (blocks of other documents are skipped, not computed); elsewhere DocumentSpans.
    """
    B, T = documents.shape
    if documents.is_cuda:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document_causal(b, h, q, k):
            return (k <= q) & (documents[b, k] == documents[b, q])

        return create_block_mask(same_document_causal, B, None, T, T, device=documents.device)
    rows = []
    for row in documents.tolist():
        starts = [0] + [t for t in range(1, T) if row[t] != row[t - 1]]
        rows.append(tuple(zip(starts, starts[1:] + [T])))
    return DocumentSpans(tuple(rows))


_compiled_flex = None


def flex_attention(q, k, v, block_mask):
    """FlexAttention, compiled once (uncompiled it falls back to a dense reference)."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention as flex

        _compiled_flex = torch.compile(flex, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)


def dense_attention(q, k, v, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [B, nh, T, d] over k, v [B, nkv, Tb, d] under a bool mask broadcastable to
    [B, nkv, group, T, Tb] -> (out [B, nh, T, d], log-sum-exp [B, nh, T])."""
    B, nh, T, d = q.shape
    nkv = k.shape[1]
    qg = q.reshape(B, nkv, nh // nkv, T, d)  # [B, nkv, g, T, d]
    scores = (qg @ k[:, :, None].transpose(-1, -2)).float() * scale  # [B, nkv, g, T, Tb]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)  # [B, nkv, g, T]
    out = (scores - lse[..., None]).exp().to(q.dtype) @ v[:, :, None]  # [B, nkv, g, T, d]
    return out.reshape(B, nh, T, d), lse.reshape(B, nh, T)


def attend(q, base: KV, diag: list[KV], mask) -> torch.Tensor:
    """Exact softmax attention of q [B, nh, T, d] over the base keys [B, nkv, Tb, d] under `mask`
    (a dense bool mask broadcastable to [B, nkv, group, T, Tb], DocumentSpans, or a BlockMask) plus the diagonal
    keys, each [B, nkv, T, d] and seen only by the query at the same position. -> [B, nh, T, d]."""
    B, nh, T, d = q.shape
    nkv = base[0].shape[1]
    group = nh // nkv
    scale = 1.0 / math.sqrt(d)
    if isinstance(mask, DocumentSpans):
        # The base keys are the step-0 keys at the queries' own positions (Tb = T): each document's
        # queries see a causal prefix of its own keys.
        outs, lses = [], []
        for b, spans in enumerate(mask.spans):
            row = [dense_attention(q[b:b + 1, :, s:e], base[0][b:b + 1, :, s:e], base[1][b:b + 1, :, s:e],
                                   torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril(), scale)
                   for s, e in spans]
            outs.append(torch.cat([o for o, _ in row], dim=2))  # [1, nh, T, d]
            lses.append(torch.cat([lse for _, lse in row], dim=2))  # [1, nh, T]
        out, lse = torch.cat(outs), torch.cat(lses)
    elif isinstance(mask, torch.Tensor):
        out, lse = dense_attention(q, base[0], base[1], mask, scale)
    else:
        out, lse = flex_attention(q, base[0], base[1], mask)  # [B, nh, T, d], [B, nh, T]
    if not diag:
        return out
    dk = torch.stack([k for k, _ in diag], dim=-2).repeat_interleave(group, dim=1)  # [B, nh, T, n, d]
    dv = torch.stack([v for _, v in diag], dim=-2).repeat_interleave(group, dim=1)  # [B, nh, T, n, d]
    dscores = (q[..., None, :].float() * dk.float()).sum(-1) * scale  # [B, nh, T, n]
    # Merge: softmax over [base scores, diagonal scores] = weights exp(lse) and exp(dscores).
    top = torch.maximum(lse.float(), dscores.max(-1).values)  # [B, nh, T]
    w_base = (lse.float() - top).exp()  # [B, nh, T]
    w_diag = (dscores - top[..., None]).exp()  # [B, nh, T, n]
    total = w_base + w_diag.sum(-1)  # [B, nh, T]
    merged = w_base[..., None] * out.float() + (w_diag[..., None] * dv.float()).sum(-2)  # [B, nh, T, d]
    return (merged / total[..., None]).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = 2 * cfg.hidden_size  # [norm(embedding), norm(hidden)]
        self.q_proj = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, base: KV | None = None, diag: list[KV] | None = None, q_offset: int = 0,
                mask=None):
        """x [B, T, 2H]. With `diag` None this step's keys extend `base` causally (query j sees base
        keys 0..q_offset+j, q_offset = len(base) before extension); otherwise they join `diag` and the
        query sees base keys 0..q_offset+j plus every diagonal key at its own position. A `mask` from
        `document_mask` replaces the causal rule for the base keys (packed training rows)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, d]
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, nkv, T, d]
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, nkv, T, d]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if diag is None:
            if base is not None:
                q_offset = base[0].shape[2]
                base = (torch.cat([base[0], k], dim=2), torch.cat([base[1], v], dim=2))  # [B, nkv, Tb+T, d]
            else:
                base = (k, v)
            diag = []
        else:
            diag = diag + [(k, v)]
        if mask is None:
            Tb = base[0].shape[2]
            mask = torch.arange(Tb, device=x.device)[None, :] <= (
                q_offset + torch.arange(T, device=x.device)[:, None])  # [T, Tb]
        out = attend(q, base, diag, mask)  # [B, nh, T, d]
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # [B, T, nh*d]
        return self.o_proj(out), (k, v)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the hidden state
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, base=None, diag=None, q_offset=0, mask=None):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        attn, kv = self.self_attn(x, cos, sin, base, diag, q_offset, mask)
        hidden = residual + attn
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, kv


class Eagle3Drafter(nn.Module):
    METHOD = "eagle3"  # train.method; recorded in checkpoints (specdraft/methods/)

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        n_aux = len(cfg.aux_layer_ids)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(n_aux * cfg.target_hidden_size, cfg.rms_norm_eps)
        if cfg.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(n_aux)])
        self.fc = nn.Linear(n_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        # Copied from the target and frozen: the drafter reads tokens the way the target does.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # target id of draft id i is i + d2t[i]; t2d marks the target ids inside the draft vocab.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [B, T, n_aux*Ht] -> the first step's hidden input [B, T, H]."""
        # With both on, vLLM norms the whole first, then each aux layer's part: so do we.
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            parts = aux.chunk(len(self.fc_norm), dim=-1)  # n_aux x [B, T, Ht]
            aux = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts)], dim=-1)  # [B, T, n_aux*Ht]
        return self.fc(aux)

    def forward(self, hidden, input_ids, positions, base=None, diag=None, q_offset=0, mask=None):
        """One drafting step: logits over the draft vocab [B, T, Vd], the output state fed to the next
        step [B, T, H] (pre-norm, or normed with `norm_output`), and this step's keys/values."""
        cos, sin = rotary(positions, self.config.head_dim, self.config.rope_theta)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        hidden, kv = self.layers[0](embeds, hidden, cos, sin, base, diag, q_offset, mask)
        normed = self.norm(hidden)
        return self.lm_head(normed), normed if self.config.norm_output else hidden, kv

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
