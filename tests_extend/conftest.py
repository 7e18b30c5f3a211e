import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# child processes (spawn, torchrun, msrun) find the checkout too
os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
# the measured peak FLOP/s of MFU (mindspeed/training/peak.py) is cached per test session, in a
# directory of its own, not in the user's ~/.cache (children inherit it)
if "MINDSPEED_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["MINDSPEED_CACHE_DIR"] = tempfile.mkdtemp(prefix="mindspeed-test-cache-")
