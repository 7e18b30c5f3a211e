"""msrun worker for test_worker_exit.py: rank 1 works DELAY seconds longer than rank 0; each rank
registers an exit handler that leaves a file behind, writes its result and ends with end_worker().
Usage: msrun ... worker_exit_worker.py OUT_DIR DELAY"""
import atexit
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402


def main(out_dir: str, delay: float) -> None:
    from mindspeed.backends import set_backend
    rank = set_backend("mindspore", "cpu").comm.rank()
    atexit.register(lambda: open(os.path.join(out_dir, f"exit_handlers_ran{rank}"), "w").close())
    if rank == 1:
        time.sleep(delay)
    write_result(out_dir, rank, {"ok": True, "finished_at": time.time()})


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
    end_worker()
