import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# child processes (spawn, torchrun, msrun) find the checkout too
os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
# tests keep MindSpeed's caches (built kernels, the bundled corpus, the peak FLOP/s measured under
# test load) in a root of their own, not in the user's (children inherit it)
if "MINDSPEED_CACHE_DIR" not in os.environ:
    os.environ["MINDSPEED_CACHE_DIR"] = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mindspeed-tests")
