#!/bin/bash
# One time-boxed share of a GPU recipe run (the device machine here is held for at most 10 minutes a
# call): each stage of the smollm2-h200 recipe not yet done in the run manifest, then the extract and
# speedup benches, while time is left (DEADLINE seconds); results gathered into $OUT. Expects the model
# and the ShareGPT wheel under $M (../shared/gpu/README.md: three carried parts and assemble.sh).
DEADLINE=${1:-540}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
M=${M:-/tmp/specdraft-gpu}; G=${G:-$M/SmolLM2-135M-Instruct.Q4_1.gguf}
export PYTHONPATH=$PWD:$M/site SPECDRAFT_CACHE=$M/cache
R=$M/runs/smollm2-h200; RES=$M/results; mkdir -p $RES
LOG=$RES/h200.log
S="python3 -m specdraft.cli"
left() { echo $((DEADLINE - SECONDS)); }
state() { python3 -c "import json,sys;m=json.load(open('$R/manifest.json'));print(m['stages'].get('$1',{}).get('state','none'))" 2>/dev/null || echo none; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $RES/gpu.txt
for st in gen render extract train export eval; do
  [ "$(state $st)" = done ] && continue
  t=$(left); [ $t -lt 20 ] && { echo "no time for $st" >> $LOG; break; }
  echo "== $st (budget ${t}s) $(date +%T)" >> $LOG
  if [ $st = gen ] && [ ! -f $R/manifest.json ]; then a="--recipe smollm2-h200 --set target.model=$G $EXTRA"; else a=""; fi
  timeout $t $S $st --run $R $a >> $LOG 2>&1; echo "== $st rc=$? $(date +%T)" >> $LOG
  [ "$(state $st)" = done ] || break
  if [ $st = extract ] && [ ! -f $RES/extract-h200.jsonl ]; then
    for sd in bfloat16 fp8_e4m3; do t=$(left); [ $t -gt 90 ] && timeout 80 python3 bench/extract.py --model $G \
      --samples $R/tokens/tokens.safetensors --tokens 2000000 --store-dtype $sd >> $RES/extract-h200.jsonl 2>>$LOG; done
  fi
done
if [ "$(state eval)" = done ] && [ ! -f $RES/speedup-h200.jsonl ] && [ $(left) -gt 60 ]; then
  timeout $(( $(left) - 15 )) python3 bench/speedup.py $R --prompts 16 --new-tokens 128 > $RES/speedup-h200.jsonl 2>>$LOG
fi
cp $LOG $RES/*.jsonl $RES/gpu.txt $OUT/ 2>/dev/null
[ -f $R/conversations.jsonl ] && gzip -c $R/conversations.jsonl > $OUT/conversations.jsonl.gz
if [ -f $R/manifest.json ]; then
  (cd $R && tar czf $M/run.tgz manifest.json STATUS.md $(ls -d eval checkpoints/train_log.jsonl checkpoints/curves.png export/vllm 2>/dev/null))
  split -b 15M $M/run.tgz $OUT/run.tgz.
fi
ls -la $OUT; tail -40 $LOG
