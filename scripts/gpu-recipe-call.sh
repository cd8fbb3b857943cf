#!/bin/bash
# One time-boxed share of the smollm2-h200 recipe and its ablations on a GPU machine that is held for at
# most 10 minutes a call: every call does what is not done yet, while DEADLINE seconds last, and
# gathers the results into $OUT. Expects the model and the ShareGPT wheel under $M
# (../shared/gpu/README.md: three carried parts and assemble.sh); CONV may name carried
# conversations.jsonl(.xz/.gz) files of earlier calls, so gen only answers the prompts not yet answered.
#   1. RUN: gen (all train-split first turns, then gen.self_instruct_samples written by the target), render, extract (bf16);
#   2. RUN-fp8: the same tokens extracted with fp8 storage; RUN-source: ShareGPT's own answers;
#   3. RUN: train (alone on the GPU), export, eval (reference decoder), bench/speedup.py (RUN_DRAFTER=0: none);
#   4. bench/ablate.py: the ablations, two at a time (resumed when cut; ABLATE=0: none, and no step 2).
# EXTRA="--set SECTION.FIELD=VALUE ..." is recorded in a new run's recipe at its first stage, e.g. for all
# turns: TURNS=0 ABLATE=0 EXTRA="--set extract.store_dtype=fp8_e4m3 --set train.epochs=10".
DEADLINE=${1:-540}
# TQDM_MININTERVAL: a progress line every 5 s, so logs brought back hold more than redrawn bars.
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
M=${M:-/tmp/specdraft-gpu}; G=${G:-$M/SmolLM2-135M-Instruct.Q4_1.gguf}
export PYTHONPATH=$PWD:$M/site SPECDRAFT_CACHE=$M/cache
# TURNS=N answers N user turns of each conversation (0: all, up to render.max_length) in a run of its own;
# its CONV holds carried conversations of as many turns or more (cut to TURNS by scripts/cut_turns.py;
# bench/data/ holds SmolLM2's answers to 3 turns of every train-split conversation, and to the 12,000
# first turns it wrote itself for the recipe's gen.self_instruct_samples).
# MAGPIE=N sets gen.self_instruct_samples=N in a run of its own (the recipe's value otherwise).
R=$M/runs/smollm2-h200${TURNS:+-turns$TURNS}${MAGPIE:+-magpie$MAGPIE}; R8=$R-fp8; RS=$R-source; RES=$M/results
mkdir -p $RES $R
LOG=$RES/h200.log
S="python3 -m specdraft.cli"
SOURCE_SAMPLES=${SOURCE_SAMPLES:-3300}  # >= 3,000 training samples after the 5 % held out
# Ablations train 5 epochs (the recipe's drafter 10): all of them fit in about two calls that way
# (bench/ablations.md, 2026-12-03). ABLATE_EXTRA="" trains them as the recipe says.
SPEEDUP_PROMPTS=${SPEEDUP_PROMPTS:-64}; SPEEDUP_TOKENS=${SPEEDUP_TOKENS:-256}
source "$(dirname "$0")/gpu-stages.sh"  # left, state, stage, run_folder
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $LOG
# fp8 hidden states are dequantised on the CPU (the loader, and the target's top tokens at start): how fast
# this torch converts float8 there (2.13 on a 2-core CPU: ~0.3 G values/s per core) — a slow conversion
# is one suspect for the fp8 ablation that logged no step in 130 s on 2026-12-03.
python3 -c "import torch,time; q=torch.randn(10**8).to(torch.float8_e4m3fn); t=time.time(); q.float(); \
print(f'fp8->float on CPU: {1e8/(time.time()-t)/1e9:.2f} G values/s, torch {torch.__version__}')" >> $LOG 2>&1
if [ -n "$CONV" ] && [ ! -f $R/conversations.jsonl ]; then
  run_folder $R
  python3 scripts/cut_turns.py ${TURNS:-1} $G $CONV > $R/conversations.tmp && mv $R/conversations.tmp $R/conversations.jsonl
