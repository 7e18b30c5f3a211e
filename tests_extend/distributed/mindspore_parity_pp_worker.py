"""msrun worker for test_mindspore_parity_pp.py: PP=2 (1F1B over 4 micro-batches) from the torch
initial checkpoint, saving the trained model. Usage: msrun ... mindspore_parity_pp_worker.py OUT_DIR INIT_CKPT SAVE_DIR"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import write_result  # noqa: E402


def main(out_dir, init_ckpt, save_dir):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed.mindspore_parity_pp import ms_train_pp
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        write_result(out_dir, rank, {"ok": True, "pp2": ms_train_pp(backend, 2, init_ckpt, save_dir)})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(*sys.argv[1:4])
