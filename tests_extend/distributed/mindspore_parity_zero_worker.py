"""msrun worker (2 processes) for test_mindspore_parity_zero.py: --use-distributed-optimizer at
DP=2 (20 steps, a checkpoint at step RESUME_AT), resumed from that checkpoint with and without the
flag, and at TP=2 x DP=1. Usage: msrun ... mindspore_parity_zero_worker.py OUT_DIR INIT_CKPT"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402

RESUME_AT, RESUMED_STEPS, FROM_PLAIN_STEPS, TP2_STEPS, SGD_STEPS = 10, 2, 2, 3, 3


def main(out_dir, init_ckpt):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed.mindspore_parity_zero import ms_run
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    ckpt = os.path.join(out_dir, "ckpt_zero")
    try:
        result = {"zero_dp2": ms_run(backend, init_ckpt, save_dir=ckpt, save_at=RESUME_AT)}
        result["zero_resumed"] = ms_run(backend, init_ckpt, load=ckpt, steps=RESUMED_STEPS)
        plain_ckpt = os.path.join(out_dir, "ckpt_plain")      # the other direction: plain Adam's checkpoint
        result["plain_resumed"] = ms_run(backend, init_ckpt, flag=False, load=ckpt, steps=RESUMED_STEPS,
                                         save_dir=plain_ckpt, save_at=RESUME_AT + RESUMED_STEPS)
        result["zero_from_plain"] = ms_run(backend, init_ckpt, load=plain_ckpt, steps=FROM_PLAIN_STEPS)
        sgd = ("--optimizer", "sgd")      # the slice's update is the trainer's SGD too
        result["zero_sgd_dp2"] = ms_run(backend, init_ckpt, steps=SGD_STEPS, extra=sgd)
        result["plain_sgd_dp2"] = ms_run(backend, init_ckpt, flag=False, steps=SGD_STEPS, extra=sgd)
        result["zero_tp2_dp1"] = ms_run(backend, init_ckpt, tp=2, steps=TP2_STEPS)
        write_result(out_dir, rank, {"ok": True, **result})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_worker()
