"""The P-EAGLE drafter (parallel EAGLE), top to bottom: config, drafter.

EAGLE-3's drafter (fc over the target's aux states, decoder layers, norm, lm_head with d2t: the layers
are drafters/common.py's) that drafts K tokens in one forward. Its inputs for a round whose last
accepted position is n, as vLLM 0.32 builds them (`parallel_drafting: true`,
llm_base_proposer._copy_and_expand_eagle_inputs):

- the real slot at position n: the next token x_{n+1} and fc(aux_n), exactly EAGLE-3's step 0; it
  predicts x_{n+2}, the first draft;
- K - 1 mask slots at positions n + 1 .. n + K - 1: the token `mask_token_id` and fc(mask_hidden), one
  learned vector of the fc input's width (n_aux x target hidden) that stands for "the target's states
  here are unknown"; mask slot i predicts x_{n+2+i}.

All K slots attend causally: to the drafter's cache of real positions (EAGLE-3's step-0 keys, one per
verified position) and to the earlier slots of their own block. The drafter's output state is never
fed back (no chain of steps), so EAGLE-3.1's `norm_output` and `fc_norm` do not apply (vLLM's peagle
folder carries neither).

In training the same rule is EAGLE-3's training-time test with other inputs: slot i of the block
anchored at t is a "step" i at position t + i that sees the step-0 keys <= t of its document and the
keys of slots 1..i at t (the diagonal keys of drafters/common.attend).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from specdraft.drafters.common import DecoderLayer, RMSNorm, check_fields, rotary, target_shape


@dataclass
class PEagleConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (rows of the embedding)
    draft_vocab_size: int  # rows of lm_head; d2t maps them to target ids
    target_hidden_size: int
    mask_token_id: int  # the mask slots' token (vLLM: the folder's mask_token_id)
    speculative_tokens: int  # K: the slots per block it was trained on (one real, K - 1 masks)
    aux_layer_ids: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    num_layers: int = 1  # decoder layers: the first reads [embedding, hidden], the rest are plain Llama layers

    def check(self, where: str) -> PEagleConfig:
        """Refuse a config read from a file whose values are of the wrong kind or out of range (the mask
        token may be id 0)."""
        check_fields(self, where, zero_ok=("mask_token_id",))
        return self

    @classmethod
    def from_target(
        cls, target, draft_vocab_size: int, mask_token_id: int, speculative_tokens: int, num_layers: int = 1
    ) -> PEagleConfig:
        shape = target_shape(target, draft_vocab_size)
        return cls(**shape, mask_token_id=mask_token_id, speculative_tokens=speculative_tokens, num_layers=num_layers)

    def to_dict(self) -> dict:
        return asdict(self)

    def make_drafter(self) -> PEagleDrafter:
        return PEagleDrafter(self)


class PEagleDrafter(nn.Module):
    METHOD = "peagle"  # train.method; recorded in checkpoints (specdraft/methods/)

    def __init__(self, cfg: PEagleConfig):
        super().__init__()
        self.config = cfg
        width = len(cfg.aux_layer_ids) * cfg.target_hidden_size
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(width, cfg.rms_norm_eps)
        self.fc = nn.Linear(width, cfg.hidden_size, bias=False)
        # The mask slots' stand-in for the target's aux states, through fc as a real slot's (vLLM feeds
        # combine_hidden_states(mask_hidden)). Drawn like the peers' (unit normal), then learned.
        self.mask_hidden = nn.Parameter(torch.randn(width))
        # Copied from the target and frozen: the drafter reads tokens (the mask token too) as the target does.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, first=i == 0) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # target id of draft id i is i + d2t[i]; t2d marks the target ids inside the draft vocab.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Aux states [..., n_aux*Ht] (the target's, or mask_hidden) -> the layer's hidden input [..., H]."""
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def mask_inputs(self, B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask slots' inputs for [B, T] slots: hidden [B, T, H] (fc(mask_hidden)) and token ids [B, T]."""
        hidden = self.project(self.mask_hidden.to(self.fc.weight.dtype)).expand(B, T, -1)
        return hidden, torch.full((B, T), self.config.mask_token_id, dtype=torch.long, device=device)

    def forward(self, hidden, input_ids, positions, base=None, diag=None, q_offset=0, mask=None):
        """Slots [B, T] with their hidden inputs [B, T, H] -> logits over the draft vocab [B, T, Vd], the
        output state (unused by P-EAGLE's rounds) and the slots' keys/values, every layer's stacked
        ([layers, B, nkv, T, d] each; attention as drafters/common.Attention, per layer: `base` causal or
        under `mask`, `diag` at the query's own position)."""
        cos, sin = rotary(positions, self.config.head_dim, self.config.rope_theta)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            base_i = None if base is None else (base[0][i], base[1][i])
            diag_i = None if diag is None else [(k[i], v[i]) for k, v in diag]
            hidden, (k, v) = layer(embeds, hidden, cos, sin, base_i, diag_i, q_offset, mask)
            keys.append(k)
            values.append(v)
        return self.lm_head(self.norm(hidden)), hidden, (torch.stack(keys), torch.stack(values))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def mask_slots(self, cache, n: int, K: int, mask=None):
        """The K - 1 mask slots of a round whose last accepted position is n, over the drafter's cache
        (base keys [1, nkv, C, d] with the real slot at n last, or `mask` [K - 1, C + K - 1] saying which
        cache slots each sees): slot i at position n + i sees the cache and slots 1..i. -> logits
        [K - 1, Vd]."""
        dev = cache[0].device
        hidden, ids = self.mask_inputs(1, K - 1, dev)
        positions = (n + torch.arange(1, K, device=dev))[None]  # [1, K-1]
        logits, _, _ = self(hidden, ids, positions, base=cache, mask=mask)
        return logits[0]
