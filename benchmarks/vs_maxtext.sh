#!/usr/bin/env bash
# mtp_jax vs MaxText 0.2.5 on MaxText's CPU peer model, D = 0 / 1 / 3, in one window:
#   peer D=0, ours (D=0,1,3), peer D=1, peer D=3, ours again; each line of JSON to $OUT.
#   PYTHON2 (optional, e.g. a jax 0.12 venv): a second interpreter run right after each of ours.
# Peer: ../shared/peers/maxtext/run_peer.sh (its own python 3.12 / jax 0.12 venv under
# PEER_ROOT), float32, remat_policy=minimal (= this project's model.remat='block').
# Usage: PEER_ROOT=/work/peer_maxtext PYTHON=/work/main/.venv/bin/python \
#        flock /tmp/mtp_bench.lock bash benchmarks/vs_maxtext.sh /tmp/vs_maxtext.jsonl
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-/tmp/vs_maxtext.jsonl}
PEER=${PEER:-$HERE/../shared/peers/maxtext/run_peer.sh}  # the main checkout's sibling
[ -f "$PEER" ] || PEER=/work/shared/peers/maxtext/run_peer.sh  # a worktree under /work/wt
PYTHON=${PYTHON:-python}
ROUNDS=${ROUNDS:-8}
export PEER_ROOT=${PEER_ROOT:-/work/peer_maxtext} DTYPE=float32 REMAT=minimal STEPS=${STEPS:-30}
export WAIT_IDLE_S=${WAIT_IDLE_S:-0}  # a shared machine is never idle; the load is recorded instead
: > "$OUT"
load() { echo "{\"load_average\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"at\": \"$(date -u +%FT%TZ)\", \"what\": \"$1\"}" >> "$OUT"; }
peer() { load "peer D=$1 start"; MTP_LIST=$1 bash "$PEER" >> "$OUT"; load "peer D=$1 end"; }
ours1() {  # <file tag> <python> <depths>: one mtp_jax process
  load "mtp_jax ($2, D=$3) start"
  PYTHONPATH=$HERE "$2" "$HERE/benchmarks/train_throughput.py" --only maxtext --depths "$3" \
    --rounds "$ROUNDS" --out "$OUT.ours$1.json" > /dev/null
  "$2" -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'mtp_jax': d['maxtext'], 'jax': d['machine']['jax']}))" "$OUT.ours$1.json" >> "$OUT"
  load "mtp_jax ($2, D=$3) end"
}
oursd() { ours1 "_d$1_p$2" "$PYTHON" "$1"; }  # one depth, one process: <depth> <pair>
ours() { ours1 "$1a" "$PYTHON" 0,1,3; if [ -n "${PYTHON2:-}" ]; then ours1 "$1b" "$PYTHON2" 0,1,3; fi; }
# PAIRS=N: N interleaved peer/ours pairs per depth instead (order flipped every other pair),
# (DEPTHS, default "0 1 3"), one depth per mtp_jax process; benchmarks/vs_maxtext_pairs.py turns the file into ratios.
if [ -n "${PAIRS:-}" ]; then
  for i in $(seq 1 "$PAIRS"); do
    for d in ${DEPTHS:-0 1 3}; do
      if [ $((i % 2)) = 1 ]; then peer "$d"; oursd "$d" "$i"; else oursd "$d" "$i"; peer "$d"; fi
    done
  done
  exit 0
fi
peer 0; ours 1; peer 1; peer 3; ours 2
