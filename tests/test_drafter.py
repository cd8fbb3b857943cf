"""The drafter computes in training exactly what it computes when drafting, packed or not."""

import pytest
import torch

from specdraft.drafters.common import PAD_DOCUMENT
from specdraft.methods.eagle3.drafter import DrafterConfig, Eagle3Drafter, document_mask
from specdraft.methods.eagle3.objective import TTT, unroll


def small_config(**kw) -> DrafterConfig:
    shape = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=50,
        draft_vocab_size=50,
        target_hidden_size=32,
        aux_layer_ids=[1, 2, 3],
        rope_theta=10000.0,
    )
    return DrafterConfig(**{**shape, **kw})


def small_drafter(seed=0, **kw) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d = Eagle3Drafter(small_config(**kw))
    torch.nn.init.normal_(d.embed_tokens.weight)
    norms = [d.layers[0].input_layernorm, d.layers[0].hidden_norm, d.norm]
    norms += [d.input_norm] if kw.get("norm_before_fc") else []
    norms += list(d.fc_norm) if kw.get("fc_norm") else []
    for norm in norms:
        torch.nn.init.uniform_(norm.weight, 0.5, 1.5)  # non-trivial norms catch a swapped norm
    return d.eval()


def one_document(T):
    return torch.zeros(1, T, dtype=torch.long), torch.arange(T)[None]


def draft_at(d, aux, ids, t, steps):
    """Inference path: step 0 over the prefix 0..t, then one query per step at position t with the
    drafter's cache and the chain so far (true tokens stand in for accepted drafts)."""
    hidden = d.project(aux[:, : t + 1])
    logits, h, base = d(hidden, ids[:, 1 : t + 2], torch.arange(t + 1)[None])
    out = [logits[0, -1]]
    h, diag = h[:, -1:], []
    for i in range(1, steps):
        logits, h, kv = d(
            h,
            ids[:, t + 1 + i : t + 2 + i],
            torch.tensor([[t + i]]),
            base=base,
            diag=diag,
            q_offset=base[0].shape[2] - 1,
        )
        diag = diag + [kv]
        out.append(logits[0, -1])
    return out


@pytest.mark.parametrize("options", [{}, {"norm_before_fc": True, "fc_norm": True, "norm_output": True}])
def test_training_time_test_equals_drafting(options):
    d = small_drafter(**options)
    T, steps = 12, 4
    aux = torch.randn(1, T, 96)
    ids = torch.randint(0, 50, (1, T))
    with torch.no_grad():
        trained = list(unroll(d, aux, ids, *one_document(T), steps))
        for t in (0, 3, 7):
            drafted = draft_at(d, aux, ids, t, steps)
            for i in range(steps):
                torch.testing.assert_close(trained[i][0, t], drafted[i], rtol=1e-4, atol=1e-5)


def test_options_change_the_output():
    """Each follow-up option is wired in: switching it on changes the logits."""
    aux, ids = torch.randn(1, 8, 96), torch.randint(0, 50, (1, 8))
    plain = list(unroll(small_drafter(3), aux, ids, *one_document(8), 2))
    for option in ("norm_before_fc", "fc_norm", "norm_output"):
        with torch.no_grad():
            other = list(unroll(small_drafter(3, **{option: True}), aux, ids, *one_document(8), 2))
        assert not torch.allclose(plain[1], other[1]), option


