#!/usr/bin/env bash
# Starts the same training command, detached, on every worker of a Cloud TPU VM slice.
#
#   scripts/launch_tpu_pod.sh TPU_NAME ZONE [OPTIONS] -- TRAIN_FLAGS...
#
#   scripts/launch_tpu_pod.sh my-v5p-64 us-east5-a --setup -- \
#       --config configs/tpu_pod_1b.py --workdir /mnt/shared/runs/tpu_pod_1b
#
# Options:
#   --setup            copy this checkout to every worker (~/mtp_jax) and install it with the
#                      jax and libtpu versions the ahead-of-time check compiled with
#   --queued TYPE      first create the slice as a queued resource of accelerator TYPE
#                      (e.g. v5p-64); --runtime VERSION picks the TPU VM image, --spot asks
#                      for spot capacity
#   --num_slices N     multislice: N slices TPU_NAME-0 .. TPU_NAME-(N-1) (with --queued, one
#                      queued resource of N nodes; the runtime sets the MEGASCALE_* variables)
#   --watch SECONDS    stay attached: every SECONDS check the job; when it stopped without
#                      finishing (a preemption) recreate the slice if it is gone, set it up
#                      and start the same command again (the trainer resumes)
#   --logs             follow worker 0's log (ctrl-C leaves the job running)
#   --collect DIR      copy every worker's log into DIR/<slice>-worker<i>.log
#   --stop             stop the job on every worker (SIGTERM: it saves a checkpoint first)
#   --dry_run          print every command instead of running it
#
# Each worker runs `python3 scripts/train.py --distributed=on TRAIN_FLAGS` under nohup and
# setsid, so a dropped SSH connection or a closed laptop does not end it; its output goes to
# ~/mtp_jax_train.log on that worker and its exit status to ~/mtp_jax_train.exit.
# jax.distributed finds the coordinator and the process ids from the TPU metadata; every
# process reads its own data shard, process 0 writes the metrics, and all of them write the
# orbax checkpoints, so the checkpoints must go where every worker sees them:
# --config.train.checkpoint_dir=gs://BUCKET/run, or a --workdir on a shared mount.
set -euo pipefail

# The versions mtp-aot-compile's TPU check compiled with (pyproject.toml: jax, the tpu extra).
JAX_VERSION=0.10.2
LIBTPU_VERSION=0.0.42.1
RUNTIME_DEFAULT=v2-alpha-tpuv5
LOG='~/mtp_jax_train.log'
EXIT_FILE='~/mtp_jax_train.exit'

usage() {
  sed -n '2,31p' "$0" >&2
  exit 2
}

[ $# -ge 3 ] || usage
TPU_NAME=$1
ZONE=$2
shift 2
SETUP=0 QUEUED='' RUNTIME=$RUNTIME_DEFAULT SPOT=0 SLICES=1 WATCH=0 LOGS=0 COLLECT='' STOP=0
DRY=0
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case $1 in
    --setup) SETUP=1 ;;
    --queued) QUEUED=${2:?--queued needs an accelerator type}; shift ;;
    --runtime) RUNTIME=${2:?--runtime needs a version}; shift ;;
    --spot) SPOT=1 ;;
    --num_slices) SLICES=${2:?--num_slices needs a number}; shift ;;
    --watch) WATCH=${2:?--watch needs seconds}; shift ;;
    --logs) LOGS=1 ;;
    --collect) COLLECT=${2:?--collect needs a directory}; shift ;;
    --stop) STOP=1 ;;
    --dry_run) DRY=1 ;;
    *) echo "error: unknown option $1 (see the usage above)" >&2; usage ;;
  esac
  shift
done
if ! [[ $SLICES =~ ^[1-9][0-9]*$ ]] || ! [[ $WATCH =~ ^[0-9]+$ ]]; then
  echo "error: --num_slices and --watch take whole numbers" >&2
  exit 2
fi
if [ "$STOP" = 0 ] && [ "$LOGS" = 0 ] && [ -z "$COLLECT" ]; then
  [ "${1:-}" = "--" ] || { echo "error: expected -- before the training flags" >&2; exit 2; }
fi
[ "${1:-}" = "--" ] && shift
REMOTE_DIR=${MTP_REMOTE_DIR:-mtp_jax}
REPO=$(cd "$(dirname "$0")/.." && pwd)

# Prints the command (always) and runs it (unless --dry_run).
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  [ "$DRY" = 1 ] || "$@"
}

slices() {
  if [ "$SLICES" = 1 ]; then echo "$TPU_NAME"; else
    for ((i = 0; i < SLICES; i++)); do echo "$TPU_NAME-$i"; done
  fi
}

ssh_slice() {  # ssh_slice SLICE WORKER COMMAND
  run gcloud compute tpus tpu-vm ssh "$1" --zone "$ZONE" --worker="$2" --command "$3"
}

