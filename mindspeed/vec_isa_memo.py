"""TorchInductor's vector-ISA probe, run once per machine instead of once per process.

Before its first C++ kernel, every process's TorchInductor finds which vector instruction sets
(AVX2, AVX-512, ...) the CPU and the C++ compiler can use: it builds a small program per ISA and
loads each one in a new Python process. That costs about a second of the start of every process
that compiles (each rank of a Megatron run whose fusions compile). The answer depends only on the
CPU, the compiler and torch, so the first process that probes records it beside the kernel cache,
and later processes with the same CPU flags, compiler file and torch set torch's own switch,
`torch._inductor.config.cpp.vec_isa_ok = True`, instead of probing again.

The record is used only where every ISA the CPU's flags allow passed the probe: `vec_isa_ok = True`
then picks exactly what the probe would. Where one failed, or the user set TORCHINDUCTOR_VEC_ISA_OK
(or the switch) themselves, torch probes or obeys as before. x86-64 Linux only (elsewhere torch's
list is not "the CPU's flags, filtered by the probe").

`install(patcher)` (the torch backend, before anything compiles) hooks the import of
torch._inductor.config, the hook one of `patcher`'s patches: a process that never compiles imports
and reads nothing more. The switch, once set, stays set in torch's config as the user's
TORCHINDUCTOR_VEC_ISA_OK would: torch reads it again each time it asks whether an ISA works, so
setting it back when the patches are removed would start the probe then.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile

from mindspeed import compile_cache, import_hooks

RECORD_NAME = "mindspeed_vec_isa.json"
CONFIG_MODULE = "torch._inductor.config"


def record_path() -> str:
    return os.path.join(compile_cache.cache_dirs()[0], RECORD_NAME)


def _cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line for line in f if line.startswith("flags")), "")


def cpu_flags_digest() -> str:
    """A digest of this CPU's instruction-set flags: what code built for this machine depends on."""
    return hashlib.sha256(_cpu_flags().encode()).hexdigest()


def machine_key() -> dict:
    """What the probe's answer depends on: torch's build, the compiler torch would run (its own
    default, $CXX or g++), the CPU's flags."""
    import torch
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    compiler_id = None
    if compiler:
        real = os.path.realpath(compiler)
        stat = os.stat(real)
        compiler_id = [real, stat.st_size, stat.st_mtime_ns]
    return {"torch": torch.__version__, "torch_dir": os.path.dirname(torch.__file__), "compiler": compiler_id,
            "cpu_flags": cpu_flags_digest()}


def _read_record() -> dict | None:
    try:
        with open(record_path()) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def record_applies(record: dict | None, key: dict) -> bool:
    return bool(record and record.get("key") == key and record.get("allowed")
                and record.get("probed") == record.get("allowed"))


def write_record(key: dict, probed: list[str], allowed: list[str]) -> None:
    """Atomically: a reader sees the old record or the new one, never half of one."""
    path = record_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=RECORD_NAME)
    with os.fdopen(fd, "w") as f:
        json.dump({"key": key, "probed": probed, "allowed": allowed}, f)
    os.replace(tmp, path)


def _probed_here():
    """torch's cpu_vec_isa module once this process has its ISA list (probed or switched), else None."""
    isa = sys.modules.get("torch._inductor.cpu_vec_isa")
    return isa if isa is not None and isa.valid_vec_isa_list.cache_info().currsize else None


def _record_what_torch_probed(key: dict) -> None:
    """At exit: if this process probed, write down what it found (the ISAs the CPU's flags allow,
    and those that passed)."""
    isa = _probed_here()
    if isa is None:
        return                                      # never compiled, or not probed
    flags = isa.x86_isa_checker()
    allowed = [str(v) for v in isa.supported_vec_isa_list if all(f in flags for f in str(v).split())]
    try:
        write_record(key, [str(v) for v in isa.valid_vec_isa_list()], allowed)
    except OSError:                                 # a read-only cache: the next process probes
        pass


def use_record_or_keep_the_probe(config) -> None:
    """Skip the probe where the record stands for it; otherwise record what torch probes."""
    if config.cpp.vec_isa_ok is not None or _probed_here() is not None:
        return                                      # the user's TORCHINDUCTOR_VEC_ISA_OK, or probed already
    key = machine_key()
    if record_applies(_read_record(), key):
        config.cpp.vec_isa_ok = True
    else:
        atexit.register(_record_what_torch_probed, key)


@contextlib.contextmanager
def _after_the_body(config):
    yield
    use_record_or_keep_the_probe(config)


HOOK_NAME = "vec-isa-memo"
REASON = "TorchInductor's vector-ISA probe answered from this machine's record (~1 s of each compiling process)"


def install(patcher) -> None:
    """From the torch backend; a no-op where the record cannot stand for the probe."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return
    if CONFIG_MODULE in sys.modules:
        use_record_or_keep_the_probe(sys.modules[CONFIG_MODULE])
    elif not patcher.has_import_hook(HOOK_NAME):
        patcher.hook_imports(import_hooks.AroundImport(HOOK_NAME, CONFIG_MODULE.__eq__, _after_the_body),
                             reason=REASON)
