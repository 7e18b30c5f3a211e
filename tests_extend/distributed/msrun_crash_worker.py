"""msrun worker for test_msrun_helper: rank 1 dies of SIGSEGV on the first launch (no marker file yet)
or raises a Python error (mode "raise"); otherwise every rank writes its result.
Usage: msrun ... msrun_crash_worker.py OUT_DIR MODE"""
import faulthandler
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import write_result  # noqa: E402


def main(out_dir, mode):
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return
    rank = int(os.environ["RANK_ID"])
    marker = os.path.join(out_dir, "..", f"launched.{rank}")
    with open(marker, "a") as f:      # one character per launch
        f.write("x")
    with open(marker) as f:
        launches = len(f.read())
    if rank == 1 and mode == "raise":
        raise ValueError("a Python error in the worker")
    if rank == 1 and launches == 1:
        faulthandler._sigsegv()
    write_result(out_dir, rank, {"launch": launches, "mark": os.environ.get("MINDSPEED_MSRUN_LAUNCH")})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
