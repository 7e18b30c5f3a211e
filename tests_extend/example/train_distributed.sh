#!/usr/bin/env bash
# GPT pretraining with MindSpeed on Megatron-Core, launched with torchrun.
# Every setting below can be overridden from the environment, e.g.
#   TRAIN_ITERS=40 bash tests_extend/example/train_distributed.sh
#   TP=1 PP=2 bash tests_extend/example/train_distributed.sh --use-distributed-optimizer
#   MEGATRON_LM=~/Megatron-LM bash tests_extend/example/train_distributed.sh   # Megatron-LM's own pretrain_gpt.py
# Extra arguments are passed to pretrain_gpt.py (later flags win).
set -euo pipefail

# --- launch --------------------------------------------------------------------------------
NPUS_PER_NODE=${NPUS_PER_NODE:-2}        # processes per node (cpu: 2 on a 2-core machine)
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
PYTHON=${PYTHON:-python}

# --- parallelism -----------------------------------------------------------------------------
TP=${TP:-2}                               # tensor model parallel
PP=${PP:-1}                               # pipeline model parallel
CP=${CP:-1}                               # context parallel
EP=${EP:-1}                               # expert parallel (needs NUM_EXPERTS)
NUM_EXPERTS=${NUM_EXPERTS:-}

# --- model (a small GPT that learns char-level Shakespeare in minutes on 2 cpu cores) --------
NUM_LAYERS=${NUM_LAYERS:-4}
HIDDEN_SIZE=${HIDDEN_SIZE:-128}
NUM_HEADS=${NUM_HEADS:-4}
SEQ_LENGTH=${SEQ_LENGTH:-128}

# --- training ----------------------------------------------------------------------------------
MICRO_BATCH=${MICRO_BATCH:-16}
GLOBAL_BATCH=${GLOBAL_BATCH:-32}
TRAIN_ITERS=${TRAIN_ITERS:-300}
LR=${LR:-3e-3}
MIN_LR=${MIN_LR:-3e-4}
WARMUP_ITERS=${WARMUP_ITERS:-$(( TRAIN_ITERS / 10 < 20 ? TRAIN_ITERS / 10 : 20 ))}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
EVAL_ITERS=${EVAL_ITERS:-10}
OPTIMIZATION_LEVEL=${OPTIMIZATION_LEVEL:-2}   # 0: Megatron-Core's own unfused paths (drops FUSED)
FUSED=${FUSED:-1}                         # 1: MindSpeed's fused kernels (optimization level >= 1)

# --- data and checkpoints ----------------------------------------------------------------------
DATA_PATH=${DATA_PATH:-}                  # empty: the bundled Shakespeare dataset (built on first run)
SPLIT=${SPLIT:-949,50,1}
CKPT_DIR=${CKPT_DIR:-}                    # empty: no checkpoints
SAVE_INTERVAL=${SAVE_INTERVAL:-}
LOAD_DIR=${LOAD_DIR:-}
MAX_RESTARTS=${MAX_RESTARTS:-0}            # >0: torchrun restarts a failed job; it resumes from CKPT_DIR
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-30}   # seconds the workers get after SIGTERM (with --exit-signal-handler
                                          # to finish the step and save) before torchrun kills them
TENSORBOARD_DIR=${TENSORBOARD_DIR:-}
MOCK_DATA=${MOCK_DATA:-0}                 # 1: Megatron's random-token dataset (no files)

