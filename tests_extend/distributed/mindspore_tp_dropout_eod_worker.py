"""msrun worker for test_mindspore_tp_dropout_eod.py: TP=2 runs (with and without sequence
parallelism) of hidden dropout and of the EOD flags, from the trainer's own TP-independent
initialisation. Usage: msrun ... mindspore_tp_dropout_eod_worker.py OUT_DIR"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402


def main(out_dir):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed.test_mindspore_tp_dropout_eod import SP_CASES, run
    backend = MindSporeBackend("cpu")
    rank = backend.comm.rank()
    try:
        result = {f"{name}_sp{int(sp)}": run(backend, name, 2, sp) for name, sps in SP_CASES.items() for sp in sps}
        write_result(out_dir, rank, {"ok": True, **result})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(sys.argv[1])
    end_worker()
