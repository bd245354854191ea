#!/usr/bin/env bash
# Starts the same training command, detached, on every worker of a Cloud TPU VM slice.
#
#   scripts/launch_tpu_pod.sh TPU_NAME ZONE [OPTIONS] -- TRAIN_FLAGS...
#
#   scripts/launch_tpu_pod.sh my-v5p-64 us-east5-a --setup -- \
#       --config configs/tpu_pod_1b.py --workdir /mnt/shared/runs/tpu_pod_1b
#
# Options:
#   --setup            copy this checkout to every worker (~/mtp_jax) and install it with its
#                      gcs extra and the jax and libtpu versions the ahead-of-time check
#                      compiled with
#   --queued TYPE      first create the slice as a queued resource of accelerator TYPE
#                      (e.g. v5p-64); --runtime VERSION picks the TPU VM image, --spot asks
#                      for spot capacity; a resource that ends FAILED stops the wait
#   --num_slices N     multislice: N slices TPU_NAME-0 .. TPU_NAME-(N-1) (with --queued, one
#                      queued resource of N nodes; the runtime sets the MEGASCALE_* variables)
#   --watch SECONDS    stay attached: every SECONDS read each worker's trainer state; when a
#                      trainer stopped without finishing (a preemption, a crash) stop the
#                      others, recreate the slice if it is gone (needs --queued), set it up
#                      and start the same command again (the trainer resumes)
#   --max_restarts N   --watch gives up (exit 1) after N restarts in a row (default 10); a job
#                      that ran an hour before it stopped starts the count afresh
#   --backoff SECONDS  wait before the k-th restart in a row: SECONDS * 2^(k-1), at most an
#                      hour (default 30)
#   --logs             follow worker 0's log (ctrl-C leaves the job running)
#   --collect DIR      copy every worker's log into DIR/<slice>-worker<i>.log
#   --stop             stop the trainer on every worker (SIGTERM: it saves a checkpoint first)
#   --slice I          --stop, --logs, --collect: slice I only (multislice)
#   --no_check         skip the check that every worker can write and read the checkpoint
#                      location (mtp-train --check_storage) before the trainer starts
#   --dry_run          print every command instead of running it
#
# Each worker runs `python3 scripts/train.py --distributed=on TRAIN_FLAGS` under nohup and
# setsid, so a dropped SSH connection or a closed laptop does not end it; its output goes to
# ~/mtp_jax_train.log on that worker, the trainer's process id to ~/mtp_jax_train.pid and
# its exit status to ~/mtp_jax_train.exit: the state --watch reads (no process-name match).
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
PID_FILE='~/mtp_jax_train.pid'
STOP_FILE='~/mtp_jax_train.stop'
QR_POLL=${MTP_QUEUED_POLL_SECONDS:-60}  # how often the queued-resource wait asks
STABLE_SECONDS=3600  # a job up this long before it stopped resets the restart count

usage() {
  sed -n '2,41p' "$0" >&2
  exit 2
}

[ $# -ge 3 ] || usage
TPU_NAME=$1
ZONE=$2
shift 2
SETUP=0 QUEUED='' RUNTIME=$RUNTIME_DEFAULT SPOT=0 SLICES=1 WATCH=0 LOGS=0 COLLECT='' STOP=0
DRY=0 MAX_RESTARTS=10 BACKOFF=30 ONLY_SLICE='' CHECK=1
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case $1 in
    --setup) SETUP=1 ;;
    --queued) QUEUED=${2:?--queued needs an accelerator type}; shift ;;
    --runtime) RUNTIME=${2:?--runtime needs a version}; shift ;;
    --spot) SPOT=1 ;;
    --num_slices) SLICES=${2:?--num_slices needs a number}; shift ;;
    --watch) WATCH=${2:?--watch needs seconds}; shift ;;
    --max_restarts) MAX_RESTARTS=${2:?--max_restarts needs a number}; shift ;;
    --backoff) BACKOFF=${2:?--backoff needs seconds}; shift ;;
    --logs) LOGS=1 ;;
    --collect) COLLECT=${2:?--collect needs a directory}; shift ;;
    --stop) STOP=1 ;;
    --slice) ONLY_SLICE=${2:?--slice needs an index}; shift ;;
    --no_check) CHECK=0 ;;
    --dry_run) DRY=1 ;;
    *) echo "error: unknown option $1 (see the usage above)" >&2; usage ;;
  esac
  shift
