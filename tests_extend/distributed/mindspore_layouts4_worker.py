"""msrun worker (4 processes) for test_mindspore_layouts4.py: DP=2 x TP=2, plain Adam (saved at
the last step) and with --use-distributed-optimizer, and DP=2 x PP=2 (1F1B over 4 micro-batches
per replica), 20 steps each from the torch initial checkpoint. Usage: msrun ... mindspore_layouts4_worker.py OUT_DIR INIT_CKPT"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402


def main(out_dir, init_ckpt):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed import mindspore_parity as mp
    from tests_extend.distributed.mindspore_parity_pp import ms_train_pp
    from tests_extend.distributed.mindspore_parity_zero import ms_run
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        result = {"dp2_tp2": ms_run(backend, init_ckpt, flag=False, tp=2, save_dir=os.path.join(out_dir, "ckpt"),
                                    save_at=mp.STEPS),
                  "dp2_tp2_zero": ms_run(backend, init_ckpt, flag=True, tp=2),
                  "dp2_pp2": ms_train_pp(backend, 2, init_ckpt)}
        write_result(out_dir, rank, {"ok": True, **result})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_worker()
