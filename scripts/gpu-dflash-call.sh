#!/bin/bash
# A DFlash drafter on the smollm2-h200 recipe's data, beside the recipe's EAGLE-3 drafter: the same
# conversations (bench/data, cut to first turns, as scripts/gpu-recipe-call.sh carries them), the same
# split and the same held-out eval prompts. One call does what is not done yet within DEADLINE seconds
# and gathers the results into $OUT; call it again on the same warm machine to go on (train resumes).
#   1. trainer throughput: bench/train.py, EAGLE-3 (the recipe's drafter shape) and DFlash, once;
#   2. RUN: the carried conversations, gen (answers nothing: all are carried), render, extract (bf16);
#   3. RUN: train with train.method=dflash, epochs sized to TRAIN_SECONDS at the rate step 1 measured;
#      export, eval (the reference decoder, 64 held-out prompts x 128);
#   4. bench/speedup.py on SPEEDUP_PROMPTS (64) held-out prompts x 256, as the EAGLE-3 rows of bench/RESULTS.md.
# LAYERS (3), LR (1e-3) and EXTRA (more --set items) shape the drafter; the model and the ShareGPT wheel
# come as ../shared/gpu/README.md says (three carried parts and assemble.sh) under $M.
DEADLINE=${1:-560}
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
M=${M:-/tmp/specdraft-gpu}; G=$M/SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=$PWD:$M/site SPECDRAFT_CACHE=$M/cache
LAYERS=${LAYERS:-3}; LR=${LR:-1e-3}; TRAIN_SECONDS=${TRAIN_SECONDS:-600}
R=$M/runs/smollm2-h200-dflash; RES=$M/results; LOG=$RES/dflash.log
mkdir -p $RES $R
S="python3 -m specdraft.cli"
left() { echo $((DEADLINE - SECONDS)); }
state() { python3 -c "import json;m=json.load(open('$1/manifest.json'));print(m['stages'].get('$2',{}).get('state','none'))" 2>/dev/null || echo none; }
# stage NAME [args]: one stage of RUN unless done, within the time left; fails if it did not finish.
stage() {
  local st=$1; shift
  [ "$(state $R $st)" = done ] && return 0
  local t=$(( $(left) - 25 )); [ $t -lt 20 ] && { echo "no time for $st" >> $LOG; return 1; }
  echo "== $st (budget ${t}s) $(date +%T)" >> $LOG
  timeout $t $S $st --run $R "$@" >> $LOG 2>&1; echo "== $st rc=$? $(date +%T)" >> $LOG
  [ "$(state $R $st)" = done ]
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> $LOG
if [ ! -s $RES/train-gpu.jsonl ]; then
  timeout 150 python3 bench/train.py --configs smollm2,smollm2-dflash-$LAYERS ${MORE_CONFIGS} \
    --compile off --steps 10 --warmup 3 > $RES/train-gpu.jsonl 2>> $LOG
fi
[ -f $R/conversations.jsonl ] || python3 scripts/cut_turns.py 1 $G bench/data/*.conversations.jsonl.xz > $R/conversations.tmp \
  && mv $R/conversations.tmp $R/conversations.jsonl
first="--recipe smollm2-h200 --set target.model=$G"
[ "$(state $R gen)" = done ] && first=""
stage gen $first && stage render && stage extract && data=1
if [ -n "$data" ] && [ "$(state $R train)" = none ]; then
  # Epochs that fit TRAIN_SECONDS at the DFlash trainer's measured rate, less a fifth for data loading,
  # held-out passes and checkpoints (the EAGLE-3 recipe's train stage spent ~19 % of its time there).
  epochs=$(python3 -c "
import json; m = json.load(open('$R/manifest.json')); tokens = m['stages']['extract']['counts']['tokens'] * 0.95
rate = [json.loads(l) for l in open('$RES/train-gpu.jsonl') if '\"smollm2-dflash-$LAYERS\"' in l][0]['tokens_per_s']
print(max(1, int(0.8 * $TRAIN_SECONDS * rate / tokens)))")
  echo "== DFlash: $LAYERS layers, lr $LR, $epochs epochs" >> $LOG
  sets="--set train.method=dflash --set train.dflash_layers=$LAYERS --set train.draft_vocab_size=0 --set train.lr=$LR
        --set train.epochs=$epochs --set train.warmup_steps=100 $EXTRA"
fi
# EVAL=0: bench/speedup.py alone measures the drafter (the same reference decoder, 256 tokens a prompt).
[ -n "$data" ] && stage train $sets && stage export && { [ "${EVAL:-1}" = 0 ] || stage eval; } && ready=1
if [ -n "$ready" ] && [ ! -s $RES/speedup-dflash.jsonl ] && [ $(left) -gt 90 ]; then
  timeout $(( $(left) - 20 )) python3 bench/speedup.py $R --prompts ${SPEEDUP_PROMPTS:-64} --new-tokens 256 > $RES/speedup-dflash.jsonl 2>> $LOG
fi
tail -c 3000000 $LOG > $OUT/dflash.log
cp $RES/*.jsonl $OUT/ 2>/dev/null
if [ -f $R/manifest.json ]; then
  (cd $R && tar czf $M/run.tgz manifest.json $(ls -d STATUS.md eval checkpoints/train_log.jsonl checkpoints/curves.png \
    export/vllm 2>/dev/null))
  rm -f $OUT/run.tgz.*; split -b 15M $M/run.tgz $OUT/run.tgz.
fi
ls -la $OUT; grep -v "it/s\]\|step/s\]\|sample/s\]" $LOG | tail -30
