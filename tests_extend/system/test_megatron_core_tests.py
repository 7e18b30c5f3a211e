"""Megatron-Core's own unit tests through mindspeed.pytest_plugin (what .ci/megatron_core_tests runs):
two test files pass through the plugin in a real pytest subprocess, every skip-list entry names
a test that exists and says why, and a class test's process groups (their gloo threads) do not
outlive the test. Needs the core_v0.16.1 snapshot and its tests tarball
($MINDSPEED_MEGATRON_LM_SNAPSHOTS or ../shared/megatron-lm); skipped, saying so, without them."""
import ast
import importlib.util
import os
import re
import subprocess
import sys
import tarfile

import pytest

from mindspeed.files import safe_extract
from mindspeed.megatron_test_skips import CUDA_ONLY, RANKS, SKIPS, TOO_LARGE
from mindspeed.net import free_port
from tests_extend.system.megatron_lm_kit import ROOT, snapshot, snapshot_dir

TESTS_TARBALL = "Megatron-LM-core_v0.16.1-tests.tar.gz"


def _tests_tarball():
    directory = snapshot_dir()
    path = directory and os.path.join(directory, TESTS_TARBALL)
    return path if path and os.path.isfile(path) else None


needs_snapshots = pytest.mark.skipif(
    snapshot("0.16.1") is None or _tests_tarball() is None,
    reason=f"Megatron-LM core_v0.16.1 snapshot and {TESTS_TARBALL} absent (set MINDSPEED_MEGATRON_LM_SNAPSHOTS)")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    dest = str(tmp_path_factory.mktemp("megatron-core-tests"))
    safe_extract(snapshot("0.16.1"), dest)
    safe_extract(_tests_tarball(), dest)
    return dest


def _counts(summary: str) -> dict:
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}


# Megatron's Triton kernel (the MoE dispatcher's multihot conversion) against its torch reference,
# forward and backward: 20 local experts, top-7, 8 tokens and 31 experts, top-2, 5 tokens
MULTIHOT = ["tests/unit_tests/transformer/moe/test_multihot_indices_converter.py::TestIndicesToMultihot::"
            f"test_indices_to_multihot[{case}]" for case in ("20-7-8", "31-2-5")]
# Megatron's GroupedMLP, built where the CUDA grouped_gemm package is absent (the backend's gmm serves it)
GROUPED_MLP = ["tests/unit_tests/transformer/moe/test_moe_layer.py::TestMoELayerInit::"
               "test_legacy_moe_layer[True-2-alltoall]"]
# Megatron's tests that initialise torch.distributed with env:// (torchrun's variables): in a one-process
# run the plugin sets what torchrun --nproc_per_node 1 would, and the test skips itself (it needs 8)
ENV_RENDEZVOUS = ["tests/unit_tests/pipeline_parallel/test_bridge_communicator.py::TestBridgeCommunicator::"
                  "test_bridge_communicator_init"]
# files that did not import without TE / NCCL: BERT's TE spec (the stand-in builds it, TE's parameter
# count), and NCCL's version probe in a skipif mark (a torch without NCCL)
IMPORT_STANDINS = ["tests/unit_tests/models/test_bert_model.py::TestBertModel", "tests/unit_tests/test_nccl_allocator.py"]
# Megatron's own checks of the no-TE / no-CUDA fallbacks (tests_extend/unit/test_megatron_cpu_fallbacks.py):
# CLIP's default norm, torch's Adam with lr=None and a fresh distributed optimizer's state dict, NVTX ranges
# test_optimizer.py and test_utils.py import `mock` (the megatron-core-tests extra, not the main suite's
# install): where it is absent they run in CI's Megatron-Core stage, which installs it
MOCK = importlib.util.find_spec("mock") is not None
FALLBACKS = ["tests/unit_tests/models/test_clip_vit_model.py::TestCLIPViTModel::test_constructor",
             *(["tests/unit_tests/test_optimizer.py::test_optim_sharded_state_dict[fp32-True]",
                "tests/unit_tests/test_utils.py::test_nvtx_range", "tests/unit_tests/test_utils.py::test_nvtx_decorator"]
               if MOCK else [])]
FALLBACK_PASSES = 7 if MOCK else 1          # test_nvtx_range has four parametrizations
# what `python -m pytest` imports when triton is not installed (find_spec answers None, import fails)
WITHOUT_TRITON = "import sys; sys.modules['triton'] = None; import pytest; sys.exit(pytest.main(sys.argv[1:]))"


def _plugin_run(checkout, *tests, python_args=("-m", "pytest")):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([checkout, ROOT]))
    for name in ("WORLD_SIZE", "TRITON_INTERPRET"):
        env.pop(name, None)
    return subprocess.run([sys.executable, *python_args, "-p", "mindspeed.pytest_plugin", "-p", "no:cacheprovider",
                           "-p", "no:xdist", "-q", "-rs", "-W", "ignore", *tests],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=600)


