#!/usr/bin/env bash
# The floor of specdraft's transformers range (pyproject.toml): the tests that drive transformers
# directly (the target's forward and hidden-state capture, the reference decoder, the big architectures,
# the whole tiny pipeline) run again with the lowest transformers the range admits, in a venv that takes
# everything else from the main install. The main suite covers the newest one setup.sh installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
FLOOR=$(sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
VENV="${SPECDRAFT_CACHE:-$HOME/.cache/specdraft}/transformers-$FLOOR-venv"
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q --no-deps "transformers==$FLOOR.*"
"$VENV/bin/python" -c 'import transformers; print("transformers", transformers.__version__, "(the floor)")'
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_extract.py tests/test_eval.py tests/test_bigtargets.py tests/test_pipeline.py
