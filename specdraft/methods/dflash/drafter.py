"""The DFlash drafter (block diffusion drafting, arXiv 2602.06036), top to bottom: config, context,
attention, layer, drafter.

A drafter of a few Qwen3-style decoder layers that drafts a whole block in one forward pass. The
block's first slot holds the last token the target produced (the "anchor" or bonus token, whose
hidden state the target has not computed yet); the other block_size - 1 slots hold the mask token.
Slot j sits at position anchor + j and predicts the token *at* that position (no shift): the
drafted tokens are read off slots 1 .. block_size - 1.

What it knows of the context comes from the target alone: the target's aux states at every earlier
position, concatenated and projected by `fc`, then normed (`hidden_norm`), give one context feature
per position. Every layer projects those features with its own k/v projections into keys and values
of the context (the paper's "KV injection"), so the context costs no query and no MLP.

Attention in every layer: a block's queries see the context keys before the anchor (of the same
document, in packed training rows) and every key of their own block, in both directions (the block
is not causal). Nothing else: not another block, not the anchor's own context position.

Rotary positions: context keys at their own positions, block slot j at anchor + j (NeoX layout, the
drafter's own theta). Queries and keys are RMS-normed per head before rotation (Qwen3's q_norm,
k_norm), the context keys too.

The token embedding and, unless a smaller draft vocabulary is chosen, the lm_head are the target's,
frozen: the mask slots' input is the target's embedding row of `mask_token_id`, exactly what vLLM
feeds them (docs/dflash.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from specdraft.drafters.common import MLP, RMSNorm, apply_rotary, default_mask_token, rotary, target_shape  # noqa: F401

# The block size the paper and the published drafters use (15 drafted tokens per round).
DEFAULT_BLOCK_SIZE = 16


@dataclass
class DFlashConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int  # the drafter's decoder layers (the published drafters have 5)
    vocab_size: int  # the target's vocabulary (rows of the shared embedding)
    draft_vocab_size: int  # rows of lm_head: == vocab_size means the target's own lm_head, shared
    target_hidden_size: int
    mask_token_id: int  # the token whose (target) embedding fills the mask slots
    block_size: int = DEFAULT_BLOCK_SIZE  # anchor + (block_size - 1) drafted tokens
    # Our convention (targets.py): id k is the residual stream after k target layers.
    aux_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    @classmethod
    def from_target(
        cls,
        target,
        *,
        mask_token_id: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_layers: int = 1,
        draft_vocab_size: int | None = None,
    ) -> DFlashConfig:
        """A drafter as wide as the target (so it shares its embedding and lm_head), reading the
        target's aux layers."""
        shape = target_shape(target, draft_vocab_size or 0)
        return cls(**shape, num_layers=num_layers, mask_token_id=mask_token_id, block_size=block_size)

    @property
    def shares_lm_head(self) -> bool:
        """The target's lm_head drafts over the whole vocabulary; a smaller draft vocabulary has its own."""
        return self.draft_vocab_size == self.vocab_size

    @property
    def speculative_tokens(self) -> int:
        """Tokens drafted per round: every slot but the anchor (vLLM's num_speculative_tokens)."""
        return self.block_size - 1

    def to_dict(self) -> dict:
        return asdict(self)

    def make_drafter(self) -> DFlashDrafter:
        return DFlashDrafter(self)


KV = tuple[torch.Tensor, torch.Tensor]


