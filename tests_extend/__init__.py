# Test processes (pytest itself, and the workers run as `python -m tests_extend...`) import Megatron
# before any mindspeed.adapt(): they defer its import-time torch.compile decorations as the entry
# points do (mindspeed/deferred_compile.py; ~4 s of each such process's start).
from mindspeed import deferred_compile as _deferred_compile
from mindspeed.patching import GLOBAL_PATCHES as _GLOBAL_PATCHES

_deferred_compile.install(_GLOBAL_PATCHES)
