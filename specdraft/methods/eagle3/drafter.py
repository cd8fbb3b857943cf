"""The EAGLE-3 drafter, top to bottom: config, drafter (its decoder layer, attention and document mask are
drafters/common.py's, shared with P-EAGLE).

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

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from specdraft.drafters.common import (  # noqa: F401 (the layer's parts, named here as before)
    KV,
    Attention,
    DecoderLayer,
    DocumentSpans,
    RMSNorm,
    attend,
    check_fields,
    dense_attention,
    document_mask,
    flex_attention,
    rotary,
    target_shape,
)


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
        """Refuse a config read from a file whose values are of the wrong kind or out of range."""
        check_fields(self, where)
        return self

    @classmethod
    def from_target(cls, target, draft_vocab_size: int) -> DrafterConfig:
        return cls(**target_shape(target, draft_vocab_size))

    def to_dict(self) -> dict:
        return asdict(self)

    def make_drafter(self) -> Eagle3Drafter:
        return Eagle3Drafter(self)


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
