"""Where a speculative round's time goes: RoundClock times its parts (ROUND_PARTS), and host_read marks
a read of device results on the host wherever a policy or a drafter state makes one, so that the read
(and the wait for the device it implies) is charged to the host, not to the drafting or verification
it sits in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from time import perf_counter

import torch

from specdraft.decoding.runners import sync

# The parts of a round, in the order a round runs them: drafting (the drafter's forwards), verification
# (the target's forward, its inputs built on the host and its outputs reduced on the device), the host's
# reads of device results (.tolist(), int(): each waits for the device) and its work on them (a tree's
# selection, acceptance), keeping the accepted slots of the target's cache, and the drafter's advance
# over the accepted positions. Drafting and the advance are the drafter's cost (Leviathan's c).
ROUND_PARTS = ("draft", "verify", "host", "keep", "advance")


class RoundClock:
    """Times the parts of a decode's rounds into `seconds` (by part). The device is synced as a part starts
    and ends, so each part is charged its own device work, not its launch; a part timed inside another
    (a host read inside drafting) is charged to itself and taken out of the outer one."""

    def __init__(self, device: torch.device, seconds: dict[str, float]):
        self.device, self.seconds = device, seconds
        self.nested: list[float] = []  # per open part, the seconds of the parts timed inside it

    @contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        sync(self.device)
        t0 = perf_counter()
        self.nested.append(0.0)
        try:
            yield
        finally:
            sync(self.device)
            took = perf_counter() - t0
            self.seconds[part] += took - self.nested.pop()
            if self.nested:
                self.nested[-1] += took


# The clock of the decode running now; host_read charges to it. None outside decode().
_CLOCK: ContextVar[RoundClock | None] = ContextVar("round_clock", default=None)


@contextmanager
def host_read() -> Iterator[None]:
    """Around a read of device results on the host (.tolist(), int(), float()) inside a round: charged to
    the round's host part, not to the drafting or verification it sits in. Outside decode() it times nothing."""
    clock = _CLOCK.get()
    if clock is None:
        yield
        return
    with clock("host"):
        yield


@contextmanager
def timing(clock: RoundClock) -> Iterator[RoundClock]:
    """host_read charges `clock` inside this block (one decode's rounds)."""
    running = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(running)
