"""Fault injection (on PYTHONPATH in test_fresh_setup.py): on the rank named by
MINDSPEED_TEST_NO_PSUTIL_RANK psutil is missing, as in a torch-only setup before psutil was pinned;
on every other rank (and in processes without RANK) the real psutil loads in its place."""
import importlib
import os
import sys

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("MINDSPEED_TEST_NO_PSUTIL_RANK"):
    raise ImportError("No module named 'psutil' (hidden on this rank by the test)")
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
del sys.modules["psutil"]
sys.modules["psutil"] = importlib.import_module("psutil")   # what `import psutil` returns from here on
