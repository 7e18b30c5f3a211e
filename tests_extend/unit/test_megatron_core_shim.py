"""The cpu device shim's mappings for what Megatron-Core's own unit tests touch: a process group
asked for nccl gets gloo, Transformer Engine's version probe answers "not installed", the groups
Megatron's destroy_model_parallel forgets are destroyed; each is listed by describe() and undone
by unadapt(). The cuda shim's one patch (torch norms without Apex/TE) is checked here too."""
import pytest
import torch
import torch.distributed as dist

import mindspeed
from megatron.core import parallel_state
from megatron.core import utils as mutils
from mindspeed.backends.torch.process_groups import held_process_groups
from mindspeed.megatron_test_skips import (base_name, listed_failure, more_ranks_needed, skip_before_running,
                                           uninstallable_package)


def test_nccl_process_groups_get_gloo_and_unadapt_restores_torch():
    init_before, new_group_before = dist.init_process_group, dist.new_group
    state = mindspeed.adapt([])
    described = state.patcher.describe()
    assert "torch.distributed.init_process_group" in described and "torch.distributed.new_group" in described
    try:
        dist.init_process_group(backend="nccl", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.get_backend() == "gloo"
        group = dist.new_group([0], backend="nccl")
        assert dist.get_backend(group) == "gloo"
        assert dist.get_backend(dist.new_group([0], None, "nccl")) == "gloo"     # backend given positionally
        total = torch.ones(3)
        dist.all_reduce(total, group=group)
        assert total.tolist() == [1.0, 1.0, 1.0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        mindspeed.unadapt()
    assert dist.init_process_group is init_before and dist.new_group is new_group_before
    assert dist.distributed_c10d.new_group is new_group_before


def _threads() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("Threads:"))


def test_model_parallel_cycles_leave_no_gloo_groups_or_threads_behind():
    destroy_before = parallel_state.destroy_model_parallel
    state = mindspeed.adapt([])
    assert "megatron.core.parallel_state.destroy_model_parallel" in state.patcher.describe()
    registered = dist.distributed_c10d._world.pg_map
    try:
        dist.init_process_group(backend="nccl", store=dist.HashStore(), rank=0, world_size=1)
        counts = []
        for _ in range(4):     # what Megatron's unit tests do around every test
            parallel_state.initialize_model_parallel(1, 1)
            assert len(registered) > 10       # each initialize makes its groups: gloo, with threads
            parallel_state.destroy_model_parallel()
            counts.append((_threads(), len(registered)))
        assert counts[-1][1] == 1, counts     # only the world group is left
        assert counts[-1][0] <= counts[0][0], counts   # each cycle would leave dozens of gloo threads
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        mindspeed.unadapt()
    assert parallel_state.destroy_model_parallel is destroy_before


def test_the_groups_a_module_holds_are_found_in_its_containers():
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world, loose, listed, keyed = dist.group.WORLD, dist.new_group([0]), dist.new_group([0]), dist.new_group([0])
        holder = type(parallel_state)("holder")
        holder.LOOSE, holder.LISTED, holder.KEYED, holder.OTHER = loose, [None, listed], {"tp": keyed}, [1, "x"]
        holder.WORLD_TOO = world
        found = held_process_groups(holder)
        assert {id(g) for g in found} == {id(loose), id(listed), id(keyed), id(world)}
    finally:
        dist.destroy_process_group()


def test_te_version_probe_answers_absent_without_raising():
    probe_before = mutils.is_te_min_version
    absent = mutils.get_te_version() is None
    state = mindspeed.adapt([])
    try:
        assert "megatron.core.utils.is_te_min_version" in state.patcher.describe()
        if absent:
            assert mutils.is_te_min_version("1.3") is False
    finally:
        mindspeed.unadapt()
    assert mutils.is_te_min_version is probe_before


def test_a_test_needing_more_ranks_is_told_how_to_run():
    reason = more_ranks_needed("RuntimeError: world_size (1) is not divisible by 8", 1)
    assert "torchrun --nproc_per_node 8" in reason
    reason = more_ranks_needed("world_size (2) is not divisible by expert_tensor_model_pipeline_parallel size (4)", 2)
    assert "torchrun --nproc_per_node 4" in reason
    assert more_ranks_needed("world_size (2) is not divisible by 8", 1) is None   # another run's world
    hybrid = "AssertionError: world size (1) is not divisible by total_model_size (total_model_size=2)"
    assert "torchrun --nproc_per_node 2" in more_ranks_needed(hybrid, 1)
    assert more_ranks_needed("shape mismatch", 1) is None
    # HyperCommGrid (Megatron's pipeline_parallel tests): the grid's shape spans 2 * 1 * 1 * 4 ranks
    grid = "RuntimeError: Grid shape [2, 1, 1, 4] is over sized with world size 1 and rank offset 0"
    assert "torchrun --nproc_per_node 8" in more_ranks_needed(grid, 1)
    assert more_ranks_needed(grid, 2) is None
    mesh = "RuntimeError: Mesh should not be bigger than default world size 1, but found 8 ranks!"
    assert "torchrun --nproc_per_node 8" in more_ranks_needed(mesh, 1)
    assert more_ranks_needed(mesh, 2) is None
    # gloo's broadcast from a rank the world lacks (dist_checkpointing/test_fp8.py's source rank 6)
    root = "RuntimeError: ProcessGroupGloo::broadcast: invalid root rank: 6"
    assert more_ranks_needed(root, 1).startswith("needs at least 7 processes (a collective from rank 6)")
    assert more_ranks_needed(root, 8) is None
    shards = "AssertionError: Data parallel size should be divisible by partial DistOpt shard factor"
    assert "torchrun --nproc_per_node 2" in more_ranks_needed(shards, 1)
    expert_shards = "AssertionError: Expert data parallel size should be divisible by partial DistOpt shard factor"
    assert "torchrun --nproc_per_node 4" in more_ranks_needed(expert_shards, 2)    # the experts' DP at EP 2


def test_a_listed_test_is_skipped_only_when_it_fails_as_its_reason_says():
    node = "megatron-lm/tests/unit_tests/tensor_parallel/test_random.py::test_convert_cuda_rng_state[x]"
    assert base_name(node) == "tests/unit_tests/tensor_parallel/test_random.py::test_convert_cuda_rng_state"
    graphs = "AssertionError: Tried using cudagraphs with RNG, however not detected in pytorch!"
    assert "CUDA graphs" in listed_failure(node, graphs, te_present=True)
    assert listed_failure(node, "AssertionError: assert 1 == 2", te_present=True) is None   # another failure
    te_only = ("tests/unit_tests/transformer/test_attention_packed_seq.py::TestParallelAttentionWithPackedSequence"
               "::test_gpu_forward")
    te_error = "AssertionError: Packed sequence is not supported by DotProductAttention."
    assert "Transformer Engine" in listed_failure(te_only, te_error, te_present=False)
    assert listed_failure(te_only, te_error, te_present=True) is None        # with TE installed it counts
    assert listed_failure("tests/unit_tests/test_foo.py::test_bar", te_error, te_present=False) is None


def test_a_test_needing_eight_ranks_is_not_run_with_fewer():
    ranks = "tests/unit_tests/test_parallel_state.py::test_initialize_and_destroy_model_parallel[tp-cp-ep-dp-pp]"
    assert "--nproc_per_node 8" in skip_before_running(ranks, 2)
    assert skip_before_running(ranks, 8) is None
    assert skip_before_running("tests/unit_tests/test_parallel_state.py::test_other", 1) is None
    # a key with parameters names those cases only (a bf16 sum of two values rounds as fp32's does)
    accumulation = ("tests/unit_tests/distributed/test_reduce_scatter_with_fp32_accumulation.py::"
                    "TestReduceScatterWithFP32Accumulation::test_reduce_scatter_with_fp32_accumulation")
    assert "--nproc_per_node 4" in skip_before_running(accumulation + "[False-True]", 2)
    assert skip_before_running(accumulation + "[True-True]", 2) is None


def test_a_cuda_only_test_that_would_hold_the_other_ranks_is_not_run():
    reason = skip_before_running("tests/unit_tests/test_utils.py::test_straggler_detector", 2)
    assert reason.startswith("MindSpeed skip list:") and "--log-straggler" in reason


def test_a_test_too_large_for_a_cpu_run_is_not_run():
    large = ("tests/unit_tests/transformer/test_transformer_block_custom_pgs.py::TestTransformerBlockWithProcessGroups"
             "::test_params_and_grads_match_transformer_block[1-1-1-1]")
    assert "MindSpeed skip list: builds two 4096-wide" in skip_before_running(large, 1)
    assert "MindSpeed skip list" in skip_before_running("megatron-lm/" + large, 8)
    assert skip_before_running(large.replace("[1-1-1-1]", "[8-8-1-1]"), 1) is None   # Megatron skips it itself


def test_a_cuda_machine_without_apex_or_te_builds_torch_norms_under_megatron_lm_defaults():
    """Megatron-LM's defaults (persist_layer_norm) and sequence parallelism are Apex/TE choices that
    Megatron-Core's torch norm refuses; the cuda shim patches that norm and nothing else (but multi-latent
    attention's TE-less stand-in, CLIP's default norm and torch's checkpoint-writer argument, which every
    device gets, and Megatron's torch-Adam fallback, which a machine without TE or Apex gets)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from mindspeed.backends.torch.clip_vit_norm import CLIP_MODULE
    from mindspeed.backends.torch.dist_ckpt_write_item import WRITER
    from mindspeed.backends.torch.megatron_shim import apply_device_shim
    from mindspeed.backends.torch.torch_adam_fallback import ADAM_INIT, DISTRIBUTED_STATE_DICT
    from mindspeed.backends.torch.mla_standin import PATCH_TARGETS
    from mindspeed.patching import PatchManager

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, persist_layer_norm=True,
                               sequence_parallel=True, tensor_model_parallel_size=2)
    with pytest.raises(AssertionError, match="persist_layer_norm"):
        WrappedTorchNorm(config, 8)
    patcher = PatchManager()
    apply_device_shim(patcher, "cuda")
    try:
        norm_patch, *others = [p.target for p in patcher.applied()]
        assert norm_patch == "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__"
        assert set(others) <= {*PATCH_TARGETS, f"{WRITER}._write_item", ADAM_INIT, DISTRIBUTED_STATE_DICT,
                               f"{CLIP_MODULE}.CLIPViTModel.__init__"}
        norm = WrappedTorchNorm(config, 8)
        assert isinstance(norm, torch.nn.LayerNorm)
        assert all(p.sequence_parallel for p in norm.parameters())   # their grads are all-reduced over TP
        assert config.persist_layer_norm and config.sequence_parallel   # the model's config is not changed
    finally:
        patcher.remove_all()
    with pytest.raises(AssertionError):
        WrappedTorchNorm(config, 8)


class _AllocatesOnCudaInBackward(torch.autograd.Function):
    """What Megatron's Triton-kernel Functions do (fused_indices_converter): both passes allocate
    their outputs with device='cuda'."""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty(x.shape, dtype=x.dtype, device="cuda")
        out.copy_(x * 3)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_in = torch.empty(grad.shape, dtype=grad.dtype, device="cuda")
        grad_in.copy_(grad * 3)
        return grad_in


def test_a_custom_functions_backward_allocates_on_cuda_as_its_forward_does():
    """torch turns a mode off while the mode's handler runs, and Tensor.backward goes through the
    handler: without the shim's wrap the backward's device='cuda' reaches CPU-only torch."""
    state = mindspeed.adapt([])
    try:
        assert "BackwardCFunction.apply" in state.patcher.describe()
        x = torch.arange(4.0, requires_grad=True)
        _AllocatesOnCudaInBackward.apply(x).sum().backward()
        assert x.grad.tolist() == [3.0] * 4
        y = torch.arange(2.0, requires_grad=True)
        (grad,) = torch.autograd.grad(_AllocatesOnCudaInBackward.apply(y).sum(), y)
        assert grad.tolist() == [3.0, 3.0]
    finally:
        mindspeed.unadapt()


def test_all_gather_into_a_stacked_output_on_gloo():
    """torch's documented stacked form ([world, *input.shape]), which NCCL takes and gloo refuses
    ('invalid tensor size'); Megatron's MoE tests gather their inputs that way."""
    state = mindspeed.adapt([])
    try:
        dist.init_process_group(backend="nccl", store=dist.HashStore(), rank=0, world_size=1)
        source = torch.arange(6.0).view(2, 3)
        stacked = torch.zeros(1, 2, 3)
        dist.all_gather_into_tensor(stacked, source)
        assert torch.equal(stacked[0], source)
        concatenated = torch.zeros(2, 3)
        dist.all_gather_into_tensor(concatenated, source)       # the form gloo takes, unchanged
        assert torch.equal(concatenated, source)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        mindspeed.unadapt()


def test_fused_softmax_without_its_cuda_extension_runs_megatrons_torch_softmax():
    """Megatron's availability check passes on config and shapes alone (fusion on, 16-bit input,
    sizes multiples of 4), then its forward imports scaled_masked_softmax_cuda."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func
    state = mindspeed.adapt([])
    try:
        assert "is_kernel_available" in state.patcher.describe()
        softmax = FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True, attn_mask_type=AttnMaskType.padding,
                                        scaled_masked_softmax_fusion=True, mask_func=attention_mask_func,
                                        softmax_in_fp32=True, scale=None)
        scores = torch.randn(2, 2, 32, 32).to(torch.bfloat16)
        mask = torch.zeros(2, 1, 32, 32, dtype=torch.bool)
        assert torch.equal(softmax(scores, mask), torch.softmax(scores.float(), dim=-1).to(torch.bfloat16))
    finally:
        mindspeed.unadapt()


TE_AT_THE_TOP = """
import sys
from transformer_engine.pytorch.fp8 import check_fp8_support
import transformer_engine as te
fp8_available, reason = check_fp8_support()
import megatron.core.models.gpt.gpt_layer_specs as specs
"""


def test_a_test_modules_te_imports_get_a_stand_in_that_megatron_never_sees():
    import sys
    from megatron.core.models.gpt import gpt_layer_specs
    from mindspeed.backends.torch.te_import_standin import TransformerEngineAbsent, test_module_builtins
    from mindspeed.megatron_test_skips import te_name_used
    if gpt_layer_specs.HAVE_TE:
        pytest.skip("Transformer Engine is installed: test modules import it")
    namespace = {"__builtins__": test_module_builtins(), "__name__": "tests.unit_tests.fake"}
    exec(compile(TE_AT_THE_TOP, "fake_test.py", "exec"), namespace)
    assert namespace["fp8_available"] is False               # TE's probe: no FP8 here
    assert "transformer_engine" not in sys.modules            # Megatron's `import transformer_engine` still fails
    assert namespace["specs"].HAVE_TE is False
    with pytest.raises(TransformerEngineAbsent) as used:
        namespace["te"].pytorch.LayerNorm(16)
    assert "te.pytorch.LayerNorm" not in str(used.value) and "transformer_engine.pytorch.LayerNorm" in str(used.value)
    reason = te_name_used(type(used.value).__name__, str(used.value))
    assert reason.startswith("MindSpeed: needs Transformer Engine (transformer_engine.pytorch.LayerNorm)")
    assert te_name_used("AssertionError", "x") is None
    # `isinstance(t, Float8Tensor)` (dist_checkpointing/test_fp8.py): False, not a TypeError
    assert not isinstance(torch.zeros(1), namespace["te"].pytorch.Float8Tensor)
    assert not issubclass(torch.Tensor, namespace["te"].pytorch.Float8Tensor)
    with pytest.raises(ModuleNotFoundError):                  # other imports: Python's own answer
        exec("import not_a_module_anywhere", {"__builtins__": test_module_builtins()})


def test_flash_attn_version_probe_answers_not_installed():
    """Megatron's skipif marks call is_fa_min_version while a test module is imported; without
    flash-attn Megatron's own probe raises ModuleNotFoundError, so the module is not collected."""
    import importlib.util
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn installed: Megatron's own answer stands")
    with pytest.raises(ModuleNotFoundError):
        mutils.is_fa_min_version("2.7.3")
    mindspeed.adapt([])
    try:
        assert mutils.is_fa_min_version("2.7.3") is False
    finally:
        mindspeed.unadapt()


def test_a_package_this_python_cannot_install_is_a_skip_by_reason():
    """Megatron's Muon / layer-wise optimizer tests assert emerging-optimizers, which needs Python >= 3.12."""
    import sys
    reason = uninstallable_package("AssertionError: Emerging Optimizers is not installed.")
    assert reason.startswith("MindSpeed skip list: needs emerging-optimizers") and "Python >= 3.12" in reason
    assert uninstallable_package("AssertionError: Grouped GEMM is not available.") is None
    # Megatron's Mamba tests: mamba-ssm's kernels build only against CUDA
    mamba = uninstallable_package("ImportError: MambaSSM is not installed. Please install it with `pip install mamba-ssm`.")
    assert mamba.startswith("MindSpeed skip list: needs mamba-ssm") and "CUDA-only" in mamba
    fused = uninstallable_package("ValueError: fused_topk_with_score_function is not available. Please install TE "
                                  ">= 2.6.0.")
    assert "Transformer Engine's fused kernels" in fused and "--moe-router-fusion" in fused
    assert sys.version_info < (3, 12), "emerging-optimizers installs on this Python: lift the entry"
