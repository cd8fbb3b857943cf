"""What machine this is: CPU, RAM, disk, GPUs and library versions, recorded beside every figure."""

from __future__ import annotations

import functools
import os
import platform
import shutil
from importlib import metadata
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _static() -> dict:
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_bytes": p.total_memory})
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": _ram_bytes(),
        "gpus": gpus,
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("torch", "transformers", "safetensors", "specdraft")},
    }


def describe(path: Path | None = None) -> dict:
    env = dict(_static())
    if path is not None:
        probe = Path(path)
        while not probe.exists():
            probe = probe.parent
        env["disk_free_bytes"] = shutil.disk_usage(probe).free
    return env


def hardware_line() -> str:
    """One line naming the hardware, for printing beside a figure."""
    env = _static()
    if env["gpus"]:
        return f"{len(env['gpus'])}x {env['gpus'][0]['name']}"
    return f"{env['cpu']} ({env['cpu_count']} cores), CPU only"