fi
first="--recipe smollm2-h200 --set target.model=$G ${TURNS:+--set gen.max_turns=$TURNS} ${MAGPIE:+--set gen.self_instruct_samples=$MAGPIE}"
[ "$(state $R gen)" = none ] || first=""
stage $R gen $first $EXTRA && stage $R render && stage $R extract && data=1
# ABLATE=0: the recipe's drafter only (e.g. a TURNS run), so neither the ablations' fp8 copy nor the source.
[ "${ABLATE:-1}" = 0 ] && abl="" || abl=1
if [ -n "$data" ] && [ -n "$abl" ]; then
  # The fp8 copy reads RUN's tokens: only its extract runs.
  python3 -c "from specdraft.run import RunFolder; RunFolder('$R8').share_data('$R', through='render')"
  stage $R8 extract --set extract.store_dtype=fp8_e4m3
  # SOURCE=0 leaves the source's answers out (only the "source" ablation reads them; ~1 min).
  [ "${SOURCE:-1}" != 0 ] && stage $RS gen --recipe smollm2-h200 --set target.model=$G --set gen.answers=source --set gen.self_instruct_samples=0 \
    --set data.num_train=$SOURCE_SAMPLES && stage $RS render && stage $RS extract
fi
# The recipe's own drafter first, alone on the GPU (side by side with 7 ablations it reached no
# checkpoint in 13 minutes: bench/ablations.md); then its export, eval and the speedup bench.
# RUN_DRAFTER=0: the recipe's drafter is trained and measured already (an earlier session brought it
# back), so the call goes straight to the ablations and leaves data-all, its row, out.
if [ "${RUN_DRAFTER:-1}" = 0 ]; then
  [ -n "$data" ] && ready=1; SKIP="--skip data-all"
else
  [ -n "$data" ] && stage $R train && stage $R export && stage $R eval && ready=1; SKIP=""
fi
if [ "${RUN_DRAFTER:-1}" != 0 ] && [ -n "$ready" ] && [ ! -s $RES/speedup-h200.jsonl ] && [ $(left) -gt 60 ]; then
  timeout $(( $(left) - 15 )) python3 bench/speedup.py $R --prompts $SPEEDUP_PROMPTS \
    --new-tokens $SPEEDUP_TOKENS > $RES/speedup-h200.jsonl 2>>$LOG
fi
if [ -n "$ready" ] && [ -n "$abl" ] && [ $(left) -gt 60 ]; then
  echo "== ablate (budget $(left)s) $(date +%T)" >> $LOG
  python3 bench/ablate.py $R --fp8-run $R8 --source-run $RS --deadline $(( $(left) - 45 )) \
    --parallel ${ABLATE_PARALLEL:-2} $SKIP --decode-prompts ${DECODE_PROMPTS:-16} --score-reserve 60 --set train.eval_every=100000 --set train.checkpoint_every=150 \
    ${ABLATE_EXTRA---set train.epochs=5} \
    --out $RES/ablations-h200.jsonl --markdown $RES/ablations.md >> $LOG 2>&1
  echo "== ablate rc=$? $(date +%T)" >> $LOG
fi
tail -c 4000000 $LOG > $OUT/h200.log
cp $RES/*.jsonl $RES/*.md $OUT/ 2>/dev/null
# Each ablation's own log, its head (start-up) and tail (the end, and the phase line that says where the
# wall time went), in one archive: a call brings back only a few files, and one per variant was too many.
rm -rf $M/logs; mkdir -p $M/logs
for f in $R/ablations/*/train.log; do [ -f $f ] && { head -c 6000 $f; printf '\n[...]\n'; tail -c 14000 $f; } \
  > $M/logs/train-$(basename $(dirname $f)).log; done
ls $M/logs/*.log > /dev/null 2>&1 && tar czf $OUT/train-logs.tgz -C $M/logs .
[ -f $R/conversations.jsonl ] && xz -T0 -c $R/conversations.jsonl > $OUT/conversations.jsonl.xz
if [ -f $R/manifest.json ]; then
  (cd $R && tar czf $M/run.tgz manifest.json $(ls -d STATUS.md eval checkpoints/train_log.jsonl \
    checkpoints/curves.png export/vllm ablations/*/checkpoints/train_log.jsonl 2>/dev/null))
  split -b 15M $M/run.tgz $OUT/run.tgz.
fi
ls -la $OUT; tail -40 $LOG
