"""bench/vllm_acceptance.py's reference: from a speedup results file that keeps every run's line, the
line measured on the prompts and tokens being served, or a clear refusal before any serving."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def script():
    spec = importlib.util.spec_from_file_location("vllm_acceptance", REPO / "bench" / "vllm_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_is_the_last_line_of_the_same_shape(tmp_path):
    lines = [
        {"prompts": 16, "max_new_tokens": 128, "tau_chain": 1.7, "per_position_acceptance_chain": [0.4]},
        {"prompts": 64, "max_new_tokens": 256, "tau_chain": 2.4, "per_position_acceptance_chain": [0.6]},
        {"prompts": 16, "max_new_tokens": 128, "tau_chain": 1.9, "per_position_acceptance_chain": [0.5]},
    ]
    path = tmp_path / "speedup.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert script().speedup_line(path, 16, 128) == {"tau": 1.9, "per_position_acceptance": [0.5]}
    assert script().speedup_line(path, 64, 256)["tau"] == 2.4
    with pytest.raises(SystemExit, match=r"no line measured on 8 prompts x 128 tokens"):
        script().speedup_line(path, 8, 128)
