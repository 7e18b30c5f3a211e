"""ModeFreeSteps: a repeated step that made the cpu shim's CudaToCpuMode rewrite nothing runs on
without the mode (another mode on top of it stays); one that asked for cuda keeps the mode at
every step; off cpu nothing changes."""
import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from mindspeed.backends.torch.megatron_shim import CudaToCpuMode
from mindspeed.backends.torch.mode_free_steps import ModeFreeSteps


def _hooked() -> bool:
    return isinstance(_get_current_function_mode(), CudaToCpuMode)


class _Counting(TorchFunctionMode):
    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _Counting.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_step_that_asks_nothing_of_the_mode_runs_without_it_after_the_first():
    steps = ModeFreeSteps("cpu")
    with CudaToCpuMode():
        seen = [steps(lambda i: (_hooked(), torch.ones(2) * i), i) for i in range(3)]
    assert [hooked for hooked, _ in seen] == [True, False, False]
    assert [out.tolist() for _, out in seen] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def test_a_step_that_names_cuda_keeps_the_mode_at_every_step():
    steps = ModeFreeSteps("cpu")
    with CudaToCpuMode():
        outs = [steps(lambda: (_hooked(), torch.zeros(2, device="cuda"))) for _ in range(3)]
    assert all(hooked and out.device.type == "cpu" for hooked, out in outs)


def test_off_cpu_every_step_keeps_torch_function_handling():
    steps = ModeFreeSteps("npu")
    with CudaToCpuMode():
        assert all(steps(_hooked) for _ in range(3))


def test_a_mode_above_the_cuda_mode_stays_and_so_does_the_cuda_mode():
    steps = ModeFreeSteps("cpu")
    with CudaToCpuMode(), _Counting():
        before = _Counting.calls
        for _ in range(3):
            steps(lambda: torch.ones(2) + 1)
        stack = [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
    assert _Counting.calls - before >= 6 and any(isinstance(m, CudaToCpuMode) for m in stack)
