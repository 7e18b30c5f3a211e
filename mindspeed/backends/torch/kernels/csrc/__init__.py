"""Just-in-time build of the fused C++ CPU kernels (fused_cpu.cpp) with ninja.

Built once per (torch version, CPU flags, source, compiler flags) into MindSpeed's cache root
(mindspeed/files.py: ~/.cache/mindspeed/torch_extensions/torch-<version>-cpu-<digest of the CPU's
flags> unless $MINDSPEED_CACHE_DIR moves it; without the digest for MINDSPEED_CPP_NATIVE=0). When no compiler or ninja is
available the build is skipped, one log line says so, and callers use the pure-PyTorch kernels.
MINDSPEED_DISABLE_CPP_KERNELS=1 skips the build on purpose.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from pathlib import Path

import torch

from mindspeed.files import cache_path

log = logging.getLogger("mindspeed.kernels")
_SOURCE = Path(__file__).with_name("fused_cpu.cpp")
_LIB_NAME = "mindspeed_fused_cpu"
_lock = threading.Lock()
_state: dict = {}


def native_build() -> bool:
    return os.environ.get("MINDSPEED_CPP_NATIVE", "1") == "1"


def cache_dir() -> Path:
    name = f"torch-{torch.__version__.split('+')[0]}"
    if native_build():
        # a -march=native library runs only on CPUs with this one's instruction sets: a cache that
        # moved to another machine (a copied home, a migrated disk) builds its own beside it; the
        # build held to AVX2 has its own too (torch would rebuild in place at each switch)
        from mindspeed.vec_isa_memo import cpu_flags_digest
        name += f"-cpu-{cpu_flags_digest()[:12]}" + ("-no-avx512" if "-mno-avx512f" in machine_flags() else "")
    path = Path(cache_path("torch_extensions")) / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def machine_flags() -> list[str]:
    """-march=native unless MINDSPEED_CPP_NATIVE=0; where torch's own kernels are held to AVX2
    (ATEN_CPU_CAPABILITY=avx2, as on a CPU without AVX-512), these are too."""
    if not native_build():
        return []
    flags = ["-march=native"]
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
        flags.append("-mno-avx512f")
    return flags


def _build():
    from torch.utils import cpp_extension
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed")
    flags = ["-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]  # fast-math: lets exp and reductions vectorize
    flags += machine_flags()
    build_dir = cache_dir()
    with build_lock(build_dir):
        cpp_extension.load(name=_LIB_NAME, sources=[str(_SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           build_directory=str(build_dir), is_python_module=False, verbose=False)
    return torch.ops.mindspeed_cpu


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """One build at a time per cache directory, under an OS file lock that dies with its process.
    torch's own lock (a `lock` file its loader waits on forever, even when nothing needs building)
    stays behind when a build is killed; holding this lock, any such file is stale: removed."""
    with open(build_dir / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("mindspeed: removing %s left by an interrupted kernel build", stale)
                stale.unlink()
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def fused_ops():
    """torch.ops.mindspeed_cpu once built, or None (with one log line) when it cannot be."""
    with _lock:
        if "ops" not in _state:
            if os.environ.get("MINDSPEED_DISABLE_CPP_KERNELS") == "1":
                _state["ops"], _state["why"] = None, "disabled by MINDSPEED_DISABLE_CPP_KERNELS=1"
            else:
                try:
                    _state["ops"], _state["why"] = _build(), ""
                except Exception as exc:   # no compiler / ninja / headers: degrade, never fail
                    _state["ops"], _state["why"] = None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if _state["ops"] is None:
                log.warning("mindspeed: fused C++ CPU kernels unavailable (%s); using the pure-PyTorch "
                            "rms_norm/swiglu/rope and attention softmax", _state["why"])
        return _state["ops"]


def unavailable_reason() -> str:
    fused_ops()
    return _state["why"]
