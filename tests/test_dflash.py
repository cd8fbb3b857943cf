"""The DFlash drafter: its attention pattern, packed blocks equal to blocks drafted one at a time, and
its vLLM folder written and read back giving the same logits, bit for bit."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdraft.drafters import vocab
from specdraft.methods import METHODS
from specdraft.methods.dflash.drafter import DFlashConfig, DFlashDrafter
from specdraft.methods.dflash.formats import read_dflash, write_dflash

VOCAB, T, BS, TARGET_LAYERS = 50, 12, 4, 12


def tiny(seed=0, **overrides) -> DFlashDrafter:
    """A random two-layer drafter with bf16-exact shared embedding / lm_head (a bf16 target's) and
    non-trivial norms (so a swapped or dropped norm changes the logits)."""
    torch.manual_seed(seed)
    fields = {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "num_layers": 2,
        "vocab_size": VOCAB,
        "draft_vocab_size": VOCAB,
        "target_hidden_size": 32,
        "mask_token_id": 7,
        "block_size": BS,
        "aux_layer_ids": [1, 5, 9],
        "rope_theta": 50000.0,
        "rms_norm_eps": 1e-6,
    }
    d = DFlashDrafter(DFlashConfig(**{**fields, **overrides}))
    for name, t in d.state_dict().items():
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(t, 0.5, 1.5)
    torch.nn.init.normal_(d.embed_tokens.weight)
    d.embed_tokens.weight.data = d.embed_tokens.weight.data.to(torch.bfloat16).float()
    if d.config.shares_lm_head:
        d.lm_head.weight.data = torch.randn_like(d.lm_head.weight).to(torch.bfloat16).float()
    else:
        d2t, t2d = vocab.build(torch.randint(0, 100, (VOCAB,)), d.config.draft_vocab_size)
        d.d2t.copy_(d2t)
        d.t2d.copy_(t2d)
    return d.eval()


def inputs(d, seed=1):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, T, 3 * d.config.target_hidden_size, generator=g)
    ids = torch.randint(0, VOCAB, (1, T), generator=g)
    return aux, ids


def blocks_at(d, aux, ids, anchors: list[int]):
    """Logits of one block per anchor, packed into one forward: block a sees context positions < a."""
    positions = torch.arange(T)[None]
    context = d.context(aux, positions)
    anchor_t = torch.tensor([anchors])
    block_ids = d.block_inputs(ids[:, anchor_t[0]])  # [1, N*bs]
    block_pos = (anchor_t[..., None] + torch.arange(BS)).reshape(1, -1)  # [1, N*bs]
    visible = positions[:, None, :] < anchor_t.repeat_interleave(BS, dim=1)[..., None]  # [1, N*bs, T]
    with torch.no_grad():
        return d(block_ids, block_pos, context, visible)


def test_packed_blocks_equal_blocks_drafted_one_at_a_time():
    """Training packs many blocks into one forward; inference drafts one block over a context cut at
    its anchor. Both must give the same logits, or training teaches another network than vLLM runs."""
    d = tiny()
    aux, ids = inputs(d)
    anchors = [1, 4, 5, 8]
    packed = blocks_at(d, aux, ids, anchors)  # [1, 4*bs, V]
    for n, a in enumerate(anchors):
        context = d.context(aux[:, :a], torch.arange(a)[None])
        ids_a = d.block_inputs(ids[:, a : a + 1])
        with torch.no_grad():
            alone = d(ids_a, torch.arange(a, a + BS)[None], context, torch.ones(1, BS, a, dtype=torch.bool))
        torch.testing.assert_close(packed[:, n * BS : (n + 1) * BS], alone, rtol=1e-5, atol=1e-5)
    drafted = d.draft(d.context(aux[:, :5], torch.arange(5)[None]), int(ids[0, 5]), 5)
    assert drafted == packed[0, 2 * BS + 1 : 3 * BS].argmax(-1).tolist()


def test_a_block_sees_its_context_before_the_anchor_and_its_whole_block_only():
    d = tiny()
    aux, ids = inputs(d)
    base = blocks_at(d, aux, ids, [4, 8])
    # The context at and after the first anchor: the first block must not see it, the second must.
    later = aux.clone()
    later[:, 4:] += torch.randn_like(later[:, 4:])
    changed = blocks_at(d, later, ids, [4, 8])
    torch.testing.assert_close(changed[:, :BS], base[:, :BS], rtol=0, atol=0)
    assert (changed[:, BS:] - base[:, BS:]).abs().max() > 1e-3
    # Another block's anchor token: no effect on this block.
    other = ids.clone()
    other[0, 8] = (other[0, 8] + 1) % VOCAB
    torch.testing.assert_close(blocks_at(d, aux, other, [4, 8])[:, :BS], base[:, :BS], rtol=0, atol=0)
    # The block is bidirectional: slot 1 sees the anchor, and the anchor's slot sees the masks after it.
    d2 = copy.deepcopy(d)
    d2.config.mask_token_id = 8
    masked = blocks_at(d2, aux, ids, [4, 8])
    assert (masked[:, 0] - base[:, 0]).abs().max() > 1e-3  # slot 0 (the anchor) changed by the masks


def test_the_mask_slots_read_the_targets_embedding_row_of_the_mask_token():
    d = tiny()
    aux, ids = inputs(d)
    base = blocks_at(d, aux, ids, [5])
    d.embed_tokens.weight.data[d.config.mask_token_id] += 1.0
    assert (blocks_at(d, aux, ids, [5]) - base).abs().max() > 1e-3


def export(d, out):
    return write_dflash(d, out, target_num_layers=TARGET_LAYERS, provenance={"run": "test"})


def bf16(d):
    return copy.deepcopy(d).to(torch.bfloat16).float()


@pytest.mark.parametrize("draft_vocab_size", [VOCAB, 20])
def test_round_trip_gives_identical_logits(draft_vocab_size, tmp_path):
    d = tiny(draft_vocab_size=draft_vocab_size)
    out = export(d, tmp_path / "dflash")
    embed = d.embed_tokens.weight.detach().to(torch.bfloat16)
    head = d.lm_head.weight.detach().to(torch.bfloat16) if d.config.shares_lm_head else None
    served = read_dflash(out, embed, head)
    assert served.config == d.config
    aux, ids = inputs(d)
    torch.testing.assert_close(
        blocks_at(served, aux, ids, [2, 6]), blocks_at(bf16(d), aux, ids, [2, 6]), rtol=0, atol=0
    )
    assert torch.equal(served.d2t, d.d2t) and torch.equal(served.t2d, d.t2d)


def test_tensor_names_and_config_are_the_ones_vllm_reads(tmp_path):
    d = tiny()
    out = export(d, tmp_path / "dflash")
    tensors = load_file(str(out / "model.safetensors"))
    layer = [
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    # No embedding and no lm_head: vLLM gives the drafter the target's (the mask row included).
    assert set(tensors) == (
        {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}.weight" for i in range(2) for n in layer}
    )
    for ours, t in d.state_dict().items():  # each under its own name, none swapped
        if ours in tensors:
            assert torch.equal(tensors[ours], t.to(torch.bfloat16)), ours
    assert tensors["fc.weight"].shape == (32, 96) and tensors["layers.0.self_attn.q_norm.weight"].shape == (8,)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    # Both conventions name the same layers: vLLM's (residual after k layers) and DFlash's (output of layer j).
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 5, 9]
    assert config["dflash_config"] == {
        "mask_token_id": 7,
        "target_layer_ids": [0, 4, 8],
        "causal": False,
        "use_aux_hidden_state": True,
    }
    explicit = {
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
        "is_neox_style": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention", "full_attention"],
        "use_sliding_window": False,
        "sliding_window": None,
        "vocab_size": VOCAB,
        "draft_vocab_size": VOCAB,
        "target_hidden_size": 32,
        "num_target_layers": TARGET_LAYERS,
        "block_size": BS,
    }
    assert {k: config.get(k) for k in explicit} == explicit
    # the folder's own K, block_size - 1, as export serves it
    assert METHODS["dflash"].serve_config(str(out), None) == {
        "method": "dflash",
        "model": str(out),
        "num_speculative_tokens": BS - 1,
    }


def test_a_draft_vocabulary_ships_its_lm_head_and_d2t(tmp_path):
    d = tiny(draft_vocab_size=20)
    tensors = load_file(str(export(d, tmp_path / "dflash") / "model.safetensors"))
    assert tensors["lm_head.weight"].shape == (20, 32)
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"], d.d2t)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"mask_token_id": VOCAB}, "mask_token_id 50 outside"),
        ({"mask_token_id": -1}, "mask_token_id -1 outside"),
        ({"aux_layer_ids": [1, 5, TARGET_LAYERS]}, "outside 1..11"),
        ({"aux_layer_ids": [0, 5, 9]}, "outside 1..11"),
        ({"aux_layer_ids": [9, 5, 1]}, "not strictly ascending"),
        ({"block_size": 1}, "block_size 1"),
        ({"target_hidden_size": 48}, "hidden_size 32 differs"),
    ],
)
def test_export_refuses_what_vllm_would_refuse_or_serve_wrong(overrides, match, tmp_path):
    d = (
        tiny(**overrides)
        if "target_hidden_size" not in overrides
        else DFlashDrafter(DFlashConfig(**{**tiny().config.to_dict(), **overrides}))
    )
    with pytest.raises(ValueError, match=match):
        export(d, tmp_path / "dflash")
    assert not (tmp_path / "dflash").exists()


def _edit(folder, edit):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_reader_names_what_is_missing_or_disagrees(tmp_path):
    d = tiny()
    out = export(d, tmp_path / "dflash")
    embed = d.embed_tokens.weight.detach()
    # Only DFlash's list (published folders): read as vLLM reads it, k = j + 1.
    _edit(out, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    assert read_dflash(out, embed).config.aux_layer_ids == [1, 5, 9]
    _edit(out, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 4, 8]))
    with pytest.raises(ValueError, match="different layers"):
        read_dflash(out, embed)
    _edit(
        out,
        lambda c: c.update(
            eagle_aux_hidden_state_layer_ids=[1, 5, 9], dflash_config={**c["dflash_config"], "causal": True}
        ),
    )
    with pytest.raises(ValueError, match="causal"):
        read_dflash(out, embed)
    _edit(out, lambda c: c.update(dflash_config={**c["dflash_config"], "causal": False}))
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['layers.1.self_attn.k_norm.weight'\]"):
        read_dflash(out, embed)


# --- the training objective ---------------------------------------------------------------------


def packed_batch(d, seed=2):
    """Two rows: row 0 packs two documents (prompt then answer each), row 1 one document and padding;
    the target's final-norm state at t points at x_{t+1} (its greedy next token)."""
    from specdraft.drafters.common import PAD_DOCUMENT

    g = torch.Generator().manual_seed(seed)
    B, L = 2, 24
    ids = torch.randint(0, VOCAB, (B, L), generator=g)
    documents = torch.full((B, L), PAD_DOCUMENT)
    documents[0, :10], documents[0, 10:], documents[1, :18] = 0, 1, 0
    positions = torch.zeros(B, L, dtype=torch.long)
    positions[0, :10], positions[0, 10:], positions[1, :18] = torch.arange(10), torch.arange(14), torch.arange(18)
    loss_mask = torch.zeros(B, L, dtype=torch.bool)
    loss_mask[0, 4:10], loss_mask[0, 15:], loss_mask[1, 6:18] = True, True, True
    head = d.lm_head.weight.detach()
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    return {
        "input_ids": ids,
        "documents": documents,
        "positions": positions,
        "loss_mask": loss_mask,
        "aux": torch.randn(B, L, 3 * d.config.target_hidden_size, generator=g),
        "last": 8 * head[nxt] / head[nxt].norm(dim=-1, keepdim=True),
        "top": nxt,
    }


def test_blocks_see_and_are_supervised_only_inside_their_document():
    from specdraft.methods.dflash.objective import DFlashObjective

    d = tiny()
    batch = packed_batch(d)
    objective = DFlashObjective(d, d.lm_head.weight.detach(), max_anchors=64)
    objective.generator = torch.Generator().manual_seed(0)
    b = objective.blocks(batch)
    docs, mask = batch["documents"], batch["loss_mask"]
    for r in range(2):
        for n, a in enumerate(b["anchors"][r].tolist()):
            if not b["real"][r, n]:
                assert (
                    not b["visible"][r, n * BS : (n + 1) * BS].any()
                    and not b["supervised"][r, n * BS : (n + 1) * BS].any()
                )
                continue
            assert mask[r, a] and mask[r, a + 1] and docs[r, a + 1] == docs[r, a]  # an anchor with a label after it
            seen = b["visible"][r, n * BS].nonzero().flatten().tolist()
            assert seen == [t for t in range(a) if docs[r, t] == docs[r, a]]  # its document, before the anchor
            for j in range(BS):
                q = n * BS + j
                assert b["block_positions"][r, q] == batch["positions"][r, a] + j
                inside = a + j < docs.shape[1] and docs[r, a + j] == docs[r, a] and mask[r, a + j]
                assert bool(b["supervised"][r, q]) == (j > 0 and bool(inside))
    # Every candidate of these short rows is drawn: an answer token followed by another one, 5 + 8 in
    # row 0 (answers 4..9 and 15..23), 11 in row 1 (6..17).
    assert b["real"].sum(1).tolist() == [13, 11]


def test_slot_weights_decay_from_the_first_drafted_slot():
    from specdraft.methods.dflash.objective import slot_weights

    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and torch.isclose(w[15], torch.exp(torch.tensor(-2.0)))
    assert (w[2:] < w[1:-1]).all()


def fit(d, objective, batch: dict, steps: int) -> dict:
    """`steps` AdamW steps of `objective` on one batch; the statistics after them, in eval mode."""
    from specdraft.drafters.common import summarize

    optimizer = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        loss, _ = objective(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    d.eval()
    with torch.no_grad():
        return summarize(objective(batch)[1])


def test_the_objective_trains_a_drafter_to_draft_the_targets_tokens():
    """A few hundred steps on one batch: the drafter learns the target's tokens, slot by slot (what the
    statistics say is what drafting one block at a time gives)."""
    from specdraft.drafters.common import summarize
    from specdraft.methods.dflash.objective import DFlashObjective

    d = tiny()
    d.train()
    batch = packed_batch(d)
    objective = DFlashObjective(d, d.lm_head.weight.detach(), gamma=7.0, max_anchors=64)
    objective.generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        before = summarize(objective(batch)[1])
    after = fit(d, objective, batch, steps=150)
    assert before["tau"] < 1.3 and after["tau"] > 1 + 0.9 * (BS - 1), (before, after)
    # Drafting block by block at inference gives the target's tokens too: row 1, anchored at 8.
    context = d.context(batch["aux"][1:, :8], batch["positions"][1:, :8])
    assert d.draft(context, int(batch["input_ids"][1, 8]), 8) == batch["input_ids"][1, 9 : 9 + BS - 1].tolist()


def test_the_objective_teaches_the_drafter_to_read_the_context():
    """Two rows identical at and after every anchor (tokens, positions) whose continuations differ:
    only the target states of the context tell them apart, so a drafter that drafts both right reads
    the context through fc and the injected keys and values."""
    from specdraft.methods.dflash.objective import DFlashObjective

    d = tiny(seed=3)
    d.train()
    batch = packed_batch(d, seed=4)
    for name in ("input_ids", "documents", "positions", "loss_mask", "aux"):
        batch[name] = batch[name][1:].repeat(2, *([1] * (batch[name].dim() - 1)))
    g = torch.Generator().manual_seed(5)
    batch["input_ids"][1, 7:] = torch.randint(0, VOCAB, (17,), generator=g)  # other answers in row 1...
    batch["input_ids"][1, 6::2] = batch["input_ids"][0, 6::2]  # ...same tokens at even positions (the anchors)
    batch["aux"][1, :6] = torch.randn(6, batch["aux"].shape[-1], generator=g)  # and another prompt's states
    head = d.lm_head.weight.detach()
    nxt = torch.cat([batch["input_ids"][:, 1:], batch["input_ids"][:, :1]], dim=1)
    batch["top"], batch["last"] = nxt, 8 * head[nxt] / head[nxt].norm(dim=-1, keepdim=True)
    objective = DFlashObjective(d, head, max_anchors=64)
    after = fit(d, objective, batch, steps=200)
    # Anchors 6..16 in each row; at the 6 even ones both rows have the same token at the same position
    # and different next tokens: without the context, at most (5 + 5 + 6) / 22 = 0.73 of slot 1 is right.
    assert after["acc"][0] > 0.95, after


def test_default_mask_token_is_a_token_the_chat_template_never_writes(target):
    from types import SimpleNamespace

    from specdraft.methods.dflash.drafter import default_mask_token

    tok = target.tokenizer
    mask = default_mask_token(tok, target.vocab_size)
    assert tok.convert_ids_to_tokens(mask) == "<empty_output>"  # SmolLM2: no mask token, no spare row
    chat = target.chat_ids(
        [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}],
        add_generation_prompt=False,
    )
    assert mask not in chat  # the chat template never writes it (only a message quoting it literally would)

    class Tok(SimpleNamespace):
        def __len__(self):
            return self.n

    special = SimpleNamespace(special=True)
    assert default_mask_token(Tok(mask_token_id=5, n=10), 10) == 5
    assert default_mask_token(Tok(mask_token_id=None, n=10), 16) == 10  # the first unused row (Qwen3's way)
    with pytest.raises(ValueError, match="no mask token"):
        default_mask_token(
            Tok(
                mask_token_id=None,
                n=10,
                chat_template="<s>",
                bos_token_id=0,
                eos_token_id=1,
                added_tokens_decoder={
                    0: SimpleNamespace(content="<s>", **vars(special)),
                    1: SimpleNamespace(content="</s>", **vars(special)),
                },
            ),
            10,
        )


def test_train_warns_of_a_learning_rate_that_stalls_through_the_targets_lm_head(capsys):
    from specdraft.config import TrainConfig
    from specdraft.methods.dflash import warn_of_stalling

    for cfg, warned in [
        (TrainConfig(method="dflash", draft_vocab_size=0, lr=3e-3, warmup_steps=5), True),
        (TrainConfig(method="dflash", draft_vocab_size=512, lm_head_init="target", lr=3e-3), True),
        (TrainConfig(method="dflash", draft_vocab_size=0, lr=3e-4, warmup_steps=5), False),
        (TrainConfig(method="dflash", draft_vocab_size=0, lr=1e-3, warmup_steps=50), False),
        (TrainConfig(method="dflash", draft_vocab_size=512, lr=3e-3), False),
    ]:  # its own random head
        warn_of_stalling(cfg)
        assert ("stalled at the unigram" in capsys.readouterr().out) == warned, cfg
