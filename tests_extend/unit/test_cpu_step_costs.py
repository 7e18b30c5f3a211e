"""What a cpu training step no longer pays for, each checked against the result it replaces:
Megatron's linear Function where it only computes a linear (torch's linear instead), the device
shim's mode on every torch call (the step asks it for nothing), gloo for an all-reduce over one
rank, fresh pages for every step's activations (glibc keeps the freed ones), a separate bias
add after the MLP's first linear, Megatron's vocab-parallel cross entropy over one rank, and
torch's single-tensor Adam (its fused kernel instead)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import mindspeed
from mindspeed.backends.torch import glibc_heap
from mindspeed.backends.torch.cpu_torch_view import CpuTorchView
from tests_extend.distributed.harness import run_distributed
from tests_extend.unit import cpu_step_workers

MEGATRON_FUNCTION = "LinearWithGradAccumulationAndAsyncCommunicationBackward"


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


def _leaves(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, requires_grad=True) for shape in ((8, 2, 16), (24, 16), (24,))]


def _run(linear, leaves, **flags):
    out = linear(*leaves, gradient_accumulation_fusion=False, grad_output_buffer=None, wgrad_deferral_limit=None,
                 **flags)
    out.square().sum().backward()
    return out, [leaf.grad for leaf in leaves]


def test_a_linear_without_communication_is_torchs_own_with_megatrons_results(one_rank):
    import megatron.core.tensor_parallel.layers as layers
    original = layers.linear_with_grad_accumulation_and_async_allreduce
    expected_out, expected_grads = _run(original, _leaves(0), allreduce_dgrad=False, sequence_parallel=False,
                                        tp_group=one_rank)
    state = mindspeed.adapt([])
    try:
        assert "megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce" \
            in state.patcher.describe()
        out, grads = _run(layers.linear_with_grad_accumulation_and_async_allreduce, _leaves(0),
                          allreduce_dgrad=False, sequence_parallel=False, tp_group=one_rank)
        assert MEGATRON_FUNCTION not in cpu_step_workers._node_names(out.grad_fn)
        torch.testing.assert_close(out, expected_out, rtol=1e-6, atol=1e-6)
        for grad, expected in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-5)
        # a call that communicates keeps Megatron's Function
        kept, _ = _run(layers.linear_with_grad_accumulation_and_async_allreduce, _leaves(0),
                       allreduce_dgrad=True, sequence_parallel=False, tp_group=one_rank)
        assert type(kept.grad_fn).__name__ == MEGATRON_FUNCTION
    finally:
        mindspeed.unadapt()
    assert layers.linear_with_grad_accumulation_and_async_allreduce is original


def test_a_blocking_all_reduce_over_one_rank_leaves_gloo_out(one_rank):
    state = mindspeed.adapt([])
    try:
        assert "torch.distributed.all_reduce" in state.patcher.describe()
        values = torch.tensor([1.0, 2.0, 3.0])
        with torch.profiler.profile() as prof:
            dist.all_reduce(values)
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=one_rank)
            dist.all_reduce(values, async_op=True).wait()      # the caller waits on a work object: kept
        ran = [event.name for event in prof.events() if event.name.startswith("c10d::allreduce")]
        assert ran == ["c10d::allreduce_"] and values.tolist() == [1.0, 2.0, 3.0]
    finally:
        mindspeed.unadapt()


def test_a_tensor_parallel_region_over_one_rank_is_its_input_with_megatrons_gradients(one_rank):
    from megatron.core.tensor_parallel import mappings
    from mindspeed.backends.torch.one_rank_regions import REGIONS, _wrap_region
    functions = {"copy_to_tensor_model_parallel_region": mappings._CopyToModelParallelRegion,
                 "reduce_from_tensor_model_parallel_region": mappings._ReduceFromModelParallelRegion,
                 "scatter_to_tensor_model_parallel_region": mappings._ScatterToModelParallelRegion,
                 "gather_from_tensor_model_parallel_region": mappings._GatherFromModelParallelRegion}
    assert set(functions) == set(REGIONS)
    for name, function in functions.items():
        x, y = (torch.randn(4, 6, generator=torch.Generator().manual_seed(3)).requires_grad_() for _ in range(2))
        out = _wrap_region(getattr(mappings, name))(x, one_rank)
        assert out is x, name
        (out * torch.arange(6.0)).sum().backward()
        megatron = function.apply(y, one_rank)
        (megatron * torch.arange(6.0)).sum().backward()
        assert torch.equal(out, megatron) and torch.equal(x.grad, y.grad), name


def test_a_tensor_parallel_region_over_two_ranks_keeps_megatrons_collective():
    for rank_report in run_distributed(cpu_step_workers.regions_over_two_ranks, world_size=2, timeout=120):
        assert rank_report == 3.0


def _cross_entropy(function, logits, target, **kwargs):
    leaf = logits.clone().requires_grad_()
    loss = function(leaf, target, **kwargs)
    (loss * torch.arange(1.0, 1.0 + loss.numel()).view(loss.shape)).sum().backward()
    return loss, leaf.grad


def test_cross_entropy_over_one_rank_is_torchs_with_megatrons_losses_and_gradients(one_rank):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel import cross_entropy
    from mindspeed.backends.torch.one_rank_cross_entropy import SITE
    g = torch.Generator().manual_seed(7)
    logits, target = torch.randn(6, 3, 40, generator=g) * 4, torch.randint(0, 40, (6, 3), generator=g)
    original = cross_entropy.vocab_parallel_cross_entropy
    parallel_state.initialize_model_parallel(1)
    state = mindspeed.adapt([])
    try:
        assert SITE in state.patcher.describe()
        # GPTModel calls it through the package's name
        assert tensor_parallel.vocab_parallel_cross_entropy is cross_entropy.vocab_parallel_cross_entropy
        assert tensor_parallel.vocab_parallel_cross_entropy is not original
        expected_loss, expected_grad = _cross_entropy(original, logits, target)
        loss, grad = _cross_entropy(tensor_parallel.vocab_parallel_cross_entropy, logits, target)
        assert type(loss.grad_fn).__name__ != "_VocabParallelCrossEntropyBackward"
        assert loss.shape == target.shape
        torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)
        # bf16 logits: the loss in fp32, as Megatron's, and the gradient in the logits' dtype
        expected_loss, expected_grad = _cross_entropy(original, logits.bfloat16(), target)
        loss, grad = _cross_entropy(tensor_parallel.vocab_parallel_cross_entropy, logits.bfloat16(), target)
        assert loss.dtype == expected_loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
        torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-2, atol=1e-3)
        # label smoothing keeps Megatron's Function (its smoothing differs from torch's)
        smoothed, _ = _cross_entropy(tensor_parallel.vocab_parallel_cross_entropy, logits, target,
                                     label_smoothing=0.1)
        assert type(smoothed.grad_fn).__name__ == "_VocabParallelCrossEntropyBackward"
    finally:
        mindspeed.unadapt()
        parallel_state.destroy_model_parallel()
    assert tensor_parallel.vocab_parallel_cross_entropy is original


def test_cross_entropy_over_two_ranks_keeps_megatrons_reductions():
    for loss, want in run_distributed(cpu_step_workers.cross_entropy_over_two_ranks, world_size=2, timeout=120):
        assert abs(loss - want) < 1e-5, (loss, want)


def test_the_torch_view_puts_cuda_factories_on_the_cpu_and_is_torch_otherwise():
    import megatron.core.optimizer.clip_grads as clip_grads
    view = CpuTorchView()
    assert view.zeros(2, device="cuda").device.type == "cpu" and view.tensor([1], device="cuda:0").device.type == "cpu"
    assert view.float32 is torch.float32 and view.Tensor is torch.Tensor and view.distributed is torch.distributed
    mindspeed.adapt([])
    try:
        assert isinstance(clip_grads.torch, CpuTorchView)
    finally:
        mindspeed.unadapt()
    assert clip_grads.torch is torch


def test_megatrons_own_training_step_asks_the_device_mode_for_nothing():
    """So the trainer runs its steps without the mode (ModeFreeSteps): the schedule, DDP, the
    optimizer and gradient clipping name 'cuda' only through the shim's functions and views."""
    (report,) = run_distributed(cpu_step_workers.rewrites_per_step, world_size=1, timeout=300)
    assert report["rewrites"] == [0, 0, 0], report
    assert all(loss == loss for loss in report["losses"]) and report["losses"][0] != report["losses"][-1]