done
for pair in "--num_slices:$SLICES" "--watch:$WATCH" "--max_restarts:$MAX_RESTARTS" \
            "--backoff:$BACKOFF" "--slice:${ONLY_SLICE:-0}"; do
  if ! [[ ${pair#*:} =~ ^[0-9]+$ ]]; then
    echo "error: ${pair%%:*} takes a whole number, got '${pair#*:}'" >&2
    exit 2
  fi
done
if [ "$SLICES" -lt 1 ] || { [ -n "$ONLY_SLICE" ] && [ "$ONLY_SLICE" -ge "$SLICES" ]; }; then
  echo "error: --num_slices must be >= 1 and --slice below it" >&2
  exit 2
fi
if [ "$STOP" = 0 ] && [ "$LOGS" = 0 ] && [ -z "$COLLECT" ]; then
  [ "${1:-}" = "--" ] || { echo "error: expected -- before the training flags" >&2; exit 2; }
fi
[ "${1:-}" = "--" ] && shift
REMOTE_DIR=${MTP_REMOTE_DIR:-mtp_jax}
REPO=$(cd "$(dirname "$0")/.." && pwd)
TRAIN_FLAGS=("$@")
FLAGS=''  # the training flags, each quoted for the remote shell
for f in "${TRAIN_FLAGS[@]}"; do FLAGS+=" $(printf '%q' "$f")"; done

# Prints the command (always) and runs it (unless --dry_run).
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  [ "$DRY" = 1 ] || "$@"
}

slices() {  # every slice's name, or slice --slice only
  local i
  if [ "$SLICES" = 1 ]; then echo "$TPU_NAME"; return; fi
  for ((i = 0; i < SLICES; i++)); do
    if [ -z "$ONLY_SLICE" ] || [ "$ONLY_SLICE" = "$i" ]; then echo "$TPU_NAME-$i"; fi
  done
}

ssh_slice() {  # ssh_slice SLICE WORKER COMMAND
  run gcloud compute tpus tpu-vm ssh "$1" --zone "$ZONE" --worker="$2" --command "$3"
}

# Remote shell lines. The trainer's pid is written by the subshell that then becomes it
# (exec), and the wrapper around it records its exit status; nothing matches process names,
# so no check can mistake its own shell for the trainer.
ALIVE="p=\$(head -n 1 $PID_FILE 2>/dev/null) && [ -n \"\$p\" ] && kill -0 \"\$p\" 2>/dev/null \
&& tr '\\0' ' ' < /proc/\$p/cmdline | grep -q scripts/train.py"
# One line per worker: mtp-state running | exited N | stopped N | gone (no process, no status).
STATE_CMD="if [ -f $EXIT_FILE ]; then if [ -f $STOP_FILE ]; then echo mtp-state stopped \
\$(cat $EXIT_FILE); else echo mtp-state exited \$(cat $EXIT_FILE); fi; elif $ALIVE; then \
echo mtp-state running; else echo mtp-state gone; fi"
# SIGTERM to the trainer (it saves, then exits); then wait for it and its wrapper.
TERM_CMD="if $ALIVE; then kill -TERM \"\$p\"; fi; true"
# Before a start: the trainer of an earlier start, if one is left, is ended (SIGTERM, after
# 120 s SIGKILL) and its wrapper waited for, so exactly one trainer runs per worker.
REAP_CMD="if $ALIVE; then kill -TERM \"\$p\"; for i in \$(seq 120); do kill -0 \"\$p\" \
2>/dev/null || break; sleep 1; done; kill -KILL \"\$p\" 2>/dev/null; fi; \
w=\$(sed -n 2p $PID_FILE 2>/dev/null); if [ -n \"\$w\" ]; then for i in \$(seq 20); do \
kill -0 \"\$w\" 2>/dev/null || break; sleep 0.5; done; fi; true"

create_queued() {
  local args=(gcloud compute tpus queued-resources create "$TPU_NAME" --zone "$ZONE"
              --accelerator-type "$QUEUED" --runtime-version "$RUNTIME")
  if [ "$SLICES" = 1 ]; then args+=(--node-id "$TPU_NAME"); else
    args+=(--node-count "$SLICES" --node-prefix "$TPU_NAME")
  fi
  [ "$SPOT" = 1 ] && args+=(--spot)
  run "${args[@]}"
  wait_active
}

queued_state() {
  gcloud compute tpus queued-resources describe "$TPU_NAME" --zone "$ZONE" \
    --format='value(state.state)' 2>/dev/null || echo UNKNOWN
}

wait_active() {  # until the queued resource is ACTIVE (it may wait for capacity)
  local state
  echo "waiting for queued resource $TPU_NAME to become ACTIVE"
  [ "$DRY" = 0 ] || return 0
  while true; do
    state=$(queued_state)
    case $state in
      ACTIVE) return 0 ;;
      FAILED|SUSPENDED|SUSPENDING)
        echo "error: queued resource $TPU_NAME is $state (gcloud compute tpus queued-resources" \
          "describe $TPU_NAME --zone $ZONE tells why)" >&2
        exit 1 ;;
    esac
    sleep "$QR_POLL"
  done
}

