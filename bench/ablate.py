"""The recipe's ablations: one drafter per changed default, all scored on the same held-out samples.

    python bench/ablate.py RUN [--fp8-run RUN8] [--source-run RUNS] [--samples 3000] [--parallel 8]
                           [--deadline SECONDS] [--only a,b] [--skip c] [--out bench/results/ablations-h200.jsonl]
    python bench/ablate.py --report bench/results/ablations-h200.jsonl   # the Markdown table only

RUN is a run whose gen, render and extract stages are done (the target's own answers, bf16 hidden
states). Every variant is the run's recipe with one thing changed (`VARIANTS`), trained by the normal
`specdraft train` in its own folder under RUN/ablations/ that links RUN's hidden states; the data
variants link RUN8 (the same tokens extracted with fp8 storage) or RUNS (the source's original
answers instead of the target's). All but the data-size variants train on the first `--samples`
samples of the seeded training split, so they see the same data.

Several variants train at once on one GPU (`--parallel`): an eager drafter step is launch-bound, so
processes side by side fill the GPU. A variant cut off by `--deadline` resumes from its `latest`
checkpoint on the next call. Then every variant's chosen checkpoint is scored by the same evaluator
on RUN's held-out samples: the simulated chain acceptance length (training-time test rolled out 7
steps, teacher-forced context) at K = 3 and K = 7, and its conditional acceptance per position. One
JSON line per variant goes to --out, and bench/ablations.md is written from all lines there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft import environment  # noqa: E402
from specdraft.run import RunFolder, write_json  # noqa: E402

# Every variant is scored by rolling its drafter out this many steps; tau at 3 is what vLLM serves
# with 3 speculative tokens.
EVAL_STEPS = 7
SERVED_K = 3
# Seconds between checks of the running trainings, and the grace a trainer gets to stop on SIGTERM.
POLL_S = 5
STOP_GRACE_S = 20


@dataclass
class Variant:
    name: str
    factor: str  # the row group in the table
    label: str  # what this row sets
    overrides: dict = field(default_factory=dict)
    data: str = "base"  # "base" (RUN), "fp8" (RUN8) or "source" (RUNS)
    all_samples: bool = False  # the data-size variants set their own sample count
    is_run: bool = False  # trained in RUN itself: the recipe's own drafter (all samples, defaults)


def variants(samples: int) -> list[Variant]:
    """In order of importance: a deadline cuts the last ones."""
    return [
        # The longest first: RUN's own drafter trains on every sample.
        Variant("data-all", "data size", "all (the recipe drafter, trained in RUN)", all_samples=True, is_run=True),
        Variant("base", "base", "recipe defaults"),
        # The last default flipped (2026-12-03, evening: the target's frozen head won by 0.111) checked
        # first, then the head trained on; with no head parameters to learn, a larger draft vocabulary
        # may no longer lose (it did with a random head: 4 K won), so the vocabularies come next.
        Variant("head-random", "lm_head init", "random, trained", {"train.lm_head_init": "random"}),
        Variant("head-target", "lm_head init", "the target's, trained on", {"train.lm_head_init": "target"}),
        Variant("vocab-16k", "draft vocab", "16 K", {"train.draft_vocab_size": 16384}),
        Variant("vocab-full", "draft vocab", "full", {"train.draft_vocab_size": 0}),
        Variant("vocab-8k", "draft vocab", "8 K", {"train.draft_vocab_size": 8192}),
        # Fewer trainable parameters may want another learning rate or more TTT steps.
        Variant("lr-3e-3", "learning rate", "3e-3", {"train.lr": 3e-3}),
        Variant("ttt-5", "TTT steps", "5", {"train.ttt_steps": 5}),
        # The rest of the studied factors, then what speculators does differently.
        Variant("norms-off", "EAGLE-3.1 norms", "off", {"train.fc_norm": False, "train.norm_output": False}),
        Variant("source", "answers", "ShareGPT's own (not regenerated)", data="source"),
        Variant("data-1k", "data size", "1 K", {"train.max_samples": 1000}, all_samples=True),
        Variant("fp8", "hidden storage", "fp8 e4m3", data="fp8"),
        Variant("ttt-7", "TTT steps", "7", {"train.ttt_steps": 7}),
        Variant("ttt-1", "TTT steps", "1", {"train.ttt_steps": 1}),
        Variant(
            "muon",
            "optimizer",
            "Muon, weight decay 0.1 (speculators')",
            {"train.optimizer": "muon", "train.weight_decay": 0.1},
        ),
        Variant("residual-normed", "residual", "after hidden_norm", {"train.norm_before_residual": True}),
        Variant("wd-0.1", "weight decay", "0.1", {"train.weight_decay": 0.1}),
        Variant("loss-kl", "loss", "KL", {"train.loss": "kl"}),
        Variant("loss-lk", "loss", "LK (acceptance)", {"train.loss": "lk"}),
        Variant("vocab-32k", "draft vocab", "32 K", {"train.draft_vocab_size": 32768}),
        Variant("lr-3e-4", "learning rate", "3e-4", {"train.lr": 3e-4}),
        Variant("noise", "hidden noise", "±0.2 RMS", {"train.hidden_noise": 0.2}),
    ]


def loader_workers(parallel: int) -> int:
    """DataLoader workers of each of `parallel` trainings: the machine's cores shared out. One worker
    feeds ~4-10 steps/s of 8,192-token rows (37 MB each), while the drafter alone runs ~25 steps/s on an
    H200 (bench/results/smollm2-h200.jsonl): with one worker each, the ablations waited on the loader."""
    return max(1, (os.cpu_count() or 2) // parallel - 1)


def train_command(v: Variant, folder: Path, samples: int, extra: list[str], workers: int = 1) -> list[str]:
    """`specdraft train` of the variant; RUN's own training keeps its recipe as it is."""
    cmd = [sys.executable, "-m", "specdraft.cli", "train", "--run", str(folder)]
    if v.is_run:
        return cmd
    sets = {"train.max_samples": samples, "train.loader_workers": workers, **v.overrides}
    for k, val in sets.items():
        cmd += ["--set", f"{k}={json.dumps(val) if isinstance(val, bool) else val}"]
    return cmd + [a for item in extra for a in ("--set", item)]


