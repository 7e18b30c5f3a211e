"""A MindSpeed-LLM recipe at a CPU size: its flags as they are, with only the sizes (layers, hidden,
heads, experts, sequence, batch, iterations), the paths and the parallel sizes changed so that two
CPU processes hold it.

    python tests_extend/example/recipes/shrink.py qwen3 TOKENIZER_PATH=/tok DATA_PATH=/data/x_text_document
prints the argv, one option per line (recipes/train.sh passes it to train_distributed.sh).
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = sorted(name[:-len(".flags")] for name in os.listdir(HERE) if name.endswith(".flags"))

# the model at CPU size (a flag absent from the recipe stays absent)
SIZES = {"--num-layers": 4, "--hidden-size": 64, "--ffn-hidden-size": 128, "--num-attention-heads": 4,
         "--num-query-groups": 2, "--kv-channels": 16, "--seq-length": 64, "--max-position-embeddings": 64,
         "--micro-batch-size": 1, "--global-batch-size": 4, "--train-iters": 3, "--num-experts": 4,
         "--moe-ffn-hidden-size": 32, "--moe-intermediate-size": 32, "--q-lora-rank": 32, "--kv-lora-rank": 16,
         "--qk-head-dim": 16, "--qk-nope-head-dim": 16, "--qk-pos-emb-head-dim": 8, "--qk-rope-head-dim": 8,
         "--v-head-dim": 16, "--moe-router-num-groups": 2, "--n-group": 2, "--moe-router-group-topk": 1,
         "--topk-group": 1, "--rope-scaling-original-max-position-embeddings": 32, "--lr-warmup-iters": 1,
         "--save-interval": 3, "--eval-interval": 3}
# sizes that follow the model's: the top-k at most 2 of 4 experts, the first dense layers and the no-op layers
# kept as one layer each where the recipe has some
DERIVED = {"--moe-router-topk": lambda v: str(min(int(v), 2)),
           "--first-k-dense-replace": lambda v: v if int(v) <= 0 else "1",
           "--noop-layers": lambda v: str(SIZES["--num-layers"] - 1)}
# per family: the parallel sizes that keep the recipe's kind of parallelism on 2 processes
PARALLEL = {"llama3": {"--tensor-model-parallel-size": 2}, "llama31": {"--tensor-model-parallel-size": 2},
            "qwen25": {"--tensor-model-parallel-size": 2}, "qwen3": {"--pipeline-model-parallel-size": 2},
            "qwen3_moe": {"--expert-model-parallel-size": 2}, "mixtral": {"--tensor-model-parallel-size": 2},
            "deepseek3": {"--expert-model-parallel-size": 2}, "deepseek3_2_1_0": {"--expert-model-parallel-size": 2}}
# options of a recipe the built-in trainer refuses in this shrunk layout (in one line, naming what to do
# instead): DualPipeV needs PP >= 2 (2 processes keep the recipe's EP; the V's own layout below), and
# so does --moe-fb-overlap with the recipe's MTP layer; CoC's fused kernel is Ascend's.
# `shrink(..., runnable=True)` leaves them out so the rest of the recipe trains
NOT_YET = {"--schedules-method": "DualPipeV (at PP >= 2: shrink(..., v=True))",
           "--moe-fb-overlap": "MoE forward/backward overlap (with an MTP layer at PP >= 2: shrink(..., v=True))",
           "--coc-fused-kernel": "CoC's fused kernel (Ascend's)"}
# the V's layout (v=True): the recipe with its --schedules-method dualpipev --moe-fb-overlap at PP 2 x EP 2,
# 4 processes, 8 samples a step (the V needs 2 x PP - 1 micro-batches per data-parallel rank), with its full
# recomputation (the combined step's compute nodes recompute: features/moe/fb_overlap_recompute.py)
V_LAYOUT = {"--pipeline-model-parallel-size": 2, "--expert-model-parallel-size": 2}
V_SIZES = {"--global-batch-size": 8}
V_NOT_YET = {"--coc-fused-kernel": NOT_YET["--coc-fused-kernel"]}
# options that need a Hugging Face model at --load, which the runs here do not have: left out of the runnable
# form too (the torch trainer converts it then: tests_extend/unit/test_convert_legacy.py)
NEEDS_HF_MODEL = {"--enable-hf2mg-convert": "the run converts the Hugging Face model --load names"}
PARALLEL_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                  "--expert-model-parallel-size")


def recipe(family: str) -> list[list[str]]:
    """The recipe's options as [flag, values...], in its order."""
    if family not in FAMILIES:
        raise SystemExit(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    with open(os.path.join(HERE, f"{family}.flags"), encoding="utf-8") as f:
        return [line.split() for line in f if line.strip() and not line.startswith("#")]


def shrink(family: str, paths: dict, runnable: bool = False, v: bool = False) -> list[str]:
    """The recipe at CPU size for 2 processes; `paths` fills its $NAME values (a missing one is an error);
    runnable: without the NOT_YET and NEEDS_HF_MODEL options; v: in the V's layout (4 processes, runnable,
    with its DualPipeV and fb overlap)."""
    parallel = {flag: 1 for flag in PARALLEL_FLAGS}
    parallel.update(V_LAYOUT if v else PARALLEL[family])
    sizes = dict(SIZES, **V_SIZES) if v else SIZES
    left_out = dict(V_NOT_YET, **NEEDS_HF_MODEL) if v else dict(NOT_YET, **NEEDS_HF_MODEL) if runnable else {}
    argv, seen = [], set()
    for flag, *values in recipe(family):
        if flag in left_out:
            continue
        seen.add(flag)
        if flag in parallel:
            values = [str(parallel[flag])]
        elif flag in sizes:
            values = [str(sizes[flag])]
        elif flag in DERIVED:
            values = [DERIVED[flag](values[0])]
        argv += [flag, *(_fill(v, paths) for v in values)]
    for flag, size in parallel.items():     # a recipe that leaves a size at its default gets ours
        if flag not in seen and size != 1:
            argv += [flag, str(size)]
    return argv


def _fill(value: str, paths: dict) -> str:
    if not value.startswith("$"):
        return value
    name = value[1:]
    if name not in paths:
        raise SystemExit(f"the recipe needs {name}=PATH")
    return paths[name]


def main(argv: list[str]) -> int:
    runnable, v = "--runnable" in argv, "--v" in argv
    argv = [a for a in argv if a not in ("--runnable", "--v")]
    if not argv:
        print(f"usage: shrink.py FAMILY [--runnable | --v] [NAME=PATH ...]; families: {', '.join(FAMILIES)}",
              file=sys.stderr)
        return 2
    paths = dict(arg.split("=", 1) for arg in argv[1:])
    print("\n".join(shrink(argv[0], paths, runnable, v)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