def test_both_input_norms_apply_in_vllms_order():
    """vLLM's combine_hidden_states norms the concatenated aux states (`norm_before_fc`) before each aux
    layer's part (`fc_norm`); a drafter trained the other way round would be served another function."""
    d = small_drafter(4, norm_before_fc=True, fc_norm=True)
    aux = torch.randn(1, 5, 96)
    whole = d.input_norm(aux)
    parts = torch.cat([norm(p) for norm, p in zip(d.fc_norm, whole.chunk(3, dim=-1))], dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(d.project(aux), d.fc(parts))


def packed_and_alone(seed=1):
    """Three documents of different lengths: as one packed row, and as three right-padded rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 12, 5]
    vocab, hidden = 50, 32
    docs = [
        {
            "input_ids": torch.randint(0, vocab, (n,), generator=g),
            "loss_mask": torch.rand(n, generator=g) < 0.8,
            "aux": torch.randn(n, 96, generator=g),
            "last": torch.randn(n, hidden, generator=g),
            "top": torch.randint(0, vocab, (n,), generator=g),
        }
        for n in lengths
    ]

    def rows(groups):
        T = max(sum(lengths[i] for i in group) for group in groups)
        B = len(groups)
        b = {
            "input_ids": torch.zeros(B, T, dtype=torch.long),
            "loss_mask": torch.zeros(B, T, dtype=torch.bool),
            "documents": torch.full((B, T), PAD_DOCUMENT),
            "positions": torch.zeros(B, T, dtype=torch.long),
            "top": torch.zeros(B, T, dtype=torch.long),
            "aux": torch.zeros(B, T, 96),
            "last": torch.zeros(B, T, hidden),
        }
        for r, group in enumerate(groups):
            at = 0
            for k, i in enumerate(group):
                n = lengths[i]
                for key in ("input_ids", "loss_mask", "top", "aux", "last"):
                    b[key][r, at : at + n] = docs[i][key]
                b["documents"][r, at : at + n] = k
                b["positions"][r, at : at + n] = torch.arange(n)
                at += n
        return b

    return rows([[0, 1, 2]]), rows([[0], [1], [2]])


@pytest.mark.parametrize("loss", ["soft_ce", "kl", "lk"])
def test_packed_equals_unpacked(loss):
    """Packing documents into one row gives the same loss, gradients and statistics as running them
    one per row: attention and rotary positions stay inside each document."""
    packed, alone = packed_and_alone()
    results = []
    for batch in (packed, alone):
        d = small_drafter(4, norm_output=True)
        d.t2d[:40] = True  # ids 40..49 outside the draft vocab: those positions drop out of the loss
        model = TTT(d, torch.randn(50, 32, generator=torch.Generator().manual_seed(0)), 3, 0.8, loss)
        total, stats = model(batch)
        total.backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad}
        results.append((total.detach(), stats, grads))
    (l1, s1, g1), (l2, s2, g2) = results
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)
    assert s1[:, 1].min() > 0, "every step must count some positions"
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packing_leaks_nothing_across_documents():
    """Changing the first document changes nothing the second one computes (no cross-document attention)."""
    d = small_drafter(5)
    packed, _ = packed_and_alone()
    changed = {k: v.clone() for k, v in packed.items()}
    changed["input_ids"][0, :7] = (changed["input_ids"][0, :7] + 1) % 50
    changed["aux"][0, :7] += 1.0
    with torch.no_grad():
        a = list(unroll(d, packed["aux"], packed["input_ids"], packed["documents"], packed["positions"], 3))
        b = list(unroll(d, changed["aux"], changed["input_ids"], changed["documents"], changed["positions"], 3))
    for i in range(3):
        # Positions >= 7 belong to documents 1 and 2; step i at position 6 reads x_{7+i} but is document 0's.
        torch.testing.assert_close(a[i][0, 7:], b[i][0, 7:])
        assert not torch.allclose(a[i][0, :6], b[i][0, :6])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's block-sparse path runs on CUDA")
def test_flex_attention_equals_dense_on_cuda():
    """On CUDA the document mask is a FlexAttention BlockMask; it computes what the dense mask does."""
    packed, _ = packed_and_alone()
    d = small_drafter(6, num_attention_heads=2, head_dim=16).cuda()  # FlexAttention needs head_dim >= 16
    batch = {k: v.cuda() for k, v in packed.items()}
    assert not isinstance(document_mask(batch["documents"]), torch.Tensor)
    with torch.no_grad():
        flex = list(unroll(d, batch["aux"], batch["input_ids"], batch["documents"], batch["positions"], 3))
    dense_mask = document_mask(packed["documents"]).cuda()
    with torch.no_grad():
        dense = list(
            unroll(d, batch["aux"], batch["input_ids"], batch["documents"], batch["positions"], 3, mask=dense_mask)
        )
    for a, b in zip(flex, dense):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_gradient_checkpointing_changes_nothing_but_memory():
    packed, _ = packed_and_alone()
    results = []
    for checkpointing in (False, True):
        d = small_drafter(7)
        model = TTT(
            d, torch.randn(50, 32, generator=torch.Generator().manual_seed(0)), 3, 0.8, checkpointing=checkpointing
        )
        total, _ = model(packed)
        total.backward()
        results.append((total.detach(), [p.grad.clone() for p in d.parameters() if p.requires_grad]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


def test_pack_fills_rows_up_to_the_budget():
    from specdraft.drafters.common import pack

    lengths = [50, 30, 80, 10, 200, 40, 60]
    rows = pack(list(range(len(lengths))), lengths, 100)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    for row in rows:
        assert sum(min(lengths[i], 100) for i in row) <= 100
    assert rows == [[0, 1], [2, 3], [4], [5, 6]]
