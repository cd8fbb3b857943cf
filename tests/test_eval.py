"""The reference decoder: tree and chain greedy decoding equal the target's greedy output, sampled
decoding has the target's distribution, and the report carries the figures users decide on.

The drafter memorises the target's answers to 4 prompts, so on those prompts it is accepted often
and deep: tree paths beyond the first child, cache compaction of non-contiguous tree nodes and
multi-token acceptance are all exercised, which a weak drafter (accepting nothing) would not do.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from hostops import CheckedGraphs
from scipy import stats as sps

from specdraft.cli import main
from specdraft.decoding import rounds, runners, tree
from specdraft.methods.eagle3 import decode as eagle3_decode
from specdraft.stages import eval as eval_stage

MEMORISE_RECIPE = """
name = "memorise"
[data]
num_train = 4
max_prompt_tokens = 80
[gen]
batch_size = 4
max_new_tokens = 24
[train]
draft_vocab_size = 512
ttt_steps = 3
epochs = 40
lr = 3e-3
warmup_steps = 5
batch_tokens = 4096
[eval]
num_prompts = 2
max_new_tokens = 12
dtype = "float32"
"""
# A p-value below this fails a distribution test: a correct sampler fails 1 run in 1000.
P_VALUE_FLOOR = 1e-3


@pytest.fixture(scope="module")
def memorised(tmp_path_factory, target):
    """The run of MEMORISE_RECIPE, trained once and cached like conftest's memorised drafters."""
    from memorised import trained_copy

    return trained_copy(MEMORISE_RECIPE, target, tmp_path_factory)


@pytest.fixture(scope="module")
def engine(memorised):
    from specdraft.methods import load_trained
    from specdraft.run import RunFolder
    from specdraft.stages.gen import select_prompts

    run = RunFolder(memorised)
    recipe = run.recipe()
    drafter, target, _ = load_trained(recipe, run)
    runner = runners.TargetRunner(target, target.load_model("float32"))
    train, _ = select_prompts(recipe, target, "train", 3)
    held_out, _ = select_prompts(recipe, target, "eval", 1)
    return runner, drafter.float(), target, recipe, train + held_out


def chi_square_p(counts: dict[int, int], probs: torch.Tensor, n: int) -> float:
    """Pearson chi-square p-value of observed token counts against probabilities; tokens expected
    fewer than 5 times are pooled into one bin (the test's validity condition)."""
    big = (probs * n >= 5).nonzero().flatten().tolist()
    observed = [counts.get(t, 0) for t in big]
    expected = [float(probs[t]) * n for t in big]
    observed.append(n - sum(observed))
    expected.append(n - sum(expected))
    if expected[-1] < 5:  # nothing worth a bin left over: fold it into the largest bin
        observed[0] += observed.pop()
        expected[0] += expected.pop()
    return float(sps.chisquare(observed, expected).pvalue)


def test_tree_visibility_is_ancestors_and_self():
    # root -> 0 -> 2 ; root -> 1 -> 3 -> 4
    t = tree.Tree(tokens=[10, 11, 12, 13, 14], parents=[-1, -1, 0, 1, 3], depths=[1, 1, 2, 2, 3])
    vis = t.visible().int().tolist()
    assert vis[0] == [1, 0, 0, 0, 0, 0]
    assert vis[3] == [1, 1, 0, 1, 0, 0]  # node 2 sees root, node 0, itself
    assert vis[5] == [1, 0, 1, 0, 1, 1]  # node 4 sees root, 1, 3, itself


def test_alpha_inverts_tau_and_bound_is_leviathan():
    for alpha, K in ((0.3, 1), (0.7, 3), (0.9, 7)):
        tau = (1 - alpha ** (K + 1)) / (1 - alpha)
        assert rounds.alpha_from_tau(tau, K) == pytest.approx(alpha, abs=1e-9)
        assert rounds.leviathan_bound(alpha, K, 0.05) == pytest.approx(tau / (K * 0.05 + 1))