def attend(q: torch.Tensor, context: KV, block: KV, visible: torch.Tensor | None, block_size: int) -> torch.Tensor:
    """Exact softmax attention of a row of blocks over the context and their own block.

    q [B, nh, Q, d] with Q = N * block_size (N blocks, each block_size consecutive queries); context
    keys / values [B, nkv, T, d] under `visible` [B, Q, T] (bool: which context positions each query
    sees; None: all of them); block keys / values [B, nkv, Q, d], of which each query sees its own
    block's, all of them. One softmax over both key sets, through torch's fused attention (on CUDA its
    memory-efficient kernel never holds the [Q, T + Q] scores: with 512 blocks of 16 over an 8,192-token
    row they would be ~2.4 GB per layer in float32). Every query sees at least its own block, so no row
    is all masked. -> [B, nh, Q, d]."""
    B, nh, Q, _ = q.shape
    g = nh // context[0].shape[1]
    keys = torch.cat([context[0], block[0]], dim=2).repeat_interleave(g, dim=1)  # [B, nh, T+Q, d]
    values = torch.cat([context[1], block[1]], dim=2).repeat_interleave(g, dim=1)  # [B, nh, T+Q, d]
    mask = None  # one block that sees the whole context: every key, no mask (the fastest kernels)
    if visible is not None or Q > block_size:
        if visible is None:
            visible = torch.ones(B, Q, context[0].shape[2], dtype=torch.bool, device=q.device)
        blocks = torch.arange(Q, device=q.device) // block_size
        own = (blocks[:, None] == blocks[None]).expand(B, Q, Q)  # [B, Q, Q]
        mask = torch.cat([visible, own], dim=-1)[:, None]  # [B, 1, Q, T+Q]
    return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta, self.block_size = cfg.rope_theta, cfg.block_size
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # per head, before rotation
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> KV:
        """Rotated, normed keys and values of x [B, T, H] at positions [B, T] -> 2 x [B, nkv, T, d]."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)  # [B, nkv, T, d]
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, nkv, T, d]
        cos, sin = rotary(positions, self.head_dim, self.theta)  # [B, 1, T, d]
        return apply_rotary(k, cos, sin), v

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, context: KV, visible: torch.Tensor | None
    ) -> torch.Tensor:
        """x [B, Q, H] (the blocks' normed states) at positions [B, Q]; context keys/values of this
        layer, 2 x [B, nkv, T, d]; visible [B, Q, T] (None: all of the context). -> [B, Q, H]."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.n_heads, self.head_dim)).transpose(1, 2)  # [B, nh, Q, d]
        cos, sin = rotary(positions, self.head_dim, self.theta)  # [B, 1, Q, d]
        q = apply_rotary(q, cos, sin)
        block = self.keys_values(x, positions)  # 2 x [B, nkv, Q, d]
        out = attend(q, context, block, visible, self.block_size)  # [B, nh, Q, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.n_heads * self.head_dim))  # [B, Q, H]


class DecoderLayer(nn.Module):
    """A pre-norm Qwen3 layer whose attention also reads the context's keys and values."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden, positions, context: KV, visible):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, context, visible)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(nn.Module):
    METHOD = "dflash"  # train.method; recorded in checkpoints (specdraft/methods/)

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on fc's output: the context feature
        # Copied from the target and frozen: the blocks' tokens, the mask slots included, are read the
        # way the target reads them (vLLM feeds the target's embedding row of mask_token_id).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if cfg.shares_lm_head:  # the target's, frozen (not exported: vLLM shares the target's)
            self.lm_head.weight.requires_grad_(False)
        # target id of draft id i is i + d2t[i] (all zeros when the vocabulary is the target's).
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer(
            "t2d",
            torch.ones(cfg.vocab_size, dtype=torch.bool)
            if cfg.shares_lm_head
            else torch.zeros(cfg.vocab_size, dtype=torch.bool),
        )

    def context(self, aux: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """The context of every layer from the target's aux states [B, T, n_aux*Ht] at positions
        [B, T]: one feature per position, hidden_norm(fc(aux)) [B, T, H], projected by each layer
        into its keys and values, 2 x [B, nkv, T, d] (what vLLM writes into the drafter's KV cache)."""
        feature = self.hidden_norm(self.fc(aux))  # [B, T, H]
        return [layer.self_attn.keys_values(feature, positions) for layer in self.layers]

    def block_inputs(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """Block token ids [B, N*bs] for N anchors [B, N]: each block is [anchor, mask, ..., mask]."""
        B, N = anchor_tokens.shape
        ids = torch.full(
            (B, N, self.config.block_size), self.config.mask_token_id, dtype=torch.long, device=anchor_tokens.device
        )  # [B, N, bs]
        ids[:, :, 0] = anchor_tokens
        return ids.reshape(B, N * self.config.block_size)

    def forward(
        self, block_ids: torch.Tensor, block_positions: torch.Tensor, context: list[KV], visible: torch.Tensor | None
    ) -> torch.Tensor:
        """Draft N blocks at once: block_ids, block_positions [B, Q] (Q = N * block_size, each block
        its anchor then masks, at anchor + 0 .. block_size - 1), every layer's context (`context`)
        and which context positions each query sees (`visible` [B, Q, T]; None: all). -> logits [B, Q, Vd];
        slot j of a block predicts the token at its own position."""
        hidden = self.embed_tokens(block_ids).to(self.fc.weight.dtype)  # [B, Q, H]
        for layer, ctx in zip(self.layers, context):
            hidden = layer(hidden, block_positions, ctx, visible)
        return self.lm_head(self.norm(hidden))  # [B, Q, Vd]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def draft(self, context: list[KV], anchor_token: int, anchor_position: int) -> list[int]:
        """One block at inference: the target ids of the block_size - 1 tokens after the anchor,
        seeing the whole context (every cached position precedes the anchor)."""
        return self.draft_ids(context, anchor_token, anchor_position).tolist()

    @torch.no_grad()
    def draft_ids(self, context: list[KV], anchor_token: int, anchor_position: int) -> torch.Tensor:
        """As draft, left on the device: [block_size - 1]."""
        bs = self.config.block_size
        dev = context[0][0].device
        ids = self.block_inputs(torch.tensor([[anchor_token]], device=dev))  # [1, bs]
        positions = torch.arange(anchor_position, anchor_position + bs, device=dev)[None]  # [1, bs]
        logits = self(ids, positions, context, None)  # [1, bs, Vd]: the block sees all of the context
        return self.to_target_ids(logits[0, 1:].argmax(-1))
