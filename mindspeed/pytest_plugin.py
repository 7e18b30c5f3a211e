"""`python -m pytest -p mindspeed.pytest_plugin ...`: Megatron-Core's own unit tests on any device
MindSpeed supports.

Before pytest imports Megatron's conftest, the plugin applies the adaptor (what `import
mindspeed.megatron_adaptor` does, without reading pytest's command line as MindSpeed flags; the
device comes from MINDSPEED_DEVICE, default auto). Megatron's conftest downloads a data set when
/opt/data is empty: the plugin answers that download with a message instead of the network. Tests
the device cannot run fail as their listed reason in mindspeed/megatron_test_skips.py says and are
reported skipped with that reason; a test that needs more processes than the run has is skipped
saying how many it needs.
"""
from __future__ import annotations

import functools
import gc
import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

from mindspeed import deferred_compile
from mindspeed.patching import GLOBAL_PATCHES

deferred_compile.install(GLOBAL_PATCHES)   # before Megatron's conftest imports Megatron: ~4 s of the start

from mindspeed import megatron_lm  # noqa: E402  (after the install)
from mindspeed.adaptor_core import MindSpeedConfigError, apply_plan, plan
from mindspeed.net import free_port
from mindspeed.megatron_test_skips import (listed_failure, more_ranks_needed, skip_before_running, te_name_used,
                                          uninstallable_package)

DOWNLOAD_MODULE = "tests.test_utils.python_scripts.download_unit_tests_dataset"
TE_SPEC_PROVIDERS = "megatron.core.models.backends"
LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"
DEVICE_COUNT = "torch.cuda.device_count"


def _adapt():
    try:
        if megatron_lm.present():
            return megatron_lm.adapt_megatron_lm([])
        return apply_plan(plan([]))
    except MindSpeedConfigError as exc:
        raise pytest.UsageError(str(exc)) from None


def _no_download(assets_dir, *args, **kwargs):
    print(f"MindSpeed: Megatron's unit-test data set is not downloaded (no network is reached from "
          f"tests); put it in {assets_dir} to run the tests that read it")
    return False


def _offline_download_module() -> types.ModuleType:
    module = types.ModuleType(DOWNLOAD_MODULE)
    module.download_and_extract_asset = _no_download
    module.__doc__ = "MindSpeed stand-in: the real module downloads Megatron's test data from GitHub"
    return module


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    state = _adapt()
    # Megatron's TE layer spec, from its local modules when TE is absent; cores before 0.13 have no
    # TESpecProvider to stand in for (their TE spec names TE's modules directly)
    if state.plan.backend == "torch" and importlib.util.find_spec(TE_SPEC_PROVIDERS) is not None:
        # imported here, not at the top: the module imports Megatron, which the adaptor must patch first
        from mindspeed.backends.torch.te_spec_standin import apply_te_spec_function_standins, apply_te_spec_standin
        apply_te_spec_standin(state.patcher)
        apply_te_spec_function_standins(state.patcher)
    if state.plan.backend == "torch" and importlib.util.find_spec("grouped_gemm") is None:
        # Megatron's MoE tests build GroupedMLP directly (no --moe-grouped-gemm to enable the feature)
        from mindspeed.features.fused.grouped_gemm import provide_grouped_gemm_package
        provide_grouped_gemm_package(state.context, into_main_grad=False,
                                     why="grouped_gemm absent: GroupedMLP's GEMMs through the backend's gmm")
    if state.plan.backend == "torch" and state.plan.device != "cuda":
        # Megatron's FSDP2 tests build TorchFullyShardedDataParallel directly (no --use-torch-fsdp2)
        from mindspeed.features.parallel.fsdp2_megatron import install_device_mesh
        install_device_mesh(state.patcher, state.plan.device)
    if state.patcher.find(DEVICE_COUNT) is not None and local_processes() > 1:
        # Megatron's tests take one GPU per process of the machine (test_utils' _init_distributed asserts
        # device_count() == world size); the training shim's CPU answers one device for the process
        state.patcher.remove(DEVICE_COUNT)
        state.patcher.replace(DEVICE_COUNT, local_processes, reason="Megatron's unit tests under torchrun: one "
                              "device per process of this machine (LOCAL_WORLD_SIZE), as GPUs are")
    if state.patcher.find("torch.distributed.new_group") is not None and LAZY_GLOO not in os.environ:
        state.patcher.setenv(LAZY_GLOO, "1", reason="gloo stands in for nccl: connect a group's peers on its "
                             "first collective, as NCCL does, not each of the groups every test makes")
    if state.plan.backend == "torch" and importlib.util.find_spec("transformer_engine") is None:
        from mindspeed.backends.torch.te_import_standin import test_module_builtins
        state.patcher.wrap("_pytest.assertion.rewrite.AssertionRewritingHook.exec_module", _with_te_standin(
            test_module_builtins), reason="Transformer Engine absent: a test module's own TE imports get a stand-in")
    if not hasattr(torch._C, "_nccl_version"):
        # torch built without NCCL: Megatron's skipif marks compare NCCL's version at import
        state.patcher.replace("torch.cuda.nccl.version", _no_nccl_version,
                              reason="torch without NCCL: NCCL's version probe answers (0, 0, 0), below any")
    if not any(name in os.environ for name in ("RANK", "WORLD_SIZE")):     # not under torchrun
        for name, value in _one_process_env().items():
            if name not in os.environ:
                state.patcher.setenv(name, value, reason="a one-process run: what torchrun --nproc_per_node 1 "
                                     "sets (Megatron's tests that initialise with env:// read it)")
    if DOWNLOAD_MODULE not in sys.modules:
        state.patcher.provide_module(DOWNLOAD_MODULE, _offline_download_module(),
                                     reason="Megatron's conftest must not reach for the network")


