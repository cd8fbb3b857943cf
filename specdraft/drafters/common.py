"""What every drafter method shares, owned by none: the layers (RMSNorm, the gated MLP, rotary
positions), the packed batch the trainer feeds every objective (pack, collate, the padding document id),
the losses against the target's distribution, and the per-position statistics every objective returns
(STAT_COLUMNS rows, read by summarize into loss, accuracy, conditional acceptance and tau).

Engine folders of every method share the fix for an unreadable one (REEXPORT) and their provenance.
A method's package (specdraft/methods/<name>/) builds its drafter and objective on these; nothing here
knows which method runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.config import TrainConfig, field_choices
from specdraft.files import load_safetensors, save_safetensors
from specdraft.run import atomic_path
from specdraft.targets import refuse_pickled_weights


def check_fields(config, where: str, zero_ok: tuple[str, ...] = ()) -> None:
    """Refuse a drafter config read from a file whose values are of the wrong kind or out of range, in one
    line naming `where`: sizes whole numbers above 0 (or >= 0 for the fields in `zero_ok`), layer ids whole
    numbers >= 0, eps and theta finite and above 0, flags true or false."""

    def fits(name: str, kind: str, v) -> bool:
        if kind == "int":
            return type(v) is int and (v > 0 or name in zero_ok and v == 0)
        if kind == "float":
            return type(v) in (int, float) and math.isfinite(v) and v > 0
        if kind == "bool":
            return type(v) is bool
        return isinstance(v, list) and bool(v) and all(type(i) is int and i >= 0 for i in v)

    for f in fields(config):
        if not fits(f.name, f.type, getattr(config, f.name)):
            raise ValueError(f"{where}: {f.name} = {getattr(config, f.name)!r} is not a valid {f.type}")


def target_shape(target, draft_vocab_size: int) -> dict:
    """The fields a drafter as wide as the target takes from it (every method's config has them)."""
    c = target.text_config
    rope = getattr(c, "rope_parameters", None) or {}
    return dict(
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


def within_vocab(draft_vocab_size: int, vocab_size: int) -> int:
    """The draft vocabulary's size: 0 is the whole vocabulary; more than it is refused, not cut to it
    (the recipe's train.draft_vocab_size, checked first by targets.check_fits)."""
    if draft_vocab_size > vocab_size:
        raise ValueError(
            f"train.draft_vocab_size: {draft_vocab_size} is outside its range: <= {vocab_size:,} "
            f"(the target's vocabulary; 0 takes all of it)"
        )
    return draft_vocab_size or vocab_size


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """The mask token of a target with none chosen: the tokenizer's own mask token; else the first
    embedding row past the tokenizer's ids (Qwen3's checkpoints have such rows, and the published
    drafters use one); else the highest-numbered special token that is none of bos / eos / pad / unk
    and that the chat template never writes (SmolLM2: `<empty_output>`, a code-pretraining marker).
    The mask slots' input is the target's row of this id, so it must never be a token of the data (DFlash's
    and P-EAGLE's mask slots)."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    template = getattr(tokenizer, "chat_template", None) or ""
    taken = {getattr(tokenizer, f"{role}_token_id", None) for role in ("bos", "eos", "pad", "unk")}
    specials = [
        i
        for i, t in tokenizer.added_tokens_decoder.items()
        if t.special and i < vocab_size and i not in taken and t.content not in template
    ]
    if not specials:
        raise ValueError(
            "no mask token: the tokenizer has none, no unused embedding row and no spare special "
            "token; name one (a token id the training data never contains)"
        )
    return max(specials)


# ---------------------------------------------------------------------------------------------------
# Engine folders

# What to do about an engine folder that cannot be read or does not hold what it says.
REEXPORT = "re-export it (`specdraft export`), or fetch the drafter folder again from where it was published"
WEIGHTS = "model.safetensors"


def layer_config(cfg) -> dict:
    """The Llama config an engine builds an EAGLE-3 or P-EAGLE drafter's decoder layers from
    (vLLM also sizes P-EAGLE's mask_hidden from num_aux_hidden_states)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": getattr(cfg, "num_layers", 1),
        # vLLM sizes fc's input from this field (default 3) and ignores the top-level aux id list.
        "num_aux_hidden_states": len(cfg.aux_layer_ids),
        "vocab_size": cfg.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def provenance(run_name: str) -> dict:
    """What an exported folder says of where it came from."""
    return {"run": run_name, "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_tensors(drafter: nn.Module, out: Path, keys: dict[str, str]) -> None:
    """The drafter's tensors under the format's names (`keys`: ours -> theirs), floats as bf16."""
    state = drafter.state_dict()
    tensors = {}
    for ours, theirs in keys.items():
        t = state[ours].detach()
        tensors[theirs] = (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS) as tmp:
        save_safetensors(tensors, tmp)


def read_tensors(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a folder (model.safetensors, else its shards), `prefix` dropped from their names. A
    folder of pytorch_model*.bin only is refused with the command that converts it: nothing is unpickled."""
    files = [folder / WEIGHTS] if (folder / WEIGHTS).exists() else sorted(folder.glob("*.safetensors"))
    if not files:
        refuse_pickled_weights(folder)
        raise ValueError(f"{folder}: no weights (*.safetensors)")
    tensors = {}
    for f in files:
        tensors.update({k.removeprefix(prefix): v for k, v in load_safetensors(f, fix=REEXPORT).items()})
    return tensors


def load_checked(drafter: nn.Module, state: dict, expected: dict, folder: Path, names: dict | None = None):
    """`state` into the drafter (float32, eval mode) once every tensor fits `expected`'s shapes; the misfits
    are all named (`names`: ours -> the folder's)."""
    misfits = [
        f"{(names or {}).get(k, k)}: {list(v.shape)} given, config.json needs {list(expected[k].shape)}"
        for k, v in state.items()
        if k in expected and v.shape != expected[k].shape
    ]
    if misfits:
        raise ValueError(f"{folder}: the tensors do not fit config.json:\n  " + "\n  ".join(misfits))
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return drafter.eval()


# ---------------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Step0Cache:
    """An EAGLE-style drafter's cache of step-0 keys on the eager engine (one per verified position: the
    target's aux state h_t with token x_{t+1}), and the last position's output, the next round's root.
    EAGLE-3's chain and tree and P-EAGLE's slots draft from it."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.cache = None
        self.root_hidden = self.root_logits = None
        self.root_position = -1

    def reset(self, max_accepted: int):
        """A fresh state per decode: nothing to reset."""

    @torch.inference_mode()
    def advance(self, aux: torch.Tensor, next_tokens: list[int], first_position: int):
        """Step 0 over newly accepted positions: position t reads (target aux h_t, token x_{t+1})."""
        d = self.drafter
        positions = torch.arange(first_position, first_position + len(next_tokens), device=aux.device)[None]
        tokens = torch.tensor([next_tokens], device=aux.device)
        logits, h, kv = d(d.project(aux.to(d.fc.weight.dtype))[None], tokens, positions, base=self.cache)
        # Keys along dim -2: [B, nkv, T, d], or [layers, B, nkv, T, d] for a drafter of several layers.
        self.cache = (
            kv if self.cache is None else (torch.cat([self.cache[0], kv[0]], -2), torch.cat([self.cache[1], kv[1]], -2))
        )
        self.root_hidden, self.root_logits = h[:, -1:], logits[0, -1]  # [1, 1, H], [Vd]
        self.root_position = first_position + len(next_tokens) - 1


def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for integer positions [B, T] -> [B, 1, T, head_dim] each (Llama / NeoX layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [B, T, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, T, head_dim]
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg):  # any config with hidden_size and intermediate_size
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------------------------------
# EAGLE-3's decoder layer (every EAGLE-style method drafts with it: EAGLE-3 step by step, P-EAGLE in
# parallel slots)
#
# One decoder layer that reads two things per position: the token's embedding and a hidden state, each
# normed and concatenated ([B, T, 2H]) before attention. Attention works over two kinds of keys:
# base keys, causal (query j sees positions 0..q_offset+j; in packed training rows only those of its own
# document, `document_mask`), and diagonal keys, each seen only by the query at the same position (the
# keys of earlier drafting steps or slots at the same anchor). The diagonal keys are merged into the base
# attention exactly through its log-sum-exp, so no [T, steps*T] score matrix is ever formed.

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
            row = [
                dense_attention(
                    q[b : b + 1, :, s:e],
                    base[0][b : b + 1, :, s:e],
                    base[1][b : b + 1, :, s:e],
                    torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril(),
                    scale,
                )
                for s, e in spans
            ]
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
    def __init__(self, cfg, width: int):  # an EAGLE-3 style config: sizes, heads; the input's width
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(width, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, base: KV | None = None, diag: list[KV] | None = None, q_offset: int = 0, mask=None):
        """x [B, T, width]. With `diag` None this step's keys extend `base` causally (query j sees base
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
                q_offset + torch.arange(T, device=x.device)[:, None]
            )  # [T, Tb]
        out = attend(q, base, diag, mask)  # [B, nh, T, d]
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # [B, T, nh*d]
        return self.o_proj(out), (k, v)


# DecoderLayer's weights, by the names vLLM's Eagle-3 Llama layer gives them (the folders' tensor names).
LAYER_WEIGHTS = (
    "input_layernorm",
    "hidden_norm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


class DecoderLayer(nn.Module):
    """vLLM's Eagle-3 Llama layer. The first reads [norm(embedding), norm(hidden)] (2H wide); a later one
    (a drafter of several layers) is a plain Llama layer on the hidden state alone, and carries an unused
    hidden_norm because vLLM builds one in every layer and loads it from the folder."""

    def __init__(self, cfg, first: bool = True):  # an EAGLE-3 style config: sizes, heads, norm_before_residual
        super().__init__()
        self.first, self.norm_before_residual = first, cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the embedding's; later: the hidden's
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the hidden state
        if not first:
            self.hidden_norm.weight.requires_grad_(False)
        self.self_attn = Attention(cfg, (2 if first else 1) * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, base=None, diag=None, q_offset=0, mask=None):
        if self.first:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        else:
            residual, x = hidden, self.input_layernorm(hidden)  # [B, T, H]
        attn, kv = self.self_attn(x, cos, sin, base, diag, q_offset, mask)
        hidden = residual + attn
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, kv


# ---------------------------------------------------------------------------------------------------
# The packed batch


# Rows of target logits computed at once: the full-vocab logits are only needed for their argmax.
LOGIT_CHUNK = 1024


# Padding positions get this document id (real documents count from 0): they attend only to each other.
PAD_DOCUMENT = -1


# Shifted-in positions past the end of a row: a document id no position has, so nothing matches it.
NO_DOCUMENT = -2


def pack(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Samples in `order` grouped into rows of at most `budget` tokens (a longer sample gets a row of
    its own and is cut to the budget by `collate`)."""
    rows, current, used = [], [], 0
    for i in order:
        n = min(lengths[i], budget)
        if current and used + n > budget:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        rows.append(current)
    return rows


def collate(source, rows: list[list[int]], tops: list[torch.Tensor], budget: int, fixed: bool = True) -> dict:
    """Packed rows, right-padded: input_ids / loss_mask / documents / positions / top [B, T], aux
    [B, T, n_aux*H], last [B, T, H]. Samples longer than `budget` are cut to it. `fixed` pads to the
    budget, one shape for every batch, so compiled kernels (FlexAttention, torch.compile) are built
    once; otherwise to the longest row (eager kernels take any shape, and padding is pure waste)."""
    rows_items = [[(i, source[i]) for i in row] for row in rows]
    longest = max(sum(min(it["input_ids"].numel(), budget) for _, it in row) for row in rows_items)
    B, T = len(rows), budget if fixed else longest
    first = rows_items[0][0][1]
    batch = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "documents": torch.full((B, T), PAD_DOCUMENT, dtype=torch.long),
        "positions": torch.zeros(B, T, dtype=torch.long),
        "top": torch.zeros(B, T, dtype=torch.long),
        "aux": torch.zeros(B, T, first["aux"].shape[-1], dtype=first["aux"].dtype),
        "last": torch.zeros(B, T, first["last"].shape[-1], dtype=first["last"].dtype),
    }
    for r, row in enumerate(rows_items):
        at = 0
        for doc, (i, it) in enumerate(row):
            n = min(it["input_ids"].numel(), budget)
            span = slice(at, at + n)
            batch["input_ids"][r, span] = it["input_ids"][:n].long()
            batch["loss_mask"][r, span] = it["loss_mask"][:n].bool()
            batch["documents"][r, span] = doc
            batch["positions"][r, span] = torch.arange(n)
            batch["top"][r, span] = tops[i][:n]
            batch["aux"][r, span] = it["aux"][:n]
            batch["last"][r, span] = it["last"][:n]
            at += n
    return batch


# ---------------------------------------------------------------------------------------------------
# Losses and statistics


LOSSES = field_choices(TrainConfig, "loss")


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, n:] along dim 1, filled on the right so the length stays T."""
    pad = torch.full((x.shape[0], n, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


def position_loss(kind: str, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-position loss [B, T] of drafter logits against the target distribution, both [B, T, Vd].

    soft_ce: cross-entropy with the target's distribution (EAGLE-3). kl: KL(target || drafter), the same
    gradient, a loss that reaches 0. lk: -log of the acceptance probability of speculative sampling,
    sum_x min(p, q) (acceptance-oriented; greedy acceptance is its limit).
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    if kind == "soft_ce":
        return -(target * logp).sum(-1)
    if kind == "kl":
        return (torch.xlogy(target, target) - target * logp).sum(-1)
    if kind == "lk":
        accept = torch.minimum(target, logp.exp()).sum(-1)
        return -torch.log(accept.clamp(min=torch.finfo(torch.float32).tiny))
    raise ValueError(f"train.loss = {kind!r}: expected one of {', '.join(LOSSES)}")


# Columns of the per-step statistics: summed loss and its positions, top-1 correct among them, and for
# acceptance: evaluable positions, chains correct through this step, chains correct before it.
STAT_COLUMNS = ("loss_sum", "count", "correct", "evaluable", "chain_correct", "chain_before")


def summarize(stats: torch.Tensor) -> dict:
    """Per TTT position: loss, top-1 accuracy, conditional acceptance (draft i accepted given drafts
    < i were), and the simulated acceptance length tau of chain drafting with that many tokens:
    1 + sum_k prod_{j<=k} alpha_j (vLLM's mean acceptance length, bonus token included)."""
    s = {name: stats[:, c].tolist() for c, name in enumerate(STAT_COLUMNS)}
    loss = [ls / max(1.0, n) for ls, n in zip(s["loss_sum"], s["count"])]
    acc = [c / max(1.0, n) for c, n in zip(s["correct"], s["count"])]
    alpha = [c / max(1.0, b) for c, b in zip(s["chain_correct"], s["chain_before"])]
    tau, accepted = 1.0, 1.0
    for a in alpha:
        accepted *= a
        tau += accepted

    def r(xs):
        return [round(x, 4) for x in xs]

    return {"loss": r(loss), "acc": r(acc), "cond_accept": r(alpha), "tau": round(tau, 4)}


class ShiftedObjective(nn.Module):
    """The loss of an EAGLE-style drafter on one packed batch (the trainer's batch dict), whose position i
    (EAGLE-3's TTT step, P-EAGLE's slot) at t predicts x_{t+2+i}: its target distribution is
    softmax(lm_head(z_{t+1+i})) over the draft vocabulary, counted where x_{t+2+i} is an assistant token of
    the same document and the target's top token is inside the draft vocabulary (elsewhere the drafter
    cannot be right); position i weighs decay^i. One module, so DDP and FSDP wrap a single forward.
    Returns the weighted loss and per-position statistics [positions, len(STAT_COLUMNS)]. A method says
    how its positions' logits are made (`position_logits`)."""

    def __init__(self, drafter, draft_head, decay: float, loss: str = "soft_ce", checkpointing=False, hidden_noise=0.0):
        super().__init__()
        self.drafter = drafter
        # The draft vocab's rows of the target's lm_head [Vd, H]: frozen, it gives the target distribution.
        self.register_buffer("draft_head", draft_head, persistent=False)
        self.decay, self.loss, self.checkpointing, self.hidden_noise = decay, loss, checkpointing, hidden_noise

    def position_logits(self, aux, ids, documents, positions):
        """Yield each position's logits [B, T, Vd] over the row's positions t."""
        raise NotImplementedError

    def noisy(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [B, T, n_aux*H] plus uniform noise of +-hidden_noise x each state's RMS, in training only."""
        if not (self.training and self.hidden_noise):
            return aux
        rms = aux.pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, 1]
        return aux + (torch.rand_like(aux) * 2 - 1) * self.hidden_noise * rms

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.drafter
        ids, docs, pos = batch["input_ids"], batch["documents"], batch["positions"]
        with torch.no_grad():
            probs = torch.softmax((batch["last"] @ self.draft_head.T.to(batch["last"].dtype)).float(), -1)  # [B, T, Vd]
            inside = d.t2d[batch["top"]]  # [B, T]
        total = torch.zeros((), device=ids.device)
        stats = []
        chain = torch.ones_like(batch["loss_mask"])  # drafts correct so far, per position
        aux = self.noisy(batch["aux"].float())
        for i, logits in enumerate(self.position_logits(aux, ids, docs, pos)):
            # x_{t+2+i}: an assistant token of the same document
            evaluable = shift(batch["loss_mask"], 2 + i, False) & (shift(docs, 2 + i, NO_DOCUMENT) == docs)
            where = evaluable & shift(inside, 1 + i, False)  # [B, T]
            count = where.sum()
            loss_sum = (position_loss(self.loss, logits, shift(probs, 1 + i)) * where).sum()
            total = total + self.decay**i * loss_sum / count.clamp(min=1)
            with torch.no_grad():
                pred = logits.argmax(-1)
                correct = (pred + d.d2t[pred]) == shift(batch["top"], 1 + i)  # the target's greedy token
                before = chain & evaluable
                chain = chain & correct
                row = [
                    loss_sum.detach(),
                    count,
                    (correct & where).sum(),
                    evaluable.sum(),
                    (chain & evaluable).sum(),
                    before.sum(),
                ]
                stats.append(torch.stack([x.float() for x in row]))
        return total, torch.stack(stats)
