"""specdraft's command line: one subcommand per stage, each usable alone on a run folder.

    specdraft demo                         # every stage on the embedded default recipe
    specdraft train --run runs/demo --epochs 3
    specdraft eval --set eval.num_prompts=8

A stage reads the recipe recorded in the run's manifest (or --recipe for a new run); the stage's own
fields are flags (`--epochs`), any field of any stage can be set with `--set section.field=value`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import time
import typing
from urllib.parse import urlsplit

from specdraft import environment
from specdraft.config import apply_sets, load_recipe, stage_fields
from specdraft.run import DEFAULT_RECIPE, PIPELINE, STAGES, open_run


def _flag_help(tp) -> str:
    name = getattr(tp, "__name__", str(tp))
    if typing.get_origin(tp) is list:
        name = "comma-separated list"
    if tp is dict or typing.get_origin(tp) is dict:
        name = "json object"
    return name


class _Parser(argparse.ArgumentParser):
    """argparse's own errors as specdraft's one error line (after the usage), exit code 2."""

    def error(self, message):
        self.print_usage(sys.stderr)
        command = self.prog.removeprefix("specdraft").strip()
        self.exit(2, f"specdraft: error: {command + ': ' if command else ''}{message}\n")


def _positive(kind):
    """An argparse type: a number of `kind` above zero."""

    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def _levels(text: str) -> list[int]:
    """Comma-separated concurrency levels, each above zero."""
    try:
        levels = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated whole numbers: {text!r}") from None
    if min(levels) <= 0:
        raise argparse.ArgumentTypeError(f"levels must be above 0: {text!r}")
    return levels


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"not an http:// or https:// URL: {text!r}")
    if "@" in urlsplit(text).netloc:  # httpx would send it as a header, and the report records the URL
        raise argparse.ArgumentTypeError(
            "a user or password in the URL would be written in the report; give "
            "the key in an environment variable (gen.api_key_env)"
        )
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdraft", description="Train and prove speculative-decoding drafters (EAGLE-3, DFlash).")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--recipe", help=f"a recipe name or .toml path (new runs default to {DEFAULT_RECIPE})")
        # --run-dir for torchrun, whose own parser takes `--run` as an abbreviation of its --run-path.
        p.add_argument("--run", "--run-dir", dest="run", help="the run folder (default runs/<recipe name>)")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.FIELD=VALUE",
            help="override any recipe field; repeatable",
        )

    for stage in PIPELINE:
        name, section = stage.name, stage.section
        p = sub.add_parser(name, help=f"run the {name} stage on a run folder")
        common(p)
        for field_name, tp in stage_fields(section):
            # A bool flag alone (`--self-instruct`) means true.
            bare = {"nargs": "?", "const": "true"} if tp is bool else {}
            p.add_argument(
                f"--{field_name.replace('_', '-')}",
                dest=f"{section}.{field_name}",
                default=None,
                metavar=_flag_help(tp).upper(),
                **bare,
            )
        if name == "gen":
            p.add_argument(
                "--endpoint",
                dest="gen.endpoints",
                action="append",
                metavar="URL",
                help="an OpenAI-compatible server to ask; repeatable (none: in-process)",
            )
    p = sub.add_parser("doctor", help="check an exported drafter folder for the failures that load but accept nothing")
    p.add_argument("folder", help="a drafter folder (speculators or flat format)")
    p.add_argument("--target", help="the target it drafts for (default: the run's recipe)")
    p.add_argument("--run", help="the run it came from (default: the run the folder is inside)")
    p.add_argument(
        "--no-measure",
        action="store_true",
        help="skip the checks that run the target on held-out conversations (targets too big for here)",
    )
    p = sub.add_parser(
        "import",
        help="a published drafter (EAGLE-3: speculators or flat, midlayer.* or layers.0.*; "
        "DFlash: vLLM's or speculators') -> a specdraft checkpoint, checked against "
        "the target",
    )
    common(p)
    p.add_argument("folder", help="the drafter folder (config.json + safetensors)")
    p.add_argument("--out", help="write a bare checkpoint folder here instead of into a run")
    p.add_argument("--target", help="the target it drafts for (default: the recipe's)")
    p = sub.add_parser("demo", help="run every stage on the embedded default (SmolLM2 + ShareGPT, CPU)")
    common(p)
    p = sub.add_parser("plan", help="the disk, memory and time bill of a recipe or run, from the target's config")
    p.add_argument("spec", help="a recipe name or .toml path, or a run folder (its plan is kept in its manifest)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override any recipe field; repeatable",
    )
    p.add_argument("--target", help="the target's config.json, or a folder with one (default: the recipe's)")
    p.add_argument(
        "--tokens-per-sample", type=_positive(int), help="assumed tokens per sample when none are rendered yet"
    )
    p.add_argument("--gpus", type=_positive(int), help="GPUs to plan for (default: those of this machine)")
    p.add_argument(
        "--gpu-memory-gib", type=_positive(float), help="memory per GPU to plan for (default: this machine's)"
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="bill the CPU by FLOPs from a reference machine instead of timing a few steps here",
    )
    p = sub.add_parser("status", help="write STATUS.md: the state of a run, from its manifest")
    p.add_argument("run", help="the run folder")
    p.add_argument("--json", action="store_true", help="print the status as JSON instead of Markdown")
    p = sub.add_parser("bench", help="benchmark a served endpoint, or compare vLLM configurations it starts")
    common(p)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", type=_url, help="an OpenAI-compatible server URL (vLLM, SGLang) to sweep as it is")
    where.add_argument("--compare", help="start vLLM per configuration: e.g. none,ngram:3,eagle3:1,eagle3:3")
    p.add_argument("--drafter", help="the EAGLE-3 drafter folder (default: the run's export/vllm)")
    p.add_argument("--name", default="endpoint", help="the endpoint's label in the report")
    p.add_argument("--concurrency", type=_levels, help="comma-separated levels (default 1, 2, 4 … --max-concurrency)")
    p.add_argument("--max-concurrency", type=_positive(int), default=128)
    p.add_argument("--requests", type=_positive(int), default=32, help="requests per level (at least the concurrency)")
    p.add_argument(
        "--duration", type=_positive(float), default=120.0, help="seconds per level before no new request starts"
    )
    p.add_argument("--max-tokens", type=_positive(int), default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--prompts", type=_positive(int), default=None, help="held-out prompts to cycle (default eval.num_prompts)"
    )
    p.add_argument("--out", help="report folder (default runs/<name>/eval)")
    return parser


def _open(args):
    flags = {dest: value for dest, value in vars(args).items() if "." in dest}
    # A stage's `preflight(recipe)` refuses what must not even be recorded (a key pasted where a variable's
    # name belongs), before the run folder is written; the demo runs every stage, so it checks them all.
    names = [s.name for s in PIPELINE] if args.command == "demo" else [args.command]
    checks = [getattr(importlib.import_module(STAGES[n].module), "preflight", None) for n in names if n in STAGES]

    def check(recipe):
        for preflight in filter(None, checks):
            preflight(recipe)

    return open_run(args.recipe, args.run, args.set, flags, check=check)


def _run_stage(name: str, recipe, folder) -> dict:
    """Run a stage: first the temporaries a killed run of it left (rank 0 of a torchrun alone, the one
    process that writes the run); its record, its outputs and the run's recipe change only when it
    succeeds (RunFolder.record); a failure is recorded beside the last good record."""
    module = importlib.import_module(STAGES[name].module)
    writer = os.environ.get("RANK", "0") == "0"
    if writer:
        folder.clear_temporaries(name)
    try:
        return module.run(recipe, folder)
    except BaseException as e:
        folder.record(name, state="failed", extra={"error": f"{type(e).__name__}: {e}".strip().rstrip(":")})
        if writer:
            with contextlib.suppress(OSError):  # never in place of the stage's own error
                folder.clear_temporaries(name)
        raise
    finally:
        from specdraft.stages.status import after_stage

        after_stage(name, recipe, folder)


# The demo's promise: every stage within 30 minutes. The stages get 85 % of it: the calibration, model
# loads, render and export take the rest.
DEMO_BUDGET_S = 30 * 60
DEMO_STAGE_SHARE = 0.85


def size_demo(recipe, folder):
    """Before gen: the demo's recipe shrunk to fit its budget on this machine (billing.size_to_budget over
    a calibration of the real work here), the choice printed and kept in the manifest as `demo_sizing`."""
    from specdraft.billing import machine_calibration, make_plan, read_target, record, size_to_budget
    from specdraft.targets import resolve_device

    # Sized once, before anything is generated (a resumed demo keeps its size); on a CPU only: the
    # calibration times CPU work.
    if (folder.stage("gen") or {}).get("state") == "done" or resolve_device("auto") != "cpu":
        return recipe
    spec = read_target(recipe.target.model, recipe.target.aux_layer_ids)
    cal = machine_calibration(recipe, spec.target, folder, "measure")
    if cal is None:
        return recipe
    sized, choice = size_to_budget(recipe, spec, cal, DEMO_BUDGET_S * DEMO_STAGE_SHARE)
    changed = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in choice["changed"].items())
    print(
        f"demo: planned {choice['planned_seconds']:,} s for the recipe on {cal.machine} ({cal.dtype}); "
        + (
            f"sized to fit {choice['budget_seconds']:,} s: {changed} (planned {choice['sized_seconds']:,} s"
            + ("" if choice["fits"] else ", still over: the floors keep enough data to learn")
            + ")"
            if choice["changed"]
            else f"fits the {choice['budget_seconds']:,} s budget as it is"
        ),
        flush=True,
    )
    folder.runs_with(sized)  # the run's recipe once gen succeeds
    m = folder.manifest()
    m["demo_sizing"] = choice
    folder.save_manifest(m)
    record(folder, make_plan(sized, folder, calibration="cached"))  # gen's plan, before gen runs
    return sized


def demo(recipe, folder) -> None:
    recipe = size_demo(recipe, folder)
    times = {}
    for name in (s.name for s in PIPELINE):
        print(f"\n== {name} ==", flush=True)
        t0 = time.time()
        _run_stage(name, recipe, folder)
        times[name] = time.time() - t0
        print(f"== {name} done in {times[name]:.0f} s", flush=True)
    m = folder.manifest()["stages"]
    ev = m["eval"]["metrics"]
    print("\n== summary ==")
    for name in times:
        print(f"  {name:8s} {times[name]:7.0f} s")
    print(f"  total    {sum(times.values()):7.0f} s")
    print(f"  report:  {folder.eval / 'report.md'}")
    print(f"  per-position acceptance: {' / '.join(f'{a:.3f}' for a in ev['per_position_acceptance'])}")
    print(f"  tau (chain, K={recipe.eval.draft_tokens}, greedy, exact): {ev['tau']:.3f}")
    commands = m["export"].get("serve_commands") or {"vllm": m["export"]["serve_command"]}
    engines = {"vllm": "vLLM", "sglang": "SGLang"}
    for fmt, command in commands.items():
        print(f"\nnext: serve the drafter with {engines.get(fmt, fmt)}:\n  {command}")


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP), raised like Ctrl-C's KeyboardInterrupt so every `with` and `finally` runs:
    the servers specdraft started are stopped and the stage records itself before the process ends."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def _signals_raise():
    """SIGTERM and SIGHUP raise Terminated for the length of a command (SIGINT already raises
    KeyboardInterrupt) where they would otherwise end the process at once (a signal ignored, as under
    nohup, stays ignored); the handlers before are put back after, as main() also runs inside other programs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {
        s: signal.signal(s, _terminate)
        for s in (signal.SIGTERM, signal.SIGHUP)
        if signal.getsignal(s) is signal.SIG_DFL
    }
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    environment.reuse_freed_memory()  # large tensors come and go every step; page faults cost more
    with _signals_raise():
        try:
            return _command(args)
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            print(
                f"specdraft: interrupted ({signal.Signals(signum).name}): the servers it started are stopped; "
                "rerun the same command to resume",
                file=sys.stderr,
            )
            return 128 + signum
        except (ValueError, OSError, RuntimeError) as e:
            # Expected failures (bad input, missing files, stages out of order) are one line, no traceback.
            if os.environ.get("SPECDRAFT_DEBUG"):
                raise
            print(f"specdraft: error: {e}", file=sys.stderr)
            return 2