def local_processes() -> int:
    """The processes torchrun started on this machine (1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _no_nccl_version() -> tuple:
    return (0, 0, 0)


def _one_process_env() -> dict:
    # a free port: Megatron's Utils rendezvous on MASTER_PORT, 6000 when unset, which two concurrent
    # one-process runs on a machine would share
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost",
            "MASTER_PORT": str(free_port())}


def _with_te_standin(test_module_builtins):
    """Test modules execute with an `__import__` that answers their Transformer Engine imports with
    a stand-in (te_import_standin.py); Megatron's modules keep Python's own."""
    def wrapper(original):
        def exec_module(self, module):
            module.__dict__["__builtins__"] = test_module_builtins()
            return original(self, module)
        return exec_module
    return wrapper


@functools.lru_cache(maxsize=None)
def _te_present() -> bool:
    """Megatron's own answer: its GPT layer specs import Transformer Engine or not."""
    return bool(getattr(importlib.import_module("megatron.core.models.gpt.gpt_layer_specs"), "HAVE_TE", False))


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = skip_before_running(item.nodeid, _world_size())
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))   # what Megatron's test Utils reads


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    threads = thread_count()
    yield
    release_test_instance(item)
    if threads is not None and thread_count() > threads:
        # a failed test's traceback is a reference cycle (its frames, pytest's excinfo) that holds
        # the test's models and their process groups, destroyed or not; a group's gloo threads live
        # until the cycle is collected, and a full collection may come only thousands of tests later.
        # pytest also keeps the last failure for a post-mortem (sys.last_*), which holds the same frames
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
        gc.collect()


def thread_count() -> int | None:
    """This process's threads (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return None


def release_test_instance(item) -> None:
    """pytest keeps every test item, and with it the class instance its test ran on, to the end of
    the session. Megatron's test classes keep their models on that instance, and the models their
    process groups: a gloo group's worker threads live as long as the group object does, so each
    test's threads would stay. Once the test is torn down nothing reads the instance again."""
    instance = getattr(item, "instance", None)
    if instance is not None:
        vars(instance).clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        message = f"{call.excinfo.typename}: {call.excinfo.value}"
        reason = (more_ranks_needed(message, _world_size())
                  or te_name_used(call.excinfo.typename, message)
                  or uninstallable_package(message)
                  or listed_failure(item.nodeid, message, _te_present()))
        if reason:
            report.outcome = "skipped"
            report.longrepr = (item.location[0], item.location[1] or 0, f"Skipped: {reason}")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    line = cpu_time_line()
    if line:
        terminalreporter.write_line(line)


def cpu_time_line() -> str | None:
    """How long this process's main thread ran on a CPU, and how long it was ready to run but waited
    for one: on a shared machine the wait, not the tests, can make most of a run's wall time. Linux
    only (None elsewhere)."""
    try:
        with open("/proc/self/schedstat") as stat:
            ran_ns, waited_ns = (int(field) for field in stat.read().split()[:2])
    except (OSError, ValueError):
        return None
    return (f"MindSpeed: this process ran {ran_ns / 1e9:.0f} s on a CPU and waited {waited_ns / 1e9:.0f} s "
            f"for one (ready to run while other processes held the cores)")