def test_rejection_sampling_joint_distribution_is_the_targets():
    """Two draft positions, draft probs depending on the first draft: the first two output tokens
    are jointly distributed as the target's p1(x1) p2(x2 | x1), whatever q is."""
    g = torch.Generator().manual_seed(0)
    V, n = 4, 40_000
    p1 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 2, -1)  # p2[x1] = target's next given x1
    p3 = torch.softmax(torch.randn(V, V, V, generator=g), -1)
    q1 = torch.tensor([0.1, 0.2, 0.3, 0.4])  # far from p1 on purpose
    q2 = torch.softmax(torch.randn(V, V, generator=g), -1)
    counts: dict[int, int] = {}
    accepted = [0, 0, 0]
    for _ in range(n):
        d1 = int(torch.multinomial(q1, 1, generator=g))
        d2 = int(torch.multinomial(q2[d1], 1, generator=g))
        a, nxt = rounds.rejection_sample(torch.stack([p1, p2[d1], p3[d1, d2]]), torch.stack([q1, q2[d1]]), [d1, d2], g)
        accepted[a] += 1
        out = [d1, d2][:a] + [nxt]
        if len(out) == 1:  # the next round starts from x1; its first token is the target's p2(. | x1)
            out.append(int(torch.multinomial(p2[out[0]], 1, generator=g)))
        key = out[0] * V + out[1]
        counts[key] = counts.get(key, 0) + 1
    joint = (p1[:, None] * p2).flatten()
    assert all(accepted), accepted  # rejection, partial and full acceptance all happened
    assert chi_square_p(counts, joint, n) > P_VALUE_FLOOR


@pytest.mark.slow
def test_rejection_sampling_matches_target_on_real_distributions(engine):
    """The target's and the memorised drafter's real next-token distributions (temperature 1): tokens
    from rejection sampling pass a chi-square test against the target's; plain draft samples fail it
    (so the test can tell)."""
    runner, drafter, _, _, prompts = engine
    prompt = prompts[-1]["prompt_ids"]  # held out: the drafter's q differs from the target's p there
    runner.reset()
    logits, aux = runner.forward(prompt)
    x1 = int(logits[-1].argmax())
    state = eagle3_decode.DrafterState(drafter)
    state.advance(aux, prompt[1:] + [x1], 0)
    p_logits, _ = runner.forward([x1])
    p = torch.softmax(p_logits[-1], -1)
    q = rounds.draft_probs(drafter, state.root_logits, 1.0, p.shape[0])
    g = torch.Generator().manual_seed(1)
    n = 20_000
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    counts, naive, kept = {}, {}, 0
    bonus = torch.full_like(p, 1.0 / p.shape[0])  # the token after an accepted draft is not looked at
    for d in drafts:
        a, nxt = rounds.rejection_sample(torch.stack([p, bonus]), q[None], [d], g)
        tok = d if a else nxt
        kept += a
        counts[tok] = counts.get(tok, 0) + 1
        naive[d] = naive.get(d, 0) + 1
    assert 0 < kept < n  # both branches ran
    assert chi_square_p(counts, p, n) > P_VALUE_FLOOR
    assert chi_square_p(naive, p, n) < P_VALUE_FLOOR


@pytest.mark.slow
def test_chain_and_tree_greedy_equal_target_greedy(engine):
    runner, drafter, target, recipe, prompts = engine
    cfg = recipe.eval
    cfg.max_new_tokens = 16
    r = eval_stage.evaluate(runner, drafter, prompts, cfg, target.eos_token_id)
    for name in ("chain", "tree"):
        s = r[name]
        assert s["exact_prompts"] + s["numerical_ties"] == len(prompts)
        assert s["exact_prompts"] >= len(prompts) - 1  # fp32: a tie is rare
        assert sum(s["accepted_length_histogram"]) == s["rounds"]
        assert s["tau"] == pytest.approx(
            sum((a + 1) * c for a, c in enumerate(s["accepted_length_histogram"])) / s["rounds"], abs=1e-3
        )
    # The memorised answers are drafted deep: multi-token acceptance happened in the tree.
    assert sum(r["tree"]["accepted_length_histogram"][2:]) > 0
    assert r["tree"]["tau"] > 1.5 and r["chain"]["tau"] > 1.5
    assert len(r["tree"]["per_position_acceptance"]) == cfg.tree_depth


