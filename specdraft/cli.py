"""specdraft's command line: one subcommand per stage, each usable alone on a run folder.

    specdraft demo                         # every stage on the embedded default recipe
    specdraft train --run runs/demo --epochs 3
    specdraft eval --set eval.num_prompts=8

A stage reads the recipe recorded in the run's manifest (or --recipe for a new run); the stage's own
fields are flags (`--epochs`), any field of any stage can be set with `--set section.field=value`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import typing
from pathlib import Path

from .config import ConfigError, apply_override, load_recipe, stage_fields
from .run import Run

DEFAULT_RECIPE = "smollm2-cpu"
# subcommand -> (module with run(recipe, run), recipe section whose fields become flags)
STAGES = {
    "gen": ("specdraft.data.generate", "gen"),
    "render": ("specdraft.data.render", "render"),
    "extract": ("specdraft.hidden.extract", "extract"),
    "train": ("specdraft.train", "train"),
    "export": ("specdraft.export.formats", "export"),
    "eval": ("specdraft.evaluate.speculate", "eval"),
}
DEMO_ORDER = ["gen", "render", "extract", "train", "export", "eval"]


def _flag_help(tp) -> str:
    name = getattr(tp, "__name__", str(tp))
    if typing.get_origin(tp) is list:
        name = "comma-separated list"
    return name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdraft", description="Train and prove EAGLE-3 drafters.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--recipe", help=f"a recipe name or .toml path (new runs default to {DEFAULT_RECIPE})")
        p.add_argument("--run", help="the run folder (default runs/<recipe name>)")
        p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                       help="override any recipe field; repeatable")

    for name, (_, section) in STAGES.items():
        p = sub.add_parser(name, help=f"run the {name} stage on a run folder")
        common(p)
        for field_name, tp in stage_fields(section):
            p.add_argument(f"--{field_name.replace('_', '-')}", dest=f"{section}.{field_name}",
                           default=None, metavar=_flag_help(tp).upper())
    p = sub.add_parser("doctor", help="check an exported drafter folder for the failures that load but accept nothing")
    p.add_argument("folder", help="a drafter folder (speculators or flat format)")
    p.add_argument("--target", help="the target it drafts for (default: the run's recipe)")
    p.add_argument("--run", help="the run it came from (default: the run the folder is inside)")
    p.add_argument("--no-measure", action="store_true",
                   help="skip the checks that run the target on held-out conversations (targets too big for here)")
    p = sub.add_parser("import", help="a published EAGLE-3 drafter (speculators or flat, midlayer.* or layers.0.*) "
                                      "-> a specdraft checkpoint, checked against the target")
    common(p)
    p.add_argument("folder", help="the drafter folder (config.json + safetensors)")
    p.add_argument("--out", help="write a bare checkpoint folder here instead of into a run")
    p.add_argument("--target", help="the target it drafts for (default: the recipe's)")
    p = sub.add_parser("demo", help="run every stage on the embedded default (SmolLM2 + ShareGPT, CPU)")
    common(p)
    return parser


def _resolve(args) -> tuple:
    recipe = load_recipe(args.recipe or DEFAULT_RECIPE)
    run = Run(Path(args.run) if args.run else Path("runs") / recipe.name)
    if not args.recipe and run.exists():
        recipe = run.recipe()
    for item in args.set:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected SECTION.FIELD=VALUE")
        key, value = item.split("=", 1)
        apply_override(recipe, key.strip(), value.strip())
    for dest, value in vars(args).items():
        if "." in dest and value is not None:
            apply_override(recipe, dest, value)
    run.init(recipe)
    return recipe, run


def _run_stage(name: str, recipe, run) -> dict:
    module = importlib.import_module(STAGES[name][0])
    try:
        return module.run(recipe, run)
    except BaseException as e:
        run.record(name, state="failed", extra={"error": f"{type(e).__name__}: {e}"})
        raise


def demo(recipe, run) -> None:
    times = {}
    for name in DEMO_ORDER:
        print(f"\n== {name} ==", flush=True)
        t0 = time.time()
        _run_stage(name, recipe, run)
        times[name] = time.time() - t0
        print(f"== {name} done in {times[name]:.0f} s", flush=True)
    m = run.manifest()["stages"]
    ev = m["eval"]["metrics"]
    print("\n== summary ==")
    for name in DEMO_ORDER:
        print(f"  {name:8s} {times[name]:7.0f} s")
    print(f"  total    {sum(times.values()):7.0f} s")
    print(f"  report:  {run.path / 'eval' / 'report.md'}")
    print(f"  per-position acceptance: {' / '.join(f'{a:.3f}' for a in ev['per_position_acceptance'])}")
    print(f"  tau (chain, K={recipe.eval.draft_tokens}, greedy, exact): {ev['tau']:.3f}")
    commands = m["export"].get("serve_commands") or {"vllm": m["export"]["serve_command"]}
    engines = {"vllm": "vLLM", "sglang": "SGLang"}
    for fmt, command in commands.items():
        print(f"\nnext: serve the drafter with {engines.get(fmt, fmt)}:\n  {command}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "doctor":
            from .export.doctor import run_doctor

            return run_doctor(args.folder, args.target, args.run, measured=not args.no_measure)
        if args.command == "import":
            from .export.formats import run_import

            if args.target:
                args.set.append(f"target.model={args.target}")
            if args.out:
                if args.run:
                    raise ValueError("import: give --run or --out, not both")
                recipe = load_recipe(args.recipe or DEFAULT_RECIPE)
                for item in args.set:
                    apply_override(recipe, *(part.strip() for part in item.split("=", 1)))
                run_import(args.folder, recipe, out=args.out)
            else:
                run_import(args.folder, *_resolve(args))
            return 0
        recipe, run = _resolve(args)
        if args.command == "demo":
            demo(recipe, run)
        else:
            _run_stage(args.command, recipe, run)
    except KeyboardInterrupt:
        print("specdraft: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as e:
        # Expected failures (bad input, missing files, stages out of order) are one line, no traceback.
        if os.environ.get("SPECDRAFT_DEBUG"):
            raise
        print(f"specdraft: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