TRITON = importlib.util.find_spec("triton") is not None
NO_TRITON_SKIP = "MindSpeed skip list: calls one of Megatron's Triton kernels"


@needs_snapshots
def test_megatron_test_files_pass_through_the_plugin(checkout):
    """With triton (the megatron-core-tests extra) the Triton-kernel cases pass through triton's CPU
    interpreter; without it (the main suite's install) they are skipped with the list's reason and
    everything else passes the same."""
    files = ["tests/unit_tests/models/test_base_embedding.py", "tests/unit_tests/transformer/test_mlp.py"]
    out = _plugin_run(checkout, *files, *MULTIHOT, *GROUPED_MLP, *ENV_RENDEZVOUS, *IMPORT_STANDINS, *FALLBACKS)
    last = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    counts = _counts(last)
    kernels_passed = len(MULTIHOT) if TRITON else 0
    assert counts.get("passed", 0) >= 4 + kernels_passed + len(GROUPED_MLP) + 3 + FALLBACK_PASSES, last
    assert "failed" not in counts and "error" not in counts and "errors" not in counts, last
    assert "These tests require 8 GPUs, but only 1 are available" in out.stdout, out.stdout[-3000:]
    skipped_lines = out.stdout.split("short test summary info")[-1]
    if TRITON:
        assert "Triton" not in skipped_lines, out.stdout[-3000:]
    else:
        # pytest folds equal skips into one "SKIPPED [n]" line
        kernel_skips = re.findall(r"SKIPPED \[(\d+)\] [^\n]*" + re.escape(NO_TRITON_SKIP), skipped_lines)
        assert sum(map(int, kernel_skips)) == len(MULTIHOT), out.stdout[-3000:]
    # test_gpu_forward asserts a CUDA tensor: skipped by the list, with its reason
    assert "MindSpeed skip list: asserts that its output is a CUDA tensor" in out.stdout
    assert "Requires at least NCCL v2.27.0" in out.stdout, out.stdout[-3000:]     # Megatron's own mark
    assert "MindSpeed skip list: builds Megatron's NCCL memory-pool allocator" in out.stdout, out.stdout[-3000:]


@needs_snapshots
@pytest.mark.skipif(not TRITON, reason="triton is not installed: test_megatron_test_files_pass_through_the_plugin "
                                       "runs this setup itself")
def test_without_triton_megatrons_triton_kernels_are_skipped_saying_how_to_run_them(checkout):
    """The other setup where triton is installed: hide it. Megatron (and megatron.training, whose
    batch-invariant kernels import triton) still imports through the plugin; the kernel's test is
    reported skipped with the list's reason, not failed."""
    out = _plugin_run(checkout, MULTIHOT[1], python_args=("-c", WITHOUT_TRITON))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert _counts(out.stdout.strip().splitlines()[-1]) == {"skipped": 1}, out.stdout[-3000:]
    assert NO_TRITON_SKIP in out.stdout, out.stdout[-3000:]


KEEPS_GROUPS = """
import gc

import pytest
import torch.distributed as dist

gc.disable()     # a long run's full collections come rarely: a failed test's reference cycle stays

THREADS = []


def _threads():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class TestKeepsItsGroup:
    # as Megatron's test classes do: a model on the instance holds its process groups
    def setup_method(self):
        THREADS.append(_threads())
        self.group = dist.new_group([0])

    def teardown_method(self):
        dist.destroy_process_group(self.group)     # destroyed, still referenced by the instance

    @pytest.mark.parametrize("n", range(8))
    def test_uses_its_group(self, n):
        dist.barrier(group=self.group)


@pytest.mark.xfail(raises=AssertionError, strict=True)
@pytest.mark.parametrize("n", range(4))
def test_fails_holding_its_group(n):
    THREADS.append(_threads())
    group = dist.new_group([0])
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    # fails: its traceback, a reference cycle through pytest's frames, holds the destroyed group
    assert group is None


def test_threads_stay_flat():
    assert THREADS[-1] <= THREADS[0] + 1, THREADS
"""


