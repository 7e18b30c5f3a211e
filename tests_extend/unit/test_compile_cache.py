"""A kernel file a killed compile left in TorchInductor's cache is deleted before anything compiles,
so the next run builds it again instead of failing on it (mindspeed/compile_cache.py); the
CPU's vector-ISA probe runs once per machine (mindspeed/vec_isa_memo.py)."""
import fcntl
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from mindspeed import compile_cache, vec_isa_memo

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
    import json
    import sys
    import torch
    if sys.argv[1] == "adapted":
        import mindspeed
        mindspeed.adapt(None)
    from torch._inductor import config, cpu_vec_isa
    probes = []                          # counted, then done by torch itself
    real_check_build = cpu_vec_isa.VecISA.check_build
    cpu_vec_isa.VecISA.check_build = lambda isa, code: probes.append(str(isa)) or real_check_build(isa, code)
    f = torch.compile(lambda x: (x.sin() * 2 + 1).relu())
    print("result", f(torch.arange(8.0)).sum().item())
    print(json.dumps({"vec_isa_ok": config.cpp.vec_isa_ok, "picked": str(cpu_vec_isa.pick_vec_isa()),
                      "probes": probes}))
""")


def _isa(run):
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="TorchInductor needs a C++ compiler on a CPU")
def test_a_killed_compile_is_built_again_and_the_isa_probe_then_runs_once(tmp_path):
    """One fresh cache for both (a first probe builds a dozen programs): after a killed compile the
    adapted run rebuilds the kernels and records the vector-ISA probe; the next adapted run uses
    the record (torch's own switch) and picks the same ISA."""
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT)
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)

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

    probed = _isa(healed)
    assert probed["vec_isa_ok"] is None and probed["probes"], probed
    record_file = tmp_path / "inductor" / vec_isa_memo.RECORD_NAME
    record = json.loads(record_file.read_text())
    assert record["probed"] == record["allowed"] and probed["picked"] in " ".join(record["allowed"]), record

    recorded = run("adapted")
    assert "result 10.5389" in recorded.stdout, recorded.stderr[-3000:]
    used = _isa(recorded)
    assert used["vec_isa_ok"] is True and used["picked"] == probed["picked"], (used, probed)
    assert len(used["probes"]) < len(probed["probes"]), (used, probed)   # left: torch's sub-feature checks


def test_a_record_is_used_only_for_its_machine_and_when_every_allowed_isa_passed():
    import torch
    mine = vec_isa_memo.machine_key()
    assert mine["torch"] == torch.__version__ and mine["cpu_flags"] and mine == vec_isa_memo.machine_key()
    key = {"torch": "t"}
    assert vec_isa_memo.record_applies({"key": key, "probed": ["avx2"], "allowed": ["avx2"]}, key)
    assert not vec_isa_memo.record_applies({"key": key, "probed": ["avx2"], "allowed": ["avx512", "avx2"]}, key)
    assert not vec_isa_memo.record_applies({"key": key, "probed": [], "allowed": []}, key)
    assert not vec_isa_memo.record_applies({"key": {"torch": "u"}, "probed": ["avx2"], "allowed": ["avx2"]}, key)
    assert not vec_isa_memo.record_applies(None, key)


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="the record stands for the probe on x86-64 Linux only")
def test_the_probes_import_hook_is_a_listed_patch_that_is_removed():
    """Before torch._inductor.config is imported, install hooks its import as one of the patcher's
    patches (once however often it is called); removing the patches takes the hook off."""
    code = textwrap.dedent("""
        import sys
        from mindspeed import vec_isa_memo
        from mindspeed.patching import PatchManager
        patcher = PatchManager()
        vec_isa_memo.install(patcher)
        vec_isa_memo.install(patcher)
        print(patcher.describe() == "import  sys.meta_path[vec-isa-memo] - " + vec_isa_memo.REASON)
        hook = patcher.applied()[0].new
        print(sys.meta_path[0] is hook, vec_isa_memo.CONFIG_MODULE in sys.modules)
        patcher.remove_all()
        print(any(finder is hook for finder in sys.meta_path))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True", "False", "False"]