create_queued() {
  local args=(gcloud compute tpus queued-resources create "$TPU_NAME" --zone "$ZONE"
              --accelerator-type "$QUEUED" --runtime-version "$RUNTIME")
  if [ "$SLICES" = 1 ]; then args+=(--node-id "$TPU_NAME"); else
    args+=(--node-count "$SLICES" --node-prefix "$TPU_NAME")
  fi
  [ "$SPOT" = 1 ] && args+=(--spot)
  run "${args[@]}"
  # Blocks until the slices exist (a queued request may wait for capacity).
  run bash -c "until gcloud compute tpus queued-resources describe $(printf '%q' "$TPU_NAME") \
--zone $(printf '%q' "$ZONE") --format='value(state.state)' | grep -qx ACTIVE; do sleep 60; done"
}

setup() {
  local tarball
  tarball=$(mktemp --suffix=.tar.gz)
  [ "$DRY" = 0 ] || rm -f "$tarball"  # only its name is shown
  run tar -C "$REPO" --exclude=.git --exclude=runs --exclude=.venv --exclude=.pytest_cache \
    -czf "$tarball" .
  for s in $(slices); do
    run gcloud compute tpus tpu-vm scp "$tarball" "$s:mtp_jax.tar.gz" --zone "$ZONE" --worker=all
    ssh_slice "$s" all "mkdir -p ~/$REMOTE_DIR && tar -C ~/$REMOTE_DIR -xzf ~/mtp_jax.tar.gz \
&& cd ~/$REMOTE_DIR && python3 -m pip install -q -e . jax==$JAX_VERSION jaxlib==$JAX_VERSION \
libtpu==$LIBTPU_VERSION"
  done
  run rm -f "$tarball"
}

start() {
  local flags='' f
  for f in "${TRAIN_FLAGS[@]}"; do flags+=" $(printf '%q' "$f")"; done
  # setsid + nohup: the job outlives the SSH connection; its exit status is kept for --watch.
  local job="cd ~/$REMOTE_DIR && rm -f $EXIT_FILE && nohup setsid bash -c \
'python3 scripts/train.py --distributed=on$flags; echo \$? > $EXIT_FILE' >> $LOG 2>&1 < /dev/null &"
  for s in $(slices); do ssh_slice "$s" all "$job"; done
}

finished() {  # true when worker 0 of the first slice shows the trainer's final summary
  local s
  s=$(slices | head -n 1)
  [ "$DRY" = 0 ] || return 1  # a dry run shows the restart after a preemption
  gcloud compute tpus tpu-vm ssh "$s" --zone "$ZONE" --worker=0 --command \
    "test -f $EXIT_FILE && tail -n 40 $LOG | grep -q '^done: step'" 2>/dev/null
}

running() {  # true when the trainer runs on worker 0 of every slice
  local s
  [ "$DRY" = 0 ] || return 1
  for s in $(slices); do
    gcloud compute tpus tpu-vm ssh "$s" --zone "$ZONE" --worker=0 --command \
      "pgrep -f 'scripts/train.py --distributed=on' > /dev/null" 2>/dev/null || return 1
  done
}

workers() {  # the worker indices of slice $1
  local n=1
  if [ "$DRY" = 1 ]; then
    run gcloud compute tpus tpu-vm describe "$1" --zone "$ZONE" \
      --format='value(networkEndpoints[].ipAddress)' >&2
  else
    n=$(gcloud compute tpus tpu-vm describe "$1" --zone "$ZONE" \
      --format='value(networkEndpoints[].ipAddress)' | tr ';' '\n' | grep -c .)
  fi
  seq 0 $((n - 1))
}

TRAIN_FLAGS=("$@")
if [ "$STOP" = 1 ]; then
  for s in $(slices); do ssh_slice "$s" all "pkill -TERM -f 'scripts/train.py --distributed=on' || true"; done
  exit 0
fi
if [ -n "$COLLECT" ]; then
  run mkdir -p "$COLLECT"
  for s in $(slices); do
    for w in $(workers "$s"); do
      run gcloud compute tpus tpu-vm scp "$s:mtp_jax_train.log" "$COLLECT/$s-worker$w.log" \
        --zone "$ZONE" --worker="$w"
    done
  done
  exit 0
fi
if [ "$LOGS" = 1 ]; then
  ssh_slice "$(slices | head -n 1)" 0 "tail -n 100 -F $LOG"
  exit 0
fi
[ ${#TRAIN_FLAGS[@]} -gt 0 ] || { echo "error: no training flags after --" >&2; exit 2; }

[ -n "$QUEUED" ] && create_queued
[ "$SETUP" = 1 ] && setup
start
echo "started; follow it with: $0 $TPU_NAME $ZONE --logs${QUEUED:+ --num_slices $SLICES}"
[ "$WATCH" -gt 0 ] || exit 0
while true; do
  run sleep "$WATCH"
  if running; then continue; fi
  if finished; then echo "the run finished"; break; fi
  echo "the job stopped before its last step (preempted?): starting it again"
  if [ -n "$QUEUED" ]; then
    state=$( [ "$DRY" = 1 ] && echo SUSPENDED || gcloud compute tpus queued-resources describe \
      "$TPU_NAME" --zone "$ZONE" --format='value(state.state)' || true)
    if [ "$state" != ACTIVE ]; then
      run gcloud compute tpus queued-resources delete "$TPU_NAME" --zone "$ZONE" --force --quiet
      create_queued
      setup
    fi
  fi
  start
  [ "$DRY" = 1 ] && break
done
