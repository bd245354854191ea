#!/usr/bin/env bash
# Trains the decode model of docs/decoding.md (configs/decode_768.py: d 768, L 12, M = 3,
# byte level) from a clean checkout, then measures its decode speed.
#
#   scripts/train_decode_model.sh [RUNS_DIR]        (default: runs)
#
# Six stages, each a scripts/train.py run that starts from the previous one (--init_from):
# a M = 0 trunk, then the M = 3 MTP modules on the frozen trunk, first towards the trunk's
# greedy token (self targets), then towards its whole distribution (soft targets), which is
# what makes sampled decoding pay. Rerunning the script resumes: a finished stage only
# re-reads its last checkpoint. About 2 hours on 2 quiet CPU cores (docs/decoding.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
RUNS=${1:-runs}
CFG=configs/decode_768.py
SHAPE=(--config.data.seq_len=256 --config.data.batch_size=4)  # 1,024 tokens a step
MTP=(--config.model.mtp.freeze_trunk=True "${SHAPE[@]}")

stage() {  # stage NAME FROM [overrides...]
  local name=$1 from=$2
  shift 2
  local init=()
  [ -n "$from" ] && init=(--init_from "$RUNS/decode768_$from")
  echo "== $name" >&2
  "$PY" scripts/train.py --config "$CFG" --workdir "$RUNS/decode768_$name" "${init[@]}" "$@"
}

stage trunk '' --config.model.mtp.depth=0 "${SHAPE[@]}" \
  --config.train.steps=300 --config.train.warmup_steps=30 --config.train.lr=1.5e-3
stage mtp2 trunk "${MTP[@]}" --config.loss.mtp_targets=self \
  --config.train.steps=60 --config.train.warmup_steps=6 --config.train.lr=2e-3
stage mtp3 mtp2 "${MTP[@]}" --config.loss.mtp_targets=self \
  --config.train.steps=240 --config.train.warmup_steps=10 --config.train.lr=1.5e-3
stage mtp4 mtp3 "${MTP[@]}" --config.loss.mtp_targets=self --config.data.shuffle_seed=1 \
  --config.train.steps=300 --config.train.warmup_steps=10 --config.train.lr=1e-3
stage soft1 mtp4 "${MTP[@]}" --config.loss.mtp_targets=soft --config.data.shuffle_seed=2 \
  --config.train.steps=240 --config.train.warmup_steps=10 --config.train.lr=1e-3
stage soft2 soft1 "${MTP[@]}" --config.loss.mtp_targets=soft --config.data.shuffle_seed=3 \
  --config.train.steps=300 --config.train.warmup_steps=10 --config.train.lr=7e-4

echo "== decode speed" >&2
"$PY" benchmarks/decode_speed.py --workdir "$RUNS/decode768_soft2" --batch_sizes 1 \
  --temperatures 0,0.7,1 --drafts 1,2,3,5 --num_prompts 8 --prompt_len 64 --repeats 2 \
  --max_new_tokens 128 --out "$RUNS/decode768_soft2/decode_speed.json"
