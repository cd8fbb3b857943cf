import torch

from specdraft.drafters import vocab


def test_draft_vocab_is_top_frequency_with_offsets():
    samples = [([5, 5, 5, 9, 9, 1, 7], [1, 1, 1, 1, 1, 1, 0])]
    counts = vocab.token_counts(samples, vocab_size=12)
    assert counts[5] == 3 and counts[7] == 0  # unmasked tokens are not counted
    d2t, t2d = vocab.build(counts, size=3)
    draft_to_target = torch.arange(3) + d2t
    assert draft_to_target.tolist() == [1, 5, 9]  # ascending target ids
    assert (d2t >= 0).all()
    assert t2d.nonzero().flatten().tolist() == [1, 5, 9]
    assert vocab.coverage(counts, t2d) == 1.0


def test_ties_and_unseen_ids_are_deterministic():
    counts = torch.tensor([0, 2, 0, 2, 0])
    d2t, t2d = vocab.build(counts, size=3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 3]
    assert vocab.build(counts, size=99)[1].all()  # capped at the target vocab
