#!/bin/bash
# The reference decoder's fast engine on a GPU, time-boxed for one device call:
#   1. 2 prompts x 32 tokens with --engine cuda-graphs: proves the graphs capture (a failed capture is
#      said on stderr and the line's "engine" reads "static (capture of ... failed: ...)");
#   2. the bar, 64 held-out prompts x 256 new tokens, engine auto (cuda-graphs on CUDA);
#   3. while time is left, the eager engine on 8 prompts x 128 tokens, for the before/after.
# Usage, from the project root, with PYTHONPATH and the run ready (scripts/gpu-recipe-call.sh):
#   bash bench/speedup_smoke.sh RUN [DEADLINE_SECONDS]
# One JSON line per step in $OUT/speedup-fast.jsonl (./ when $OUT is unset), stderr in speedup-fast.log.
RUN=${1:?a run folder with a trained drafter}
DEADLINE=${2:-540}
DIR=${OUT:-.}
J=$DIR/speedup-fast.jsonl
L=$DIR/speedup-fast.log
export PYTHONUNBUFFERED=1
left() { echo $((DEADLINE - SECONDS)); }

timeout 150 python3 bench/speedup.py "$RUN" --prompts 2 --new-tokens 32 --engine cuda-graphs >> "$J" 2>> "$L" \
  || { echo "smoke run failed (rc $?)"; tail -40 "$L"; exit 1; }
tail -1 "$J"
# Without graphs the engine is about as slow as the eager one (~5 s a prompt for 128 tokens on the H200):
# 64 x 256 would not fit a call, so stop here with the reason in the log.
if ! tail -1 "$J" | grep -q '"engine": "cuda-graphs"'; then
  echo "the graphs did not capture; see $L"; grep -A3 "engine:" "$L" | head -20; exit 1
fi
timeout $(( $(left) - 10 )) python3 bench/speedup.py "$RUN" --prompts 64 --new-tokens 256 >> "$J" 2>> "$L"
echo "64 x 256: rc $? after ${SECONDS}s"
if [ "$(left)" -gt 150 ]; then
  timeout $(( $(left) - 10 )) python3 bench/speedup.py "$RUN" --prompts 8 --new-tokens 128 --engine eager >> "$J" 2>> "$L"
fi
cat "$J"
grep -i "engine\|error\|Traceback" "$L" | tail -20