def test_a_class_tests_process_groups_do_not_outlive_it(tmp_path):
    (tmp_path / "test_keeps_groups.py").write_text(KEEPS_GROUPS)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("WORLD_SIZE", None)

    def run(*plugin):
        return subprocess.run([sys.executable, "-m", "pytest", *plugin, "-p", "no:cacheprovider", "-p", "no:xdist",
                               "-q", "-W", "ignore", "test_keeps_groups.py"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    with_plugin = run("-p", "mindspeed.pytest_plugin")
    assert with_plugin.returncode == 0, with_plugin.stdout[-3000:] + with_plugin.stderr[-2000:]
    # plain pytest keeps every instance, its group and the group's gloo threads to the end
    plain = run()
    assert plain.returncode == 1 and "test_threads_stay_flat" in plain.stdout, plain.stdout[-3000:]



CONNECTS_ON_FIRST_USE = """
import os

import torch.distributed as dist

from mindspeed.patching import GLOBAL_PATCHES


def _sockets():
    links = (os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
             if os.path.exists(f"/proc/self/fd/{fd}"))
    return sum(link.startswith("socket:") for link in links)


def test_a_gloo_group_connects_its_peers_on_its_first_collective():
    dist.init_process_group("nccl")                 # gloo stands in, rendezvous from torchrun
    assert "TORCH_GLOO_LAZY_INIT" in GLOBAL_PATCHES.describe()
    before = _sockets()
    groups = [dist.new_group([0, 1]) for _ in range(12)]
    # each group listens (one socket); connected at creation it would hold a second, to the peer
    # (one more: the peer may already have connected for the barrier below)
    assert _sockets() - before <= len(groups) + 1
    dist.barrier(group=groups[0])                   # the first collective connects, and works
    for group in groups:
        dist.destroy_process_group(group)
    dist.destroy_process_group()
"""


def test_two_ranks_connect_a_groups_peers_on_first_use_and_say_what_they_waited_for(tmp_path):
    """Megatron's tests make and drop dozens of groups per test; connected at creation, each is a
    handshake through the rendezvous store between processes that each must get a CPU."""
    (tmp_path / "test_connects_on_first_use.py").write_text(CONNECTS_ON_FIRST_USE)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("TORCH_GLOO_LAZY_INIT", None)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master-port", str(free_port()), "-m", "pytest", "-p", "mindspeed.pytest_plugin",
                          "-p", "no:cacheprovider", "-p", "no:xdist", "-q", "-W", "ignore",
                          "test_connects_on_first_use.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert out.stdout.count("1 passed") == 2, out.stdout[-3000:]
    assert out.stdout.count("MindSpeed: this process ran") == 2, out.stdout[-3000:]


TE_PROBE_ON_0_12 = """
from megatron.core.package_info import __version__
from megatron.core.utils import is_te_min_version


def test_the_te_probe_says_not_installed():
    assert __version__.startswith("0.12."), __version__
    assert is_te_min_version("1.3") is False      # Megatron's conftest asks this around every test


def test_the_shared_causal_mask_clears_as_megatrons_cached_one_does():
    from megatron.core.transformer.utils import get_default_causal_mask
    first = get_default_causal_mask(4)
    assert get_default_causal_mask(4) is first
    get_default_causal_mask.cache_clear()           # what core 0.12's softmax tests do after each test
    assert get_default_causal_mask(4) is not first
"""


@pytest.mark.skipif(snapshot("0.12.1") is None, reason="Megatron-LM core_v0.12.1 snapshot absent "
                    "(set MINDSPEED_MEGATRON_LM_SNAPSHOTS)")
def test_core_0_12s_te_probe_and_cached_mask_through_the_plugin(tmp_path):
    """Before core 0.13 Megatron reads TE's version by importing it (ModuleNotFoundError without TE),
    so without the shim every test of core_v0.12.1 errors in its conftest's fixture; and its causal
    mask is lru-cached, which its tests clear through MindSpeed's shared-mask wrapper."""
    safe_extract(snapshot("0.12.1"), str(tmp_path))
    (tmp_path / "test_te_probe.py").write_text(TE_PROBE_ON_0_12)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "mindspeed.pytest_plugin", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-q", "-W", "ignore", "test_te_probe.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]

def _definitions(path: str) -> set:
    """'Class::method' (methods inherited from a class of the same file included) and 'function'
    names a test file defines."""
    tree = ast.parse(open(path).read())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def methods(cls: ast.ClassDef) -> set:
        own = {item.name for item in cls.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                own |= methods(classes[base.id])
        return own

    names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for name, cls in classes.items():
        names.update(f"{name}::{method}" for method in methods(cls))
    return names


@pytest.mark.skipif(_tests_tarball() is None, reason=f"{TESTS_TARBALL} absent (set MINDSPEED_MEGATRON_LM_SNAPSHOTS)")
def test_every_skip_list_entry_names_an_existing_test_and_says_why(tmp_path):
    with tarfile.open(_tests_tarball()) as archive:
        names = set(archive.getnames())
    safe_extract(_tests_tarball(), str(tmp_path))
    for test in list(SKIPS) + list(CUDA_ONLY) + [name.split("[", 1)[0] for name in (*RANKS, *TOO_LARGE)]:
        path, _, name = test.partition("::")
        assert path in names, f"{test}: no such file in {TESTS_TARBALL}"
        assert name in _definitions(os.path.join(tmp_path, path)), f"{test}: no such test"
    for test, reason in SKIPS.items():
        assert "user" in reason.text and len(reason.text) > 60, f"{test}: the reason must say what a user loses"
        assert reason.signature and all(reason.signature), f"{test}: the reason must name the failure it explains"
    assert all(need > 1 for need in RANKS.values())
    assert all("user" in text or "not run there" in text for text in (*TOO_LARGE.values(), *CUDA_ONLY.values()))
