"""Where CI's time goes: each test module's share, the slowest tests and the setup cost of each fixture.

    python bench/ci_time.py DURATIONS [--fixtures FIXTURES.jsonl] [--top 10] [--budget-min 45]

DURATIONS is pytest's `--durations=0` report (the CI log holds it: `.ci/run` writes it to
`$SPECDRAFT_CI_REPORTS/durations.txt`). FIXTURES is what tests/conftest.py writes where
`SPECDRAFT_FIXTURE_TIMES` names a file: one JSON line per fixture set-up of 0.5 s or more, its own time
only (the fixtures it requests are timed on their own lines). pytest's report charges a shared fixture to
the first test that asked for it; the fixture lines say which fixture it was.

Prints a readable table, then one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# "12.34s call     tests/test_x.py::test_y[param]"
_LINE = re.compile(r"^(?P<seconds>\d+(?:\.\d+)?)s (?P<phase>setup|call|teardown)\s+(?P<nodeid>\S.*)$")


def read_durations(text: str) -> list[dict]:
    """The `--durations` rows of a pytest report (any other line is ignored)."""
    rows = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            rows.append({"seconds": float(m["seconds"]), "phase": m["phase"], "nodeid": m["nodeid"]})
    return rows


def read_fixtures(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def summarize(rows: list[dict], fixtures: list[dict], top: int) -> dict:
    total = sum(r["seconds"] for r in rows)
    modules: dict[str, float] = defaultdict(float)
    tests: dict[str, float] = defaultdict(float)
    for r in rows:
        modules[module_of(r["nodeid"])] += r["seconds"]
        tests[r["nodeid"]] += r["seconds"]
    calls = sorted((r for r in rows if r["phase"] == "call"), key=lambda r: -r["seconds"])
    per_fixture: dict[str, dict] = {}
    for f in fixtures:
        entry = per_fixture.setdefault(
            f["fixture"], {"fixture": f["fixture"], "scope": f["scope"], "setups": 0, "seconds": 0.0}
        )
        entry["setups"] += 1
        entry["seconds"] += f["seconds"]
    return {
        "total_s": round(total, 1),
        "tests": len(tests),
        "modules": [
            {"module": m, "seconds": round(s, 1), "share": round(s / total, 4) if total else 0.0}
            for m, s in sorted(modules.items(), key=lambda kv: -kv[1])
        ],
        "slowest_calls": [{"test": r["nodeid"], "seconds": r["seconds"]} for r in calls[:top]],
        "fixtures": [
            {**f, "seconds": round(f["seconds"], 1)} for f in sorted(per_fixture.values(), key=lambda f: -f["seconds"])
        ],
    }


def print_table(s: dict, top: int, budget_min: float) -> None:
    print(f"{s['tests']} tests, {s['total_s'] / 60:.1f} min in pytest's phases (budget {budget_min:.0f} min)")
    print("\nmodule                                     seconds  share")
    for m in s["modules"]:
        print(f"{m['module']:<42} {m['seconds']:>7.1f}  {100 * m['share']:5.1f} %")
    print(f"\nthe {top} slowest test bodies")
    for c in s["slowest_calls"]:
        print(f"{c['seconds']:>7.1f} s  {c['test']}")
    if s["fixtures"]:
        print("\nfixture set-up (its own time, summed over its set-ups)")
        for f in s["fixtures"][:top]:
            print(f"{f['seconds']:>7.1f} s  {f['fixture']} ({f['scope']}, {f['setups']}x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("durations", type=Path, help="pytest's --durations=0 report (or a log holding it)")
    p.add_argument("--fixtures", type=Path, help="the JSON lines SPECDRAFT_FIXTURE_TIMES wrote")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--budget-min", type=float, default=45.0)
    args = p.parse_args(argv)
    rows = read_durations(args.durations.read_text(errors="replace"))
    if not rows:
        print(f"ci_time: no --durations rows in {args.durations}", file=sys.stderr)
        return 2
    fixtures = read_fixtures(args.fixtures) if args.fixtures and args.fixtures.exists() else []
    s = summarize(rows, fixtures, args.top)
    print_table(s, args.top, args.budget_min)
    print(
        json.dumps(
            {
                "total_s": s["total_s"],
                "tests": s["tests"],
                "modules": s["modules"][: args.top],
                "slowest_calls": s["slowest_calls"],
                "fixtures": s["fixtures"][: args.top],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
