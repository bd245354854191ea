#!/usr/bin/env bash
# Runs the same training command on every worker of a Cloud TPU VM pod slice.
#
#   scripts/launch_tpu_pod.sh TPU_NAME ZONE [--setup] -- TRAIN_FLAGS...
#
#   scripts/launch_tpu_pod.sh my-v5p-64 us-east5-a --setup -- \
#       --config configs/tpu_pod_1b.py --workdir /mnt/shared/runs/tpu_pod_1b
#
# --setup first copies this checkout to every worker (~/mtp_jax) and installs it with
# pip (jax[tpu]). Each worker then runs `python scripts/train.py --distributed=on ...`:
# jax.distributed finds the coordinator and this worker's process id from the TPU
# metadata, every process reads its own shard of the data, process 0 writes the
# metrics, and all of them write the orbax checkpoints, so --workdir must be a
# directory every worker sees (gcsfuse-mounted bucket, Filestore / NFS).
# Rerunning the same command resumes from the latest checkpoint.
set -euo pipefail

if [ $# -lt 3 ]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
TPU_NAME=$1
ZONE=$2
shift 2
SETUP=0
if [ "${1:-}" = "--setup" ]; then
  SETUP=1
  shift
fi
if [ "${1:-}" != "--" ]; then
  echo "expected -- before the training flags" >&2
  exit 2
fi
shift
REMOTE_DIR=${MTP_REMOTE_DIR:-mtp_jax}
REPO=$(cd "$(dirname "$0")/.." && pwd)

ssh_all() {
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "$1"
}

if [ "$SETUP" = 1 ]; then
  tarball=$(mktemp --suffix=.tar.gz)
  tar -C "$REPO" --exclude=.git --exclude=runs --exclude=.pytest_cache -czf "$tarball" .
  gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:mtp_jax.tar.gz" --zone "$ZONE" --worker=all
  rm -f "$tarball"
  ssh_all "mkdir -p ~/$REMOTE_DIR && tar -C ~/$REMOTE_DIR -xzf ~/mtp_jax.tar.gz && \
           cd ~/$REMOTE_DIR && python3 -m pip install -q -e . 'jax[tpu]>=0.10.2,<0.11'"
fi

# Quote each flag for the remote shell.
flags=""
for f in "$@"; do
  flags+=" $(printf '%q' "$f")"
done
ssh_all "cd ~/$REMOTE_DIR && python3 scripts/train.py --distributed=on$flags 2>&1 | \
         tee -a ~/train_worker.log"
