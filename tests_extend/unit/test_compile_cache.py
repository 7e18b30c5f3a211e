"""A kernel file a killed compile left in TorchInductor's cache is deleted before anything compiles,
so the next run builds it again instead of failing on it (mindspeed/compile_cache.py)."""
import fcntl
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from mindspeed import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ELF = os.path.realpath(shutil.which("true"))   # any real ELF file


def _plant(path, data=b""):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_cut_short_files_are_told_from_whole_ones(tmp_path):
    whole = open(ELF, "rb").read()
    assert not compile_cache.is_cut_short(ELF)
    for cut in (0, 40, len(whole) // 2, len(whole) - 1):
        assert compile_cache.is_cut_short(_plant(str(tmp_path / f"cut{cut}.so"), whole[:cut])), cut
    assert not compile_cache.is_cut_short(_plant(str(tmp_path / "header.h.gch"), b"gpch.013" + b"\0" * 100))


def test_only_broken_unlocked_files_are_removed(tmp_path):
    root = str(tmp_path / "cache")
    whole = open(ELF, "rb").read()
    good = _plant(f"{root}/ab/cabgood.main.so", whole)
    empty = _plant(f"{root}/cd/ccdempty.main.so")
    cut = _plant(f"{root}/ef/cefcut.so", whole[: len(whole) // 2])
    half_built = _plant(f"{root}/precompiled_headers/chdr.h.gch", b"gpch.013" + b"\0" * 100)
    os.makedirs(f"{root}/precompiled_headers/chdr.h_CxxBuild")
    busy = _plant(f"{root}/gh/cghbusy.main.so")
    lock = _plant(f"{root}/locks/cghbusy.lock")
    with open(lock) as held:             # a live compile holds its kernel's lock
        fcntl.flock(held, fcntl.LOCK_EX)
        removed = compile_cache.remove_broken_kernels([root, str(tmp_path / "no-such-cache")])
    assert sorted(removed) == sorted([empty, cut, half_built])
    assert os.path.exists(good) and os.path.exists(busy)
    assert not os.path.exists(f"{root}/precompiled_headers/chdr.h_CxxBuild")


KERNEL = textwrap.dedent("""
    import sys
    import torch
    if sys.argv[1] == "adapted":
        import mindspeed
        mindspeed.adapt(None)
    f = torch.compile(lambda x: (x.sin() * 2 + 1).relu())
    print("result", f(torch.arange(8.0)).sum().item())
""")


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="TorchInductor needs a C++ compiler on a CPU")
def test_a_run_after_a_killed_compile_builds_the_kernel_again(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT)

    def run(mode):
        return subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True,
                              timeout=900)

    first = run("plain")
    assert "result 10.5389" in first.stdout, first.stderr[-3000:]
    libraries = [os.path.join(d, n) for d, _, names in os.walk(env["TORCHINDUCTOR_CACHE_DIR"])
                 for n in names if n.endswith(".so")]
    assert libraries
    for path in libraries:               # what a link killed before it wrote anything leaves
        open(path, "wb").close()
    broken = run("plain")                # torch alone trusts the empty files
    assert broken.returncode != 0 and "result" not in broken.stdout, broken.stdout
    healed = run("adapted")
    assert "result 10.5389" in healed.stdout, healed.stderr[-3000:]
    assert all(os.path.getsize(path) > 0 for path in libraries if os.path.exists(path))