def _command(args) -> int:
    if args.command == "doctor":
        from specdraft.stages.doctor import run_doctor

        return run_doctor(args.folder, args.target, args.run, measured=not args.no_measure)
    if args.command == "import":
        from specdraft.stages.import_drafter import run_import

        if args.target:
            args.set.append(f"target.model={args.target}")
        if args.out:
            if args.run:
                raise ValueError("import: give --run or --out, not both")
            recipe = apply_sets(load_recipe(args.recipe or DEFAULT_RECIPE), args.set)
            run_import(args.folder, recipe, out=args.out)
        else:
            run_import(args.folder, *_open(args))
        return 0
    if args.command == "plan":
        from specdraft.stages.plan import run_plan

        return run_plan(
            args.spec,
            overrides=args.set,
            json_out=args.json,
            target=args.target,
            tokens_per_sample=args.tokens_per_sample,
            gpus=args.gpus,
            gpu_memory_gib=args.gpu_memory_gib,
            calibration="cached" if args.no_calibrate else "measure",
        )
    if args.command == "status":
        from specdraft.stages.status import run_status

        return run_status(args.run, json_out=args.json)
    if args.command == "bench":
        from specdraft.stages.bench import run_bench

        return run_bench(args)
    recipe, folder = _open(args)
    if args.command == "demo":
        demo(recipe, folder)
    else:
        _run_stage(args.command, recipe, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
