"""Kill a stage at a point of its own work, the same point on any machine however fast.

The child process is the real command line, with one function wrapped so that its N-th call writes a
marker file and then waits to be killed (before the call runs, or after it returns). The test waits
for the marker, not for a file to appear in time, so a faster machine cannot finish the stage first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import importlib, sys, time
from pathlib import Path
marker, where, nth, when = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
module, _, dotted = where.partition(":")
owner = importlib.import_module(module)
*path, name = dotted.split(".")
for part in path:
    owner = getattr(owner, part)
real, calls = getattr(owner, name), [0]
def pause():
    marker.write_text(str(calls[0]))
    time.sleep(3600)
def wrapped(*args, **kwargs):
    calls[0] += 1
    if calls[0] == nth and when == "before":
        pause()
    out = real(*args, **kwargs)
    if calls[0] == nth and when == "after":
        pause()
    return out
setattr(owner, name, wrapped)
from specdraft.cli import main
sys.exit(main(sys.argv[5:]))
"""


def kill_at(
    where: str,
    nth: int,
    argv: list[str],
    marker_dir: Path,
    *,
    when: str = "after",
    env: dict | None = None,
    timeout: float = 900,
) -> str:
    """Run `specdraft argv` with `where` ("module:attr.path") pausing at its `nth` call, kill -9 the
    process group there, and return what it printed. Fails if the stage never got there."""
    marker = Path(marker_dir) / f"paused-{where.replace(':', '-')}-{nth}"
    marker.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1", **(env or {})}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(marker), where, str(nth), when, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.time() + timeout
    while not marker.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    alive = child.poll() is None
    if alive:
        os.killpg(child.pid, signal.SIGKILL)
    out = child.communicate()[0].decode(errors="replace")
    assert alive and marker.exists(), f"{argv[0]} never reached call {nth} of {where}:\n{out[-3000:]}"
    return out
