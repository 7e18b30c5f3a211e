"""msrun worker: the context-parallel test body of cp_cases on the mindspore backend.
Usage: msrun ... cp_mindspore_worker.py OUT_DIR DTYPE[,DTYPE] [LABEL[,LABEL]]
(LABELs: the cp_cases.cases_for labels to run; default all, on a CP group = the world)"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402


def main(out_dir, dtypes, labels=None):
    from mindspeed.backends import set_backend
    backend = set_backend("mindspore", "cpu")
    rank, world = backend.comm.rank(), backend.comm.world_size()
    try:
        from tests_extend.distributed import cp_cases, ms_kit
        write_result(out_dir, rank, {"ok": True, "world": world,
                                     "errors": cp_cases.run_all(ms_kit, world, dtypes, labels=labels)})
    except Exception:
        write_result(out_dir, rank, {"ok": False, "error": traceback.format_exc()})


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2].split(",")), tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else None)
    end_worker()