def extracted(run: Path | None) -> bool:
    if run is None or not (run / "manifest.json").exists():
        return False
    return json.loads((run / "manifest.json").read_text())["stages"].get("extract", {}).get("state") == "done"


def train_done(folder: Path) -> bool:
    m = json.loads((folder / "manifest.json").read_text())
    return m["stages"].get("train", {}).get("state") == "done"


def train_all(jobs: list[tuple[Variant, Path, list[str]]], parallel: int, deadline: float, on_done=None) -> None:
    """Run the trainings, `parallel` at a time, until all are done or the deadline; cut ones are
    stopped with SIGTERM (they resume from `latest` next time). `on_done(variant, folder)` runs as each
    finishes (the scoring, while the others train)."""
    pending = [(v, f, c) for v, f, c in jobs if not train_done(f)]
    running: list[tuple[Variant, Path, subprocess.Popen, float]] = []
    while pending or running:
        while pending and len(running) < parallel and time.time() < deadline:
            v, folder, cmd = pending.pop(0)
            log = open(folder / "train.log", "a")
            print(f"ablate: start {v.name}: {' '.join(cmd[3:])}", flush=True)
            running.append(
                (
                    v,
                    folder,
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                    time.time(),
                )
            )
        if not running:
            break
        time.sleep(POLL_S)
        for item in list(running):
            v, folder, p, t0 = item
            if p.poll() is not None:
                running.remove(item)
                print(f"ablate: {v.name} exited {p.returncode} after {time.time() - t0:.0f} s", flush=True)
                if p.returncode == 0 and on_done is not None:
                    on_done(v, folder)
        if time.time() >= deadline:
            for v, _, p, _ in running:
                os.killpg(p.pid, signal.SIGTERM)
                print(f"ablate: {v.name} cut at the deadline (resumes from latest)", flush=True)
            for _, _, p, _ in running:
                try:
                    p.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
            return


