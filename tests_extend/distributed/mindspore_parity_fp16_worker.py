"""msrun worker for the --fp16 parity test: TP=2, TP=2 with sequence parallelism, DP=2 with the
distributed optimizer and PP=2, from the same fp16-representable initial checkpoint, with
mindspore_parity_fp16's PARITY loss scaling; the overflow check with an inf on rank 1 only; and --bf16
at TP=2 with sequence parallelism, at PP=2 and at CP=2 (ring attention) from a bf16-representable
one (its bf16 activations cross the TP and pipeline collectives; under CP the attention block
computes in fp32 on CPU, its ring exchanges included: model.py's _attention_block).
Usage: msrun ... mindspore_parity_fp16_worker.py OUT_DIR INIT_CKPT BF16_INIT_CKPT"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402

STEPS = 4      # short: the TP=1 run (in the test process) carries the 20-step claim
RUNS = {"tp2": dict(tp=2), "tp2_sp": dict(tp=2, sp=True), "dp2_distributed_optimizer": dict(distributed_optimizer=True),
        "pp2": dict(pp=2)}
BF16_RUNS = {"bf16_tp2_sp": dict(tp=2, sp=True), "bf16_pp2": dict(pp=2), "bf16_cp2_ring": dict(cp=2)}


def overflow_seen(backend) -> bool:
    """The trainer's overflow check where only rank 1's gradients hold an inf: every rank must see it
    (in training, ranks' gradients differ: TP shards, pipeline stages, distributed-optimizer slices)."""
    import mindspore as ms
    import numpy as np
    from mindspeed.training.mindspore.mixed_precision import LossScaler, unscale_and_check
    grad = np.ones((4, 3), np.float16)
    if backend.comm.rank() == 1:
        grad[2, 1] = np.inf
    _, found = unscale_and_check(backend.comm, (ms.Tensor(grad), ms.Tensor(np.ones(5, np.float16))), LossScaler(8.0))
    return found


def main(out_dir, init_ckpt, bf16_init_ckpt):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed.mindspore_parity_fp16 import BF16, ms_train_fp16
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        result = {name: ms_train_fp16(backend, init_ckpt, steps=STEPS, **kw) for name, kw in RUNS.items()}
        result.update({name: ms_train_fp16(backend, bf16_init_ckpt, BF16, steps=STEPS, **kw)
                       for name, kw in BF16_RUNS.items()})
        result["overflow_on_rank1_only"] = overflow_seen(backend)
        write_result(out_dir, rank, {"ok": True, **result})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    end_worker()