setup() {
  local tarball s
  tarball=$(mktemp --suffix=.tar.gz)
  [ "$DRY" = 0 ] || rm -f "$tarball"  # only its name is shown
  run tar -C "$REPO" --exclude=.git --exclude=runs --exclude=.venv --exclude=.pytest_cache \
    -czf "$tarball" .
  for s in $(slices); do
    run gcloud compute tpus tpu-vm scp "$tarball" "$s:mtp_jax.tar.gz" --zone "$ZONE" --worker=all
    ssh_slice "$s" all "mkdir -p ~/$REMOTE_DIR && tar -C ~/$REMOTE_DIR -xzf ~/mtp_jax.tar.gz \
&& cd ~/$REMOTE_DIR && python3 -m pip install -q -e '.[gcs]' jax==$JAX_VERSION \
jaxlib==$JAX_VERSION libtpu==$LIBTPU_VERSION"
  done
  run rm -f "$tarball"
}

check_storage() {  # every worker writes, reads back and deletes a file where checkpoints go
  local s
  [ "$CHECK" = 1 ] || return 0
  for s in $(slices); do
    if ! ssh_slice "$s" all "cd ~/$REMOTE_DIR && python3 scripts/train.py --check_storage$FLAGS"
    then
      echo "error: a worker of $s cannot use the checkpoint location (its line is above);" \
        "nothing was started" >&2
      exit 2
    fi
  done
}

start() {  # starts the trainer on every worker of every slice; false if an ssh failed
  local s ok=0 inner job
  # The subshell writes its pid and the wrapper's, then becomes the trainer (exec); the
  # wrapper records its status (or cd's, or the shell's 127 when python3 is missing).
  inner="cd ~/$REMOTE_DIR && (printf '%s\\n%s\\n' \$BASHPID \$\$ > $PID_FILE; \
exec python3 scripts/train.py --distributed=on$FLAGS); echo \$? > $EXIT_FILE"
  job="$REAP_CMD; rm -f $EXIT_FILE $STOP_FILE $PID_FILE; nohup setsid bash -c \
$(printf '%q' "$inner") >> $LOG 2>&1 < /dev/null &"
  for s in $(slices); do ssh_slice "$s" all "$job" || ok=1; done
  STARTED_AT=$SECONDS
  return $ok
}

slice_states() {  # the mtp-state words of every worker of slice $1; 'unreachable' if ssh fails
  local out
  if ! out=$(gcloud compute tpus tpu-vm ssh "$1" --zone "$ZONE" --worker=all \
      --command "$STATE_CMD" 2>/dev/null); then
    echo unreachable
    return
  fi
  printf '%s\n' "$out" | sed -n 's/.*mtp-state //p'
}