class Scorer:
    """Scores checkpoints on the base run's held-out samples: the target's weights, the held-out rows and
    the target's top tokens there are loaded once and shared by every variant. With `decode_prompts`,
    also by the reference decoder on that many held-out prompts (the eval stage's engine, chain and tree
    shapes): the simulated τ ranks chains only, and a small draft vocabulary that wins it lost in the
    tree on the real decoder (bench/ablations.md)."""

    def __init__(self, base_run: Path, device, decode_prompts: int = 0):
        from specdraft.drafters.common import pack
        from specdraft.hidden.store import HiddenStore
        from specdraft.targets import Target
        from specdraft.training import split_holdout, target_top_tokens

        recipe = RunFolder(base_run).recipe()
        self.cfg = recipe.train
        self.source = HiddenStore(RunFolder(base_run).hidden)
        self.target = Target(recipe.target.model, self.source.aux_layer_ids)
        self.embed, self.head = self.target.embed_weight().float(), self.target.head_weight()
        _, self.held = split_holdout(len(self.source), self.cfg.holdout, self.cfg.seed)
        self.tops = target_top_tokens(self.source, self.head, self.held, device)
        lengths = [len(self.source.tokens(i)[0]) for i in range(len(self.source))]
        self.rows = pack(self.held, lengths, self.cfg.batch_tokens)
        self.device = device
        self.prompts = []
        if decode_prompts:
            from specdraft.stages.eval import decode_capacity, load_prompts, make_runner

            self.eval_cfg = dataclasses.replace(recipe.eval, num_prompts=decode_prompts)
            model = self.target.load_model(self.eval_cfg.dtype, device=str(device))
            self.runner = make_runner(self.target, model, self.eval_cfg.engine)
            self.prompts = load_prompts(dataclasses.replace(recipe, eval=self.eval_cfg), self.target)
            self.runner.reserve(decode_capacity(self.prompts, self.eval_cfg))

    def decode(self, drafter) -> dict:
        """τ of the reference decoder, chain and tree, over the held-out prompts (greedy)."""
        import torch

        from specdraft.decoding.rounds import Stats
        from specdraft.decoding.tree import TreeShape
        from specdraft.methods.eagle3.decode import speculative

        c = self.eval_cfg
        drafter = drafter.to(self.device, getattr(torch, c.dtype))
        # The tree is the recipe's, which changes between tables: each row says which it was.
        out = {
            "decode_prompts": len(self.prompts),
            "decode_new_tokens": c.max_new_tokens,
            "decode_tree": [c.tree_topk, c.tree_depth, c.tree_tokens],
        }
        for name, shape in (
            ("chain", TreeShape.chain(c.draft_tokens)),
            ("tree", TreeShape(c.tree_topk, c.tree_depth, c.tree_tokens)),
        ):
            stats = Stats(shape.depth)
            for p in self.prompts:
                speculative(
                    self.runner, drafter, p["prompt_ids"], c.max_new_tokens, self.target.eos_token_id, shape, stats
                )
            summary = stats.summary()
            out[f"decoded_tau_{name}"] = summary["tau"]
            out[f"decoded_per_position_{name}"] = summary["per_position_acceptance"]
        return out

    def __call__(self, v: Variant, folder: Path) -> dict:
        import math

        from specdraft.methods import load_checkpoint
        from specdraft.methods.eagle3.objective import TTT
        from specdraft.training import autocast_for, evaluate

        run = RunFolder(folder)
        cfg = run.recipe().train
        ckpt = chosen_checkpoint(folder)
        row = row_head(v)
        stage = run.stage("train") or {}
        row["state"] = stage.get("state", "not started")
        if ckpt is None:
            return row
        drafter, meta = load_checkpoint(ckpt, self.embed)
        model = TTT(drafter, self.head[drafter.t2d].float(), EVAL_STEPS, cfg.step_weight_decay, cfg.loss).to(
            self.device
        )
        cfg_eval = dataclasses.replace(self.cfg, ttt_steps=EVAL_STEPS)
        _, autocast = autocast_for(cfg, self.device)
        s = evaluate(model, self.source, self.rows, self.tops, cfg_eval, self.device, autocast, EVAL_STEPS)
        alpha = s["cond_accept"]

        def tau(k: int) -> float:  # chain drafting of k tokens: 1 + sum over depths of P(accepted through it)
            return round(1 + sum(math.prod(alpha[: j + 1]) for j in range(k)), 4)

        log = RunFolder(folder).train_log
        steps = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        last_train = next((r for r in reversed(steps) if r["kind"] == "train"), {})
        metrics, counts = stage.get("metrics", {}), stage.get("counts", {})
        row.update(
            {
                "checkpoint": ckpt.name,
                "step": meta.get("step"),
                "steps": counts.get("steps"),
                "samples": counts.get("samples"),
                "heldout_samples": len(self.held),
                f"tau_{SERVED_K}": tau(SERVED_K),
                f"tau_{EVAL_STEPS}": tau(EVAL_STEPS),
                "cond_accept": alpha,
                "acc0": s["acc"][0],
                "train_acc0": (last_train.get("acc") or [None])[0],
                "train_seconds": round(stage.get("seconds") or 0, 1),
                "tokens_per_s": metrics.get("tokens_per_s"),
                "phase_seconds": metrics.get("phase_seconds"),  # where train_seconds went (start-up, steps, ...)
                "trainable_params": counts.get("trainable_params"),
                "vocab_coverage": metrics.get("vocab_coverage"),
                # what this drafter trained with, so rows of tables with other defaults can still be told apart
                "train": dataclasses.asdict(cfg),
            }
        )
        if self.prompts:
            row.update(self.decode(drafter))
        return row


