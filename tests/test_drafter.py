"""The drafter computes in training exactly what it computes when drafting."""

import torch

from specdraft.drafter.model import DrafterConfig, Eagle3Drafter
from specdraft.train import unroll


def small_drafter(seed=0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=64, vocab_size=50, draft_vocab_size=50, target_hidden_size=32,
                        aux_layer_ids=[1, 2, 3], rope_theta=10000.0)
    d = Eagle3Drafter(cfg)
    torch.nn.init.normal_(d.embed_tokens.weight)
    for norm in (d.layers[0].input_layernorm, d.layers[0].hidden_norm, d.norm):
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)  # non-trivial norms catch a swapped norm
    return d.eval()


def draft_at(d, aux, ids, t, steps):
    """Inference path: step 0 over the prefix 0..t, then one query per step at position t with the
    drafter's cache and the chain so far (true tokens stand in for accepted drafts)."""
    hidden = d.project(aux[:, : t + 1])
    logits, h, base = d(hidden, ids[:, 1: t + 2], torch.arange(t + 1)[None])
    out = [logits[0, -1]]
    h, diag = h[:, -1:], []
    for i in range(1, steps):
        logits, h, kv = d(h, ids[:, t + 1 + i: t + 2 + i], torch.tensor([[t + i]]), base=base, diag=diag,
                          q_offset=base[0].shape[2] - 1)
        diag = diag + [kv]
        out.append(logits[0, -1])
    return out


def test_training_time_test_equals_drafting():
    d = small_drafter()
    T, steps = 12, 4
    aux = torch.randn(1, T, 96)
    ids = torch.randint(0, 50, (1, T))
    with torch.no_grad():
        trained = list(unroll(d, aux, ids, steps))
        for t in (0, 3, 7):
            drafted = draft_at(d, aux, ids, t, steps)
            for i in range(steps):
                torch.testing.assert_close(trained[i][0, t], drafted[i], rtol=1e-4, atol=1e-5)


def test_padding_on_the_right_does_not_change_earlier_positions():
    d = small_drafter(2)
    aux = torch.randn(1, 9, 96)
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        short = list(unroll(d, aux[:, :6], ids[:, :6], 3))
        long = list(unroll(d, aux, ids, 3))
    for i in range(3):
        # Position t at step i reads x_{t+1+i}; positions that stay inside the short sequence agree.
        k = 5 - 1 - i
        torch.testing.assert_close(short[i][0, :k], long[i][0, :k], rtol=1e-4, atol=1e-5)
