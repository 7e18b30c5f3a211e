import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# child processes (spawn, torchrun, msrun) find the checkout too
os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
# one compute thread per process, as torchrun and the launch scripts give each rank: the suite runs
# two pytest workers on two cores, and their in-process tests' OpenMP pools (one thread per core
# each) spun against each other and against the ranks the tests start (docs/performance.md: the
# same unit tests took three times the CPU time). A value the user set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:        # a plugin imported torch before this file: it read the variable already
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# tests keep MindSpeed's caches (built kernels, the bundled corpus, the peak FLOP/s measured under
# test load) in a root of their own, not in the user's (children inherit it)
if "MINDSPEED_CACHE_DIR" not in os.environ:
    os.environ["MINDSPEED_CACHE_DIR"] = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mindspeed-tests")
