"""Run inside a throwaway venv holding the speculators package (tests/test_import.py): build an EAGLE-3
drafter for a target with speculators' own training-CLI path (its layer config builder, vocab mapping
and `from_training_args`, the defaults of its training CLI) and write it with its own `save_pretrained`.

    python speculators_save.py TARGET_FOLDER OUT_FOLDER DRAFT_VOCAB
"""

import sys

import torch
from speculators.models.eagle3 import Eagle3DraftModel
from speculators.train.cli import create_transformer_layer_config

target, out, draft_vocab = sys.argv[1], sys.argv[2], int(sys.argv[3])
layer = create_transformer_layer_config(verifier_name_or_path=target, num_layers=1, draft_arch="llama",
                                        hidden_act="silu", sliding_window=2048, full_attention_indices=[])
torch.manual_seed(0)
vocab = layer.vocab_size
chosen = torch.sort(torch.randperm(vocab)[:draft_vocab]).values  # a draft vocabulary of known target ids
d2t = chosen - torch.arange(draft_vocab)  # offsets: target id = draft id + d2t[draft id]
t2d = torch.zeros(vocab, dtype=torch.bool)
t2d[chosen] = True
model = Eagle3DraftModel.from_training_args(
    verifier_config=layer, t2d=t2d, d2t=d2t, verifier_name_or_path=target, draft_vocab_size=draft_vocab,
    norm_before_residual=True, ttt_steps=3, draft_attn_impl="eager")
model.save_pretrained(out)
print(f"saved {out}: {sorted(p.name for p in __import__('pathlib').Path(out).iterdir())}")
