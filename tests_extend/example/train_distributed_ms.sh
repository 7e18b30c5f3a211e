#!/usr/bin/env bash
# GPT pretraining with MindSpeed's native MindSpore trainer (--backend mindspore), launched with msrun.
# The same settings and environment overrides as train_distributed.sh, e.g.
#   TRAIN_ITERS=40 bash tests_extend/example/train_distributed_ms.sh
#   TP=1 bash tests_extend/example/train_distributed_ms.sh           # pure data parallel
#   CKPT_DIR=/tmp/ck SAVE_INTERVAL=20 bash ...; LOAD_DIR=/tmp/ck bash ...  # save, then resume
#   CKPT_DIR=/tmp/ck SAVE_INTERVAL=20 MAX_RESTARTS=3 bash ...   # a failed job comes back from its last save
# Extra arguments are passed to pretrain_gpt.py (later flags win). Multi-node: set NNODES,
# NODE_RANK and MASTER_ADDR (the node running rank 0) on every node.
set -euo pipefail

# --- launch --------------------------------------------------------------------------------
NPUS_PER_NODE=${NPUS_PER_NODE:-2}        # processes per node (cpu: 2 on a 2-core machine)
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-6001}
PYTHON=${PYTHON:-python}
LOG_DIR=${LOG_DIR:-./msrun_log}            # msrun writes one log per worker here
CLUSTER_TIMEOUT=${CLUSTER_TIMEOUT:-600}    # seconds to wait for every worker to join

# --- parallelism (the mindspore trainer: tensor, sequence and data parallel) -----------------
TP=${TP:-2}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL:-0}  # 1: --sequence-parallel (needs TP > 1)

# --- model -------------------------------------------------------------------------------------
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN_SIZE=${HIDDEN_SIZE:-128}
NUM_HEADS=${NUM_HEADS:-4}
SEQ_LENGTH=${SEQ_LENGTH:-128}

# --- training ----------------------------------------------------------------------------------
MICRO_BATCH=${MICRO_BATCH:-16}
GLOBAL_BATCH=${GLOBAL_BATCH:-32}
TRAIN_ITERS=${TRAIN_ITERS:-600}
LR=${LR:-3e-3}
MIN_LR=${MIN_LR:-3e-4}
WARMUP_ITERS=${WARMUP_ITERS:-$(( TRAIN_ITERS / 10 < 20 ? TRAIN_ITERS / 10 : 20 ))}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-200}
EVAL_ITERS=${EVAL_ITERS:-10}
OPTIMIZATION_LEVEL=${OPTIMIZATION_LEVEL:-2}

# --- data and checkpoints ----------------------------------------------------------------------
DATA_PATH=${DATA_PATH:-}                  # empty: the bundled Shakespeare dataset (built on first run)
SPLIT=${SPLIT:-949,50,1}
CKPT_DIR=${CKPT_DIR:-}                    # empty: no checkpoints
SAVE_INTERVAL=${SAVE_INTERVAL:-}
LOAD_DIR=${LOAD_DIR:-}
# msrun (MindSpore 2.10) has no restart option: this script relaunches a failed job itself
MAX_RESTARTS=${MAX_RESTARTS:-0}            # >0: a job that exits non-zero is relaunched; it resumes from CKPT_DIR
if [ "$MAX_RESTARTS" != 0 ]; then
  if [ -z "$CKPT_DIR" ] || [ -z "$SAVE_INTERVAL" ]; then
    echo "error: MAX_RESTARTS=$MAX_RESTARTS needs CKPT_DIR and SAVE_INTERVAL: a restarted job resumes from the last checkpoint" >&2; exit 2
  fi
  # --save X --load X: the first start finds no checkpoint and starts at iteration 0, a restart resumes
  LOAD_DIR=${LOAD_DIR:-$CKPT_DIR}
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export GLOG_v=${GLOG_v:-3}                 # MindSpore's C++ log: errors only
WORLD=$(( NPUS_PER_NODE * NNODES ))
export WORLD_SIZE=$WORLD                   # the argument parser derives data-parallel size from it
export MINDSPEED_NODE_RANK=$NODE_RANK      # pretrain_gpt.py: only node 0 runs msrun's scheduler

MSRUN=$(command -v msrun || true)
if [ -z "$MSRUN" ]; then
  PY_BIN=$(dirname "$(command -v "$PYTHON")")
  MSRUN="$PY_BIN/msrun"
fi
if [ ! -x "$MSRUN" ]; then
  echo "error: msrun not found: install MindSpore (pip install mindspore==2.10.0 \"numpy<2\") or run ./auto_convert_llm.sh --backend mindspore" >&2
  exit 2
fi
export PATH="$(dirname "$MSRUN"):$PATH"    # msrun starts workers with the `python` on PATH
MS_PYTHON="$(dirname "$MSRUN")/python"     # the launcher runs on that interpreter too
[ -x "$MS_PYTHON" ] || MS_PYTHON=$PYTHON

ARGS=(
  --backend mindspore --tensor-model-parallel-size "$TP"
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
  --lr-warmup-iters "$WARMUP_ITERS" --weight-decay 0.1 --clip-grad 1.0
  --split "$SPLIT" --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
  --optimization-level "$OPTIMIZATION_LEVEL"
)
[ "$SEQUENCE_PARALLEL" = 1 ] && ARGS+=(--sequence-parallel)
[ -n "$DATA_PATH" ] && ARGS+=(--data-path $DATA_PATH)
[ -n "$CKPT_DIR" ] && ARGS+=(--save "$CKPT_DIR")
[ -n "$SAVE_INTERVAL" ] && ARGS+=(--save-interval "$SAVE_INTERVAL")
[ -n "$LOAD_DIR" ] && ARGS+=(--load "$LOAD_DIR")

# the trainer's refusals (flags, sizes, the support matrix) come out here as one `error:` line and
# nothing is launched (msrun would add its own failure report)
"$PYTHON" -m mindspeed.preflight --preflight-world-size "$WORLD" "${ARGS[@]}" "$@" \
  || { rc=$?; [ "$rc" = 3 ] && exit 0; exit "$rc"; }   # 3: --help shown

# the default dataset is built once here, not by every worker at once
if [ -z "$DATA_PATH" ] && [ "$NODE_RANK" = 0 ]; then
  "$PYTHON" -m mindspeed.data >/dev/null
fi

MSRUN_ARGS=(--worker_num="$WORLD" --local_worker_num="$NPUS_PER_NODE"
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --node_rank="$NODE_RANK"
  --log_dir="$LOG_DIR" --join=True --cluster_time_out="$CLUSTER_TIMEOUT" --tail_worker_log=0
  "$HERE/pretrain_gpt.py" "${ARGS[@]}" "$@")
# mindspeed.msrun is msrun whose failed worker also stops the job's scheduler at once (msrun alone
# waits for it to miss the dead worker's heartbeats for MS_NODE_TIMEOUT), ending in one line
[ "$MAX_RESTARTS" = 0 ] && exec "$MS_PYTHON" -m mindspeed.msrun "${MSRUN_ARGS[@]}"
for (( attempt = 0; ; attempt++ )); do
  rc=0
  "$MS_PYTHON" -m mindspeed.msrun "${MSRUN_ARGS[@]}" || rc=$?
  if [ "$rc" = 0 ] || [ "$attempt" -ge "$MAX_RESTARTS" ]; then exit "$rc"; fi
  echo "> msrun exited with code $rc: restart $(( attempt + 1 )) of $MAX_RESTARTS, from the last checkpoint in $CKPT_DIR" >&2
done
