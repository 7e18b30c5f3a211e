#!/usr/bin/env bash
# A MindSpeed-LLM family recipe at CPU size on the built-in trainer (2 processes):
#   TOKENIZER_PATH=DIR DATA_PATH=PREFIX bash tests_extend/example/recipes/train.sh qwen3 [more flags]
# FAMILY.flags holds the recipe's full-size flags; shrink.py changes only the sizes, the paths and the
# parallel sizes, and leaves out the options the trainer refuses until their work lands (shrink.NOT_YET).
# TOKENIZER_PATH: a Hugging Face tokenizer folder (TOKENIZER_MODEL: a SentencePiece tokenizer.model, for the
# recipes that pass Llama2Tokenizer); DATA_PATH: a dataset made with it
# (python -m mindspeed.data --tokenizer-type PretrainedFromHF --tokenizer-name-or-path DIR ...);
# CKPT_DIR: where checkpoints go (default: a new temporary folder).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PYTHON=${PYTHON:-python}
FAMILY=${1:?usage: train.sh FAMILY [flags]; FAMILY one of: $(cd "$HERE" && ls *.flags | sed 's/.flags//' | tr '\n' ' ')}
shift
TOKENIZER_PATH=${TOKENIZER_PATH:-}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-$TOKENIZER_PATH}
: "${TOKENIZER_MODEL:?set TOKENIZER_PATH to a Hugging Face tokenizer folder (or TOKENIZER_MODEL to a SentencePiece model)}"
: "${DATA_PATH:?set DATA_PATH to a dataset prefix made with that tokenizer}"
CKPT_DIR=${CKPT_DIR:-$(mktemp -d)}
mapfile -t ARGS < <("$PYTHON" "$HERE/shrink.py" "$FAMILY" --runnable TOKENIZER_PATH="$TOKENIZER_PATH" \
  TOKENIZER_MODEL="$TOKENIZER_MODEL" DATA_PATH="$DATA_PATH" CKPT_LOAD_DIR="$CKPT_DIR" CKPT_SAVE_DIR="$CKPT_DIR")
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# the trainer's refusals come out as one `error:` line before anything is launched
"$PYTHON" -m mindspeed.preflight --preflight-world-size 2 "${ARGS[@]}" "$@"
exec "$PYTHON" -m mindspeed.torchrun --nproc_per_node 2 --nnodes 1 --node_rank 0 --master_addr localhost \
  --master_port "${MASTER_PORT:-6000}" "$ROOT/tests_extend/example/pretrain_gpt.py" "${ARGS[@]}" "$@"
