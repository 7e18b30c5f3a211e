"""The suite's own processes compute on one OpenMP thread each (tests_extend/conftest.py), as the
launch scripts give each rank: two pytest workers on two cores with a thread per core each spun
their pools against each other (docs/performance.md)."""
import os
import subprocess
import sys


def test_this_worker_and_its_children_compute_on_one_thread():
    """One thread unless the user's OMP_NUM_THREADS says otherwise (then that many)."""
    import torch
    threads = os.environ["OMP_NUM_THREADS"]           # set by the conftest where the user did not
    assert torch.get_num_threads() == int(threads)
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, timeout=120)
    assert child.stdout.strip() == threads, child.stderr[-2000:]