@pytest.mark.slow
def test_static_engine_decodes_as_the_eager_engine(engine):
    """The static engine (preallocated caches, the accepted tree path kept by an index copy in place: what
    the GPU runs, less the CUDA graphs) gives the eager engine's tokens and accepted lengths, greedy and
    sampled, on a memorised prompt, where tree paths beyond the first child are accepted."""
    runner, drafter, target, recipe, prompts = engine
    static = runners.make_runner(target, runner.model, "static")
    cfg, eos, ids = recipe.eval, target.eos_token_id, prompts[0]["prompt_ids"]
    cfg.max_new_tokens = 12
    r = eval_stage.evaluate(static, drafter, prompts[:1], cfg, eos)  # raises if speculation differs from greedy
    assert r["engine"] == "static"
    assert (
        rounds.greedy(static, ids, cfg.max_new_tokens, eos)[0] == rounds.greedy(runner, ids, cfg.max_new_tokens, eos)[0]
    )
    for name, shape in (
        ("chain", tree.TreeShape.chain(cfg.draft_tokens)),
        ("tree", tree.TreeShape(cfg.tree_topk, cfg.tree_depth, cfg.tree_tokens)),
    ):
        stats = rounds.Stats(shape.depth)
        eagle3_decode.speculative(runner, drafter, ids, cfg.max_new_tokens, eos, shape, stats)
        assert r[name]["exact_prompts"] == 1
        assert r[name]["accepted_length_histogram"] == stats.accepted_hist
    assert sum(r["tree"]["accepted_length_histogram"][2:]) > 0
    sampled = [
        eagle3_decode.speculative_sampled(
            rn, drafter, ids, 8, eos, 3, 1.0, rounds.Stats(3), torch.Generator().manual_seed(0)
        )
        for rn in (runner, static)
    ]
    assert sampled[0] == sampled[1]


@pytest.mark.slow
def test_sampled_decoder_runs_and_counts(engine):
    runner, drafter, target, _, prompts = engine
    stats = rounds.Stats(3)
    g = torch.Generator().manual_seed(0)
    out = eagle3_decode.speculative_sampled(
        runner, drafter, prompts[0]["prompt_ids"], 10, target.eos_token_id, 3, 1.0, stats, g
    )
    assert 1 <= len(out) <= 10 and all(0 <= t < target.vocab_size for t in out)
    assert stats.rounds > 0 and sum(stats.accepted_hist) == stats.rounds
    # each round yields accepted + 1 tokens; the prefill yields the first
    assert 1 + sum((a + 1) * c for a, c in enumerate(stats.accepted_hist)) >= len(out)


@pytest.mark.slow
def test_eval_cli_on_a_prompts_file_reports_categories(memorised, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "What is 2 + 2?", "category": "math"},
                {"prompt": "Name a color.", "category": "chat"},
            ]
        )
        + "\n"
    )
    assert (
        main(
            [
                "eval",
                "--run",
                str(memorised),
                "--prompts-file",
                str(prompts),
                "--max-new-tokens",
                "6",
                "--temperature",
                "1.0",
            ]
        )
        == 0
    )
    r = json.loads((memorised / "eval" / "report.json").read_text())
    assert r["prompts"] == 2 and set(r["per_category"]) == {"math", "chat"}
    assert r["tree"]["exact_prompts"] + r["tree"]["numerical_ties"] == 2
    assert r["chain"]["leviathan_bound"] > 0 and r["sampled"]["rounds"] > 0
    md = (memorised / "eval" / "report.md").read_text()
    assert "| tree |" in md and "| math |" in md
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": 3}\n')
    assert main(["eval", "--run", str(memorised), "--prompts-file", str(bad)]) == 2


