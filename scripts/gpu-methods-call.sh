#!/bin/bash
# Drafters of several methods on the smollm2-h200 recipe's data, side by side on one GPU: the same
# conversations (bench/data, cut to first turns, as scripts/gpu-recipe-call.sh carries them), rendered and
# extracted once, the same seeded split and held-out eval prompts. One call does what is not done yet
# within DEADLINE seconds and gathers the results into $OUT; call it again on the same warm machine to go
# on (a stage that ran out of time resumes).
#   1. BASE: the carried conversations, gen (answers nothing: all are carried), render, extract (bf16);
#   2. per method of METHODS (in order): a run on BASE's hidden states (RunFolder.share_data), train with
#      train.method=METHOD and the recipe's settings plus SETS_<method>, export, eval (the reference
#      decoder, 64 held-out prompts x 128);
#   3. bench/speedup.py per method on SPEEDUP_PROMPTS (32) held-out prompts x 256;
#   4. bench/round_cost.py over every trained run at K = 3 (CUDA graphs, 8 held-out prompts x 128).
# TRAIN_BENCH=1 first times the trainers alone (bench/train.py). The model and the ShareGPT wheel come as
# ../shared/gpu/README.md says (three carried parts and assemble.sh) under $M.
#   METHODS="peagle eagle3" bash scripts/gpu-methods-call.sh 560
DEADLINE=${1:-560}
METHODS=${METHODS:-"peagle eagle3"}
# What each method changes in the recipe: P-EAGLE feeds no state forward, so EAGLE-3.1's norms are off;
# DFlash as bench/RESULTS.md's recipe-scale row (3 layers, the whole vocabulary, 100 warm-up steps).
SETS_peagle=${SETS_peagle:-"--set train.fc_norm=false --set train.norm_output=false"}
SETS_dflash=${SETS_dflash:-"--set train.dflash_layers=3 --set train.draft_vocab_size=0 --set train.warmup_steps=100"}
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
M=${M:-/tmp/specdraft-gpu}; G=$M/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$PWD:$M/site SPECDRAFT_CACHE=$M/cache
B=$M/runs/smollm2-h200; RES=$M/results; LOG=$RES/methods.log
mkdir -p $RES $B
S="python3 -m specdraft.cli"
GATHER_S=25
source "$(dirname "$0")/gpu-stages.sh"  # left, state, stage, run_folder
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $LOG
if [ -n "$TRAIN_BENCH" ] && [ ! -s $RES/train-gpu.jsonl ]; then
  timeout 150 python3 bench/train.py --configs smollm2 --compile off --steps 10 --warmup 3 > $RES/train-gpu.jsonl 2>> $LOG
fi
run_folder $B
[ -f $B/conversations.jsonl ] || python3 scripts/cut_turns.py 1 $G bench/data/*.conversations.jsonl.xz > $B/conversations.tmp \
  && mv $B/conversations.tmp $B/conversations.jsonl
first="--recipe smollm2-h200 --set target.model=$G"
[ "$(state $B gen)" = none ] || first=""
stage $B gen $first && stage $B render && stage $B extract && data=1
trained=""
for method in $METHODS; do
  [ -n "$data" ] || break
  R=$B-$method; sets=SETS_$method
  python3 -c "from specdraft.run import RunFolder; RunFolder('$R').share_data('$B', through='extract')"
  stage $R train --set train.method=$method ${!sets} ${EPOCHS:+--set train.epochs=$EPOCHS} && stage $R export \
    && { [ "${EVAL:-1}" = 0 ] || stage $R eval; } || break
  trained="$trained $R"
done
for R in $trained; do
  out=$RES/speedup-${R##*-}.jsonl
  [ -s $out ] || [ $(left) -lt 90 ] || timeout $(( $(left) - 20 )) python3 bench/speedup.py $R \
    --prompts ${SPEEDUP_PROMPTS:-32} --new-tokens 256 > $out 2>> $LOG
done
if [ -n "$trained" ] && [ ! -s $RES/round-cost.jsonl ] && [ $(left) -gt 90 ]; then
  timeout $(( $(left) - 20 )) python3 bench/round_cost.py $trained --engine cuda-graphs --K 3 --prompts 8 \
    --new-tokens 128 --held-out --label recipe-scale --out $RES/round-cost.jsonl >> $LOG 2>&1
fi
tail -c 3000000 $LOG > $OUT/methods.log
cp $RES/*.jsonl $OUT/ 2>/dev/null
for R in $trained; do
  (cd $R && tar czf $M/${R##*/}.tgz manifest.json $(ls -d STATUS.md eval checkpoints/train_log.jsonl \
    checkpoints/curves.png export/vllm 2>/dev/null))
  rm -f $OUT/${R##*/}.tgz.*; split -b 15M $M/${R##*/}.tgz $OUT/${R##*/}.tgz.
done
ls -la $OUT; grep -v "it/s\]\|step/s\]\|sample/s\]" $LOG | tail -30
