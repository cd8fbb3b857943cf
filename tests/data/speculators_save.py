"""Run inside a throwaway venv holding the speculators package (tests/test_import.py): build a drafter
for a target with speculators' own training-CLI path (its layer config builder, `from_training_args`,
the defaults of its training CLI) and write it with its own `save_pretrained`.

    python speculators_save.py eagle3 TARGET_FOLDER OUT_FOLDER DRAFT_VOCAB
    python speculators_save.py dflash TARGET_FOLDER OUT_FOLDER DRAFT_VOCAB MASK_TOKEN_ID AUX_IDS

EAGLE-3: one llama layer with the CLI's default sliding window of 2048. DFlash: two qwen3 layers of full
attention (`--full-attention-indices 0 1`), blocks of 4, bidirectional within the block
(`sliding_window_non_causal`, which vLLM reads as `causal: false`), reading the comma-separated AUX_IDS.
A DRAFT_VOCAB below the target's gets a draft vocabulary of random known target ids (d2t, t2d).
"""

import sys
from pathlib import Path

import torch
from speculators.train.cli import create_transformer_layer_config


def vocab_maps(vocab: int, draft_vocab: int):
    """(t2d, d2t) of a draft vocabulary of random target ids, or (None, None) for the whole vocabulary."""
    if draft_vocab >= vocab:
        return None, None
    chosen = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
    d2t = chosen - torch.arange(draft_vocab)  # offsets: target id = draft id + d2t[draft id]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return t2d, d2t


def eagle3(target: str, draft_vocab: int):
    from speculators.models.eagle3 import Eagle3DraftModel

    layer = create_transformer_layer_config(
        verifier_name_or_path=target,
        num_layers=1,
        draft_arch="llama",
        hidden_act="silu",
        sliding_window=2048,
        full_attention_indices=[],
    )
    t2d, d2t = vocab_maps(layer.vocab_size, draft_vocab)
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=target,
        draft_vocab_size=draft_vocab,
        norm_before_residual=True,
        ttt_steps=3,
        draft_attn_impl="eager",
    )


def dflash(target: str, draft_vocab: int, mask_token_id: int, aux_ids: list[int]):
    from speculators.models.dflash import DFlashDraftModel

    layer = create_transformer_layer_config(
        verifier_name_or_path=target,
        num_layers=2,
        draft_arch="qwen3",
        hidden_act="silu",
        sliding_window=2048,
        full_attention_indices=[0, 1],
    )
    t2d, d2t = vocab_maps(layer.vocab_size, draft_vocab)
    model = DFlashDraftModel.from_training_args(
        verifier_config=layer,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=target,
        draft_vocab_size=min(draft_vocab, layer.vocab_size),
        block_size=4,
        mask_token_id=mask_token_id,
        target_layer_ids=aux_ids,
        sliding_window_non_causal=True,
        draft_attn_impl="eager",
    )
    # Freshly built norms are all ones: make them differ, so a norm read into the wrong place shows.
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("norm.weight") and not name.startswith("verifier"):
                t.uniform_(0.5, 1.5)
    return model


if __name__ == "__main__":
    kind, target, out, draft_vocab = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.manual_seed(0)
    if kind == "eagle3":
        model = eagle3(target, draft_vocab)
    else:
        model = dflash(target, draft_vocab, int(sys.argv[5]), [int(k) for k in sys.argv[6].split(",")])
    model.save_pretrained(out)
    print(f"saved {out}: {sorted(p.name for p in Path(out).iterdir())}")