SCORE_FILE = "ablation_score.json"


def row_head(v: Variant) -> dict:
    """The fields of a variant's row that say what it is, scored or not."""
    return {"name": v.name, "factor": v.factor, "label": v.label, "overrides": v.overrides, "data": v.data}


def chosen_checkpoint(folder: Path) -> Path | None:
    """The checkpoint a variant is scored by: best, else final, else latest (a cut one); None if none."""
    from specdraft.stages.train import COMPLETE

    return next(
        (
            RunFolder(folder).checkpoint(n)
            for n in ("best", "final", "latest")
            if (RunFolder(folder).checkpoint(n) / COMPLETE).exists()
        ),
        None,
    )


def score_key(folder: Path, decode_prompts: int) -> dict:
    """What a variant's score depends on: its train state, the checkpoint scored and its step."""
    ckpt = chosen_checkpoint(folder)
    step = json.loads((ckpt / "config.json").read_text()).get("step") if ckpt else None
    return {
        "state": (RunFolder(folder).stage("train") or {}).get("state"),
        "checkpoint": ckpt.name if ckpt else None,
        "step": step,
        "decode_prompts": decode_prompts,
    }


def cached_score(folder: Path, key: dict) -> dict | None:
    path = folder / SCORE_FILE
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    return saved["row"] if saved["key"] == key else None


READINGS = "## Readings"