slice_exists() {
  gcloud compute tpus tpu-vm describe "$1" --zone "$ZONE" --format='value(state)' \
    > /dev/null 2>&1
}

stop_all() {  # SIGTERM on every worker of every selected slice; returns 1 if one failed
  local s failed=()
  for s in $(slices); do
    ssh_slice "$s" all "touch $STOP_FILE; $TERM_CMD" || failed+=("$s")
  done
  if [ ${#failed[@]} -gt 0 ]; then
    echo "error: could not reach ${failed[*]} to stop it (the other slices were stopped)" >&2
    return 1
  fi
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

if [ "$STOP" = 1 ]; then
  stop_all
  exit $?
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
check_storage
start || echo "warning: a worker could not be reached to start the trainer" >&2
echo "started; follow it with: $0 $TPU_NAME $ZONE --logs${QUEUED:+ --num_slices $SLICES}"
[ "$WATCH" -gt 0 ] || exit 0

# The watch. A dry run shows one restart after a preemption and ends.
restarts=0
while true; do
  run sleep "$WATCH"
  if [ "$DRY" = 1 ]; then
    states='exited 143'
  else
    states=$(for s in $(slices); do slice_states "$s"; done)
  fi
  if ! grep -qv '^running$' <<< "$states"; then continue; fi
  if grep -q '^stopped' <<< "$states"; then
    echo "the job was stopped (--stop): not restarting it"
    exit 0
  fi
  if ! grep -qv '^exited 0$' <<< "$states" && [ "$DRY" = 0 ] && ssh_slice \
      "$(slices | head -n 1)" 0 "tail -n 60 $LOG | grep -qE '^(done: step|Nothing to do)'" \
      > /dev/null; then
    echo "the run finished"
    exit 0
  fi
  if grep -q '^exited 2$' <<< "$states"; then
    echo "error: the trainer refused its input or its checkpoints (exit 2): not restarting;" \
      "see the log (--logs, --collect DIR)" >&2
    stop_all || true
    exit 1
  fi
  summary=$(sort <<< "$states" | uniq -c \
    | awk '{c = $1; $1 = ""; sub(/^ /, ""); printf "%s%s x%s", sep, $0, c; sep = ", "}')
  if [ $((SECONDS - ${STARTED_AT:-0})) -ge "$STABLE_SECONDS" ]; then restarts=0; fi
  if [ "$restarts" -ge "$MAX_RESTARTS" ]; then
    echo "error: the job stopped again ($summary) after $restarts restarts" \
      "(--max_restarts $MAX_RESTARTS): giving up; the other workers are stopped" >&2
    stop_all || true
    exit 1
  fi
  restarts=$((restarts + 1))
  wait_s=$((BACKOFF * (1 << (restarts > 12 ? 12 : restarts - 1))))
  [ "$wait_s" -le 3600 ] || wait_s=3600
  echo "the job stopped before its last step ($summary): restart $restarts of" \
    "$MAX_RESTARTS in ${wait_s}s"
  run sleep "$wait_s"
  lost=()
  if [ -n "$QUEUED" ]; then
    state=$([ "$DRY" = 1 ] && echo SUSPENDED || queued_state)
    if [ "$state" != ACTIVE ]; then lost=("$TPU_NAME (queued resource $state)"); fi
  elif [ "$DRY" = 0 ]; then
    for s in $(slices); do slice_exists "$s" || lost+=("$s"); done
  fi
  if [ ${#lost[@]} -gt 0 ]; then
    if [ -z "$QUEUED" ]; then
      echo "error: slice ${lost[*]} is gone; give --queued TYPE to let --watch recreate it" >&2
      exit 1
    fi
    echo "recreating ${lost[*]}"
    run gcloud compute tpus queued-resources delete "$TPU_NAME" --zone "$ZONE" --force --quiet
    create_queued
    setup
  fi
  start || echo "warning: a worker could not be reached to start the trainer" >&2
  [ "$DRY" = 1 ] && break
done