def test_the_mlp_input_bias_moves_into_the_linear_with_the_same_outputs():
    (report,) = run_distributed(cpu_step_workers.folded_biases, world_size=1, timeout=300)
    assert report["folded"] == 2 and report["fused_folded"] == 0
    assert report["diff"] < 1e-5 and not report["fc1_bias_returned"]
    assert "AddmmBackward0" in report["fc1_node"], report


FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from mindspeed.backends.torch import glibc_heap
    if sys.argv[1] == "keep":
        assert glibc_heap.keep_freed_memory()
    def step():     # activations of mixed sizes (0.4-2.3 MiB) and small tensors; backward frees them
        held = []
        for i in range(24):
            held += [torch.empty((i % 6 + 1) * 96 * 1024).fill_(1.0), torch.ones(10)]
        while held:
            held.pop()
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
""")


def _faults_per_step(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in glibc_heap.USER_SETTINGS and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.split()[-1])


def test_glibc_keeps_a_steps_freed_memory_for_the_next_one():
    default = _faults_per_step("default")
    if default < 400:     # seen under CI's launcher: 48 a step there, 800 in a plain shell (cause not found yet)
        pytest.skip(f"glibc's defaults already reuse this pattern's pages here ({default} faults a step)")
    kept = _faults_per_step("keep")
    assert kept < default / 10, (default, kept)     # 33 MiB made a step: 8,400 pages


def test_a_user_who_tuned_malloc_keeps_the_settings():
    assert glibc_heap.user_tuned_malloc({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert glibc_heap.user_tuned_malloc({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"})
    assert not glibc_heap.user_tuned_malloc({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert not glibc_heap.keep_freed_memory({"MALLOC_MMAP_THRESHOLD_": "65536"})


def _adam_run(optimizer, params, steps: int):
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
        optimizer.step()


def test_megatrons_adam_on_the_cpu_runs_torchs_fused_kernel_with_the_same_updates(monkeypatch):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer
    fused_calls = []
    kernel = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: fused_calls.append(1) or kernel(*a, **k))
    start = [torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.randn(4)]

    def params():
        return [torch.nn.Parameter(t.clone()) for t in start]
    groups = lambda ps: [dict(params=ps[:1], weight_decay=0.1), dict(params=ps[1:], weight_decay=0.0)]  # noqa: E731
    reference = params()
    single = torch.optim.AdamW(groups(reference), lr=1e-2)      # torch's single-tensor path on the cpu
    _adam_run(single, reference, 3)
    assert not fused_calls
    mindspeed.adapt([])
    try:
        mine = params()
        inner = torch.optim.AdamW(groups(mine), lr=1e-2)
        FP32Optimizer(inner, OptimizerConfig(lr=1e-2), lambda optimizer: None)
        _adam_run(inner, mine, 3)
        assert len(fused_calls) == 6 and all(g["fused"] for g in inner.param_groups)    # 2 groups x 3 steps
        for got, want in zip(mine, reference):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        inner.load_state_dict(single.state_dict())     # a checkpoint's groups, saved without the flag
        _adam_run(inner, mine, 1)
        assert len(fused_calls) == 8
    finally:
        mindspeed.unadapt()
