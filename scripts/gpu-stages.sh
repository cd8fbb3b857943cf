# Sourced by the GPU call scripts (gpu-recipe-call.sh, gpu-methods-call.sh): stages of a run within one
# call's DEADLINE (seconds since the script started), logged to $LOG, run as `$S STAGE --run RUN ...`.
# GATHER_S seconds stay at the end for gathering the results into $OUT.
left() { echo $((DEADLINE - SECONDS)); }
state() { python3 -c "import json;m=json.load(open('$1/manifest.json'));print(m['stages'].get('$2',{}).get('state','none'))" 2>/dev/null || echo none; }
# stage RUN NAME [args]: one stage of RUN unless done, within the time left; fails if it did not finish (a
# stage cut here resumes in the next call).
stage() {
  local run=$1 st=$2; shift 2
  [ "$(state $run $st)" = done ] && return 0
  local t=$(( $(left) - ${GATHER_S:-20} )); [ $t -lt 20 ] && { echo "no time for $st of $run" >> $LOG; return 1; }
  echo "== $st $run (budget ${t}s) $(date +%T)" >> $LOG
  timeout $t $S $st --run $run "$@" >> $LOG 2>&1; echo "== $st rc=$? $(date +%T)" >> $LOG
  [ "$(state $run $st)" = done ]
}
# run_folder DIR: DIR made a run folder (a manifest with no stage yet) before carried answers go in:
# specdraft refuses to write among files it did not write.
run_folder() { mkdir -p $1; [ -f $1/manifest.json ] || echo '{"stages": {}}' > $1/manifest.json; }