def report(lines: list[dict], path: Path, hardware: str, parallel: int) -> None:
    """bench/ablations.md: one row per variant, grouped by factor, the best of each group in bold. What a
    person wrote under READINGS in the file before is kept: the table is rewritten, the reading of it is not."""
    key = f"tau_{SERVED_K}"
    old = path.read_text() if path.exists() else ""
    readings = old[old.index(READINGS) :] if READINGS in old else ""
    sets = lines[0].get("sets") if lines else None
    base = next((r for r in lines if r["name"] == "base" and key in r), None)
    decoded = any("decoded_tau_chain" in r for r in lines)
    # Calls of one table may run different counts side by side (each row records its own).
    counts = sorted({r["parallel"] for r in lines if r.get("parallel")}) or [parallel]
    side = (
        f"{counts[0]} trainings side by side"
        if len(counts) == 1
        else f"{counts[0]} to {counts[-1]} trainings side by side (each row's count is `parallel` in the JSONL)"
    )
    out = [
        "# Ablations of the smollm2-h200 recipe",
        "",
        "Written by `bench/ablate.py` from `bench/results/ablations-h200.jsonl`. Each row is the recipe "
        "with one thing changed, scored on the same held-out samples of the base run (the target's own "
        f"answers): simulated chain acceptance length τ with K = {SERVED_K} (what vLLM serves with 3 "
        f"speculative tokens) and K = {EVAL_STEPS}, from the training-time test rolled out with "
        "teacher-forced context. These run above the real decoder's τ (rounds start after a rejection, at "
        "harder tokens); they rank the variants, and the recipe drafter's real τ is in "
        "`bench/results/speedup-h200.jsonl`.",
        "",
        f"Hardware: {hardware}; {side} on the GPU, so seconds are shared-GPU "
        "wall time (compare them within this table only)."
        + (f" Every variant but RUN's own drafter also had `{' '.join(sets)}`." if sets else ""),
        "",
        f"| factor | setting | τ K={SERVED_K} | τ K={EVAL_STEPS} | Δ τ{SERVED_K} vs base | cond. acceptance 0/1/2 "
        "| held-out acc0 | train acc0 | samples | steps | train s | trainable M |"
        + (" decoded τ chain / tree |" if decoded else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if decoded else ""),
    ]
    groups: dict[str, list[dict]] = {}
    for r in lines:
        groups.setdefault(r["factor"], []).append(r)
    for factor, rows in groups.items():
        scored = [r for r in rows if key in r]
        best = max([r[key] for r in scored] + ([base[key]] if base and factor != "base" else []), default=None)
        for r in rows:
            if key not in r:
                # A variant trained to its end but cut before scoring is not "not trained".
                why = r["state"] if r["state"].startswith("not scored") else f"not trained ({r['state']})"
                out.append(
                    f"| {factor} | {r['label']} | {why} |  |  |  |  |  |  |  |  |  |" + (" |" if decoded else "")
                )
                continue
            cell = f"**{r[key]:.3f}**" if r[key] == best and factor != "base" else f"{r[key]:.3f}"
            delta = f"{r[key] - base[key]:+.3f}" if base else ""
            cond = " / ".join(f"{a:.3f}" for a in r["cond_accept"][:3])
            done = "" if r["state"] == "done" else f" ({r['state']}, step {r['step']})"
            tp = f"{r['trainable_params'] / 1e6:.1f}" if r.get("trainable_params") else ""
            train_acc = "" if r["train_acc0"] is None else f"{r['train_acc0']:.3f}"
            secs = f"{r['train_seconds']:.0f}" if r["train_seconds"] else ""
            out.append(
                f"| {factor} | {r['label']}{done} | {cell} | {r[f'tau_{EVAL_STEPS}']:.3f} | {delta} | {cond} "
                f"| {r['acc0']:.3f} | {train_acc} | {r['samples'] or ''} | {r['steps'] or ''} | {secs} "
                f"| {tp} |"
                + (
                    f" {r['decoded_tau_chain']:.3f} / {r['decoded_tau_tree']:.3f} |"
                    if "decoded_tau_chain" in r
                    else " |"
                    if decoded
                    else ""
                )
            )
    cut = [r for r in lines if r.get("state") != "done"]
    out += ["", "A bold τ is the best of its factor, the base (recipe defaults) included."]
    if decoded:
        d = next(r for r in lines if "decoded_tau_chain" in r)
        out += [
            "",
            f"Decoded τ: the reference decoder (greedy, the eval stage's engine) on {d['decode_prompts']} held-out "
            f"prompts × {d['decode_new_tokens']} tokens, chain of K = {SERVED_K} and the recipe's tree"
            + (" (top-{}, depth {}, {} tokens)".format(*d["decode_tree"]) if "decode_tree" in d else "")
            + ": what a served "
            "drafter reaches, where the simulated τ only ranks chains.",
        ]
    if cut:
        out += [
            "",
            f"Partial: {len(cut)} of {len(lines)} variants did not finish (a setting marked with its state and "
            "step was scored at that step; 'not trained' ones have no checkpoint; 'not scored' ones trained but "
            "the deadline came before their score). Compare partial rows only with rows at the same step.",
        ]
    out.append("")
    if readings:
        out += [readings.rstrip(), ""]
    path.write_text("\n".join(out))
    print(f"ablate: wrote {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", type=Path)
    p.add_argument("--fp8-run", type=Path, help="the same tokens extracted with store_dtype fp8_e4m3")
    p.add_argument("--source-run", type=Path, help="a run of the source's own answers (gen.answers=source)")
    p.add_argument("--samples", type=int, default=3000, help="training samples of every non-data-size variant")
    # 8 side by side on one H200 (16 cores) ran each far slower than one alone (bench/ablations.md).
    p.add_argument("--parallel", type=int, default=2, help="trainings at once on the device")
    p.add_argument("--deadline", type=float, default=0, help="seconds from now; 0: none")
    p.add_argument("--only", default="", help="comma-separated variant names")
    p.add_argument(
        "--skip",
        default="",
        help="comma-separated variant names left out (data-all: RUN's own "
        "drafter, when it is already trained elsewhere)",
    )
    p.add_argument("--set", action="append", default=[], help="SECTION.FIELD=VALUE for every variant")
    p.add_argument(
        "--decode-prompts",
        type=int,
        default=0,
        help="also decode this many held-out prompts "
        "with each drafter (reference decoder, chain and tree; ~15 s a variant for 16 on an H200)",
    )
    p.add_argument(
        "--score-reserve",
        type=float,
        default=0,
        help="seconds before the deadline that training stops, left for scoring (rows scored before are reused)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/ablations-h200.jsonl"))
    p.add_argument("--markdown", type=Path, default=Path("bench/ablations.md"))
    p.add_argument("--report", type=Path, help="only rewrite the Markdown from this JSONL")
    args = p.parse_args()
    hardware = environment.hardware_line()
    if args.report:
        lines = [json.loads(x) for x in args.report.read_text().splitlines() if x.strip()]
        report(lines, args.markdown, lines[0].get("hardware", hardware), lines[0].get("parallel", args.parallel))
        return 0
    import torch

    deadline = time.time() + args.deadline if args.deadline else float("inf")
    data_runs = {"base": args.run, "fp8": args.fp8_run, "source": args.source_run}
    if not extracted(args.run):
        raise SystemExit(f"ablate: {args.run}: gen, render and extract must be done first")
    chosen = [
        v
        for v in variants(args.samples)
        if (not args.only or v.name in args.only.split(",")) and v.name not in args.skip.split(",")
    ]
    jobs = []
    for v in chosen:
        if not extracted(data_runs[v.data]):
            print(f"ablate: skip {v.name} (no extracted --{v.data}-run)")
            continue
        folder = args.run if v.is_run else args.run / "ablations" / v.name
        if not v.is_run:
            RunFolder(folder).share_data(data_runs[v.data], through="extract")
        jobs.append(
            (
                v,
                folder,
                train_command(v, folder, 0 if v.all_samples else args.samples, args.set, loader_workers(args.parallel)),
            )
        )
    scorer = None

    def score(v: Variant, folder: Path) -> dict | None:
        """The variant's row: kept beside its checkpoint, so a later call scores only what is new."""
        nonlocal scorer
        key = score_key(folder, args.decode_prompts)
        row = cached_score(folder, key)
        if row is None and time.time() < deadline:
            scorer = scorer or Scorer(
                args.run, torch.device("cuda" if torch.cuda.is_available() else "cpu"), args.decode_prompts
            )
            row = scorer(v, folder)
            write_json(folder / SCORE_FILE, {"key": key, "row": row})
        return row

    # Each variant is scored as it finishes; training stops `--score-reserve` seconds before the deadline,
    # left for scoring the variants cut there.
    train_all(jobs, args.parallel, deadline - args.score_reserve, on_done=score)
    lines = []
    for v, folder, _ in jobs:
        row = score(v, folder)
        if row is None:
            row = {**row_head(v), "state": "not scored (deadline)"}
        row.update({"hardware": hardware, "parallel": args.parallel, "sets": args.set})
        lines.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in lines))
    report(lines, args.markdown, hardware, args.parallel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