# --- entry point -----------------------------------------------------------------------------
# empty: MindSpeed's built-in trainer; a Megatron-LM checkout: its own pretrain_gpt.py, which must
# carry `import mindspeed.megatron_adaptor` under `import torch` (the one-line opt-in)
MEGATRON_LM=${MEGATRON_LM:-}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ENTRY="$HERE/pretrain_gpt.py"
if [ -n "$MEGATRON_LM" ]; then
  ENTRY="$MEGATRON_LM/pretrain_gpt.py"
  if [ ! -f "$ENTRY" ]; then
    echo "error: MEGATRON_LM=$MEGATRON_LM has no pretrain_gpt.py (point it at a Megatron-LM checkout)" >&2; exit 2
  fi
  if ! grep -q "^import mindspeed.megatron_adaptor" "$ENTRY"; then
    echo "error: add 'import mindspeed.megatron_adaptor' under 'import torch' in $ENTRY" >&2; exit 2
  fi
  export PYTHONPATH="$MEGATRON_LM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # its megatron/ shadows the wheel
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # one compute thread per process

ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --context-parallel-size "$CP" --expert-model-parallel-size "$EP"
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine
  --lr-warmup-iters "$WARMUP_ITERS" --weight-decay 0.1 --clip-grad 1.0
  --split "$SPLIT" --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
  --optimization-level "$OPTIMIZATION_LEVEL"
)
[ "$FUSED" = 1 ] && ARGS+=(--use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb --use-flash-attn)
if [ "$MOCK_DATA" = 1 ]; then
  ARGS+=(--mock-data)
  [ -n "$MEGATRON_LM" ] && ARGS+=(--tokenizer-type NullTokenizer --vocab-size 4096)   # Megatron 0.12 mock tokens reach 4095
elif [ -n "$MEGATRON_LM" ]; then
  # Megatron-LM has no default corpus and no character tokenizer: the dataset's ids go through
  # its NullTokenizer, sized from the tokenizer MindSpeed saved next to the dataset
  if [ -z "$DATA_PATH" ]; then
    DATA_PATH=$("$PYTHON" -c "from mindspeed.data.shakespeare import ensure_dataset; print(ensure_dataset())" | tail -n 1)
  fi
  VOCAB_SIZE=$("$PYTHON" -c "import sys; from mindspeed.data.tokenizer import load_tokenizer; print(load_tokenizer(sys.argv[1]).vocab_size)" "${DATA_PATH##* }")
  ARGS+=(--data-path $DATA_PATH --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
elif [ -n "$DATA_PATH" ]; then
  ARGS+=(--data-path $DATA_PATH)
fi
[ -n "$NUM_EXPERTS" ] && ARGS+=(--num-experts "$NUM_EXPERTS")
[ -n "$CKPT_DIR" ] && ARGS+=(--save "$CKPT_DIR")
[ -n "$SAVE_INTERVAL" ] && ARGS+=(--save-interval "$SAVE_INTERVAL")
if [ "$MAX_RESTARTS" != 0 ]; then
  if [ -z "$CKPT_DIR" ] || [ -z "$SAVE_INTERVAL" ]; then
    echo "error: MAX_RESTARTS=$MAX_RESTARTS needs CKPT_DIR and SAVE_INTERVAL: a restarted job resumes from the last checkpoint" >&2; exit 2
  fi
  # --save X --load X: the first start finds no checkpoint and starts at iteration 0, a restart resumes
  LOAD_DIR=${LOAD_DIR:-$CKPT_DIR}
  # torchrun's static rendezvous keeps one TCPStore across restarts, so a restarted job's process
  # groups read the dead workers' addresses (gloo: "connection refused"); the c10d rendezvous with
  # per-round worker stores starts every round clean
  RDZV=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "mindspeed-$MASTER_PORT")
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
else
  RDZV=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi
[ -n "$LOAD_DIR" ] && ARGS+=(--load "$LOAD_DIR")
[ -n "$TENSORBOARD_DIR" ] && ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")

# the trainer's refusals (flags, sizes, the support matrix) come out here as one `error:` line and
# nothing is launched; Megatron-LM's own parser is not MindSpeed's, so its script is not checked
if [ -z "$MEGATRON_LM" ]; then
  "$PYTHON" -m mindspeed.preflight --preflight-world-size $(( NPUS_PER_NODE * NNODES )) \
    "${ARGS[@]}" "$@" || { rc=$?; [ "$rc" = 3 ] && exit 0; exit "$rc"; }   # 3: --help shown
fi

# mindspeed.torchrun is torchrun ending in one line when a signal stops the job: it forwards SIGTERM to
# the workers (with --exit-signal-handler they finish the step, save and exit) and waits for them
exec "$PYTHON" -m mindspeed.torchrun --max-restarts "$MAX_RESTARTS" --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
  --nproc_per_node "$NPUS_PER_NODE" --nnodes "$NNODES" "${RDZV[@]}" \
  "$ENTRY" "${ARGS[@]}" "$@"