def test_engine_choice(target):
    """auto is eager off CUDA; the static engines refuse what they cannot run exactly or at all."""
    model = torch.nn.Module()
    model.model = torch.nn.Linear(1, 1)  # where TargetRunner finds the decoder
    assert type(runners.make_runner(target, model, "auto")) is runners.TargetRunner
    for engine, why in (("jit", "expected one of"), ("cuda-graphs", "CUDA device")):
        with pytest.raises(ValueError, match=why):
            runners.make_runner(target, model, engine)
    sliding = SimpleNamespace(family=dataclasses.replace(target.family, attention="gqa+sliding"))
    with pytest.raises(ValueError, match="needs the eager engine"):
        runners.make_runner(sliding, model, "static")


@pytest.mark.slow
def test_steps_for_cuda_graphs_never_read_the_device_on_the_host(engine):
    """What the GPU captures as CUDA graphs (decode steps, tree drafting, the drafter's step 0) runs here
    under modes that refuse every host read and every tensor of host data (tests/hostops.py)."""
    runner, drafter, target, _, prompts = engine
    static = runners.make_runner(target, runner.model, "static")
    static.graphs = checked = CheckedGraphs(static.device)
    ids, eos = prompts[0]["prompt_ids"], target.eos_token_id
    rounds.greedy(static, ids, 4, eos)
    for shape in (tree.TreeShape.chain(3), tree.TreeShape(4, 3, 8)):
        eagle3_decode.speculative(static, drafter, ids, 6, eos, shape, rounds.Stats(shape.depth))
    eagle3_decode.speculative_sampled(
        static, drafter, ids, 6, eos, 3, 1.0, rounds.Stats(3), torch.Generator().manual_seed(0)
    )
    assert {k[0] for k in checked.keys} == {"target", "draft", "advance", "step"}


def test_failed_graph_capture_falls_back_loudly(capsys):
    """Where a capture fails (here: no CUDA at all) the step runs eagerly, now and after, and says why."""
    from specdraft.decoding.static import StepGraphs

    graphs = StepGraphs(torch.device("cpu"), enabled=True)
    for _ in range(2):
        assert graphs(("step", 1), lambda x: x * 2, torch.ones(3)).tolist() == [2.0] * 3
    assert not graphs.enabled and graphs.failure.startswith("capture of ('step', 1) failed")
    assert capsys.readouterr().err.count("engine: CUDA graph capture of") == 1


def test_bad_prompts_file_names_file_and_line(tmp_path, target):
    from specdraft.config import Recipe

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    recipe = Recipe()
    recipe.eval.prompts_file = str(bad)
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid JSON"):
        eval_stage.load_prompts(recipe, target)


def test_round_clock_charges_a_host_read_to_the_host_not_to_the_part_around_it(monkeypatch):
    """RoundClock (round_cost's parts): a host read marked inside drafting is charged to `host` and taken
    out of `draft`; outside a decode's timing, host_read times nothing."""
    from specdraft.decoding import clock as clock_mod

    now = [0.0]
    monkeypatch.setattr(clock_mod, "perf_counter", lambda: now[0])
    seconds = dict.fromkeys(clock_mod.ROUND_PARTS, 0.0)
    clock = clock_mod.RoundClock(torch.device("cpu"), seconds)
    with clock_mod.host_read():
        now[0] += 5.0  # no decode running: not charged
    with clock_mod.timing(clock), clock("draft"):
        now[0] += 2.0
        with clock_mod.host_read():
            now[0] += 3.0
        now[0] += 1.0
    assert seconds["draft"] == 3.0 and seconds["host"] == 3.0
    assert clock_mod._CLOCK.get() is None
