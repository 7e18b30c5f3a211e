"""What Megatron-Core does where Transformer Engine, Apex, NVTX and CUDA are absent, through the
device shim (found by Megatron's own unit tests under the plugin): CLIP's default norm builds, torch's
Adam takes Megatron's `lr=None` and a fresh distributed optimizer's state dict, NVTX ranges are
profiler ranges, and `.cuda()` of an expanded tensor gives each element its own memory."""
import pytest
import torch

import mindspeed
from tests_extend.unit.test_te_spec_standin import adapted  # noqa: F401  (adapted, one process group, TP 1)


def test_clip_builds_its_default_norm_without_te_and_normalises_with_it(adapted):
    from megatron.core.models.vision import clip_vit_model
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer import TransformerConfig
    assert clip_vit_model.NORM_IMPL is torch.nn.LayerNorm        # Megatron's own default without TE
    assert "CLIPViTModel.__init__" in adapted.patcher.describe()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True)
    model = clip_vit_model.CLIPViTModel(config, get_vit_layer_with_local_spec(), img_h=16, img_w=16, patch_dim=8)
    assert isinstance(model.ln_pre, torch.nn.LayerNorm)
    x = torch.randn(5, 2, 32)
    assert torch.allclose(model.ln_pre(x), torch.nn.functional.layer_norm(x, (32,), eps=config.layernorm_epsilon))
    assert model(torch.randn(2, 3, 16, 16)).shape[-1] == 32
    mindspeed.unadapt()
    with pytest.raises(TypeError, match="unexpected keyword argument 'config'"):
        clip_vit_model.CLIPViTModel(config, get_vit_layer_with_local_spec(), img_h=16, img_w=16, patch_dim=8)
    mindspeed.adapt([])        # the fixture's unadapt


def test_torch_adam_takes_lr_none_as_te_does_and_steps_once_the_scheduler_sets_it(adapted):
    weights = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    optimizer = torch.optim.AdamW([{"params": [weights[0]]}, {"params": [weights[1]], "lr": 0.5}], lr=None)
    assert [group["lr"] for group in optimizer.param_groups] == [None, 0.5] and optimizer.defaults["lr"] is None
    reference_weights = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    reference = torch.optim.AdamW([{"params": [reference_weights[0]]}, {"params": [reference_weights[1]]}], lr=0.1)
    reference.param_groups[1]["lr"] = 0.5
    optimizer.param_groups[0]["lr"] = 0.1            # what Megatron's OptimizerParamScheduler does
    for params, opt in ((weights, optimizer), (reference_weights, reference)):
        sum((p * p).sum() for p in params).backward()
        opt.step()
    assert all(torch.equal(w, r) for w, r in zip(weights, reference_weights))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        torch.optim.Adam(weights, lr=-1.0)


def test_the_initial_adam_state_is_what_torchs_first_step_makes(adapted):
    from mindspeed.backends.torch.torch_adam_fallback import create_initial_adam_state
    eager, lazy = (torch.nn.Parameter(torch.arange(6.0).reshape(2, 3)) for _ in range(2))
    eager_opt, lazy_opt = torch.optim.AdamW([eager], lr=0.1), torch.optim.AdamW([lazy], lr=0.1)
    create_initial_adam_state(eager_opt)
    assert eager_opt.state[eager]["step"].item() == 0.0 and not eager_opt.state[eager]["exp_avg"].any()
    for param, opt in ((eager, eager_opt), (lazy, lazy_opt)):
        for _ in range(2):
            opt.zero_grad()
            (param ** 3).sum().backward()
            opt.step()
    assert torch.equal(eager, lazy) and eager_opt.state[eager]["step"].item() == 2.0


def test_a_fresh_distributed_optimizer_has_a_state_dict_at_step_zero(adapted):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    model = DistributedDataParallel(TransformerConfig(num_attention_heads=1, num_layers=1),
                                    DistributedDataParallelConfig(use_distributed_optimizer=True),
                                    torch.nn.Linear(8, 8, bias=False))
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", use_distributed_optimizer=True), [model])
    groups = optimizer.state_dict()["optimizer"]["param_groups"]      # asserted one step; there was none
    assert {group["step"] for group in groups} == {0.0} and {group["lr"] for group in groups} == {None}


def test_nvtx_ranges_are_profiler_ranges_on_a_torch_without_nvtx(adapted):
    from megatron.core import utils
    if hasattr(torch._C, "_nvtx"):
        pytest.skip("this torch has NVTX: Megatron's ranges go to NVTX itself")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        assert torch.cuda.nvtx.range_push("outer") == 0 and torch.cuda.nvtx.range_push("inner") == 1
        assert torch.cuda.nvtx.range_pop() == 1 and torch.cuda.nvtx.range_pop() == 0
        assert torch.cuda.nvtx.range_pop() == -1                  # none open: NVTX's answer
        utils.configure_nvtx_profiling(True)
        try:
            utils.nvtx_range_push("megatron_range")
            utils.nvtx_range_pop("megatron_range")
            decorated = utils.nvtx_decorator(message="decorated_range")(lambda value: value + 1)
            assert decorated(1) == 2
        finally:
            utils.configure_nvtx_profiling(False)
    names = {event.name for event in profile.events()}
    assert {"outer", "inner", "megatron_range", "decorated_range"} <= names


def test_cuda_of_an_expanded_tensor_gives_each_element_its_own_memory(adapted):
    tokens = torch.arange(4).expand(3, 4).cuda()         # Megatron's tests build batches so
    tokens[0, 0] = 9
    assert tokens[:, 0].tolist() == [9, 0, 0]
    moved = torch.arange(4).expand(2, 4).to("cuda")
    moved[1, 1] = 7
    assert moved[:, 1].tolist() == [1, 7]
    dense = torch.ones(3)
    assert dense.cuda() is dense                           # no copy where nothing is shared


def test_the_cuda_device_named_by_current_device_is_the_cpu(adapted):
    # Megatron-FSDP's adapter: torch.device(f"cuda:{torch.cuda.current_device()}") ("Invalid device string")
    device = torch.device(f"cuda:{torch.cuda.current_device()}")
    assert device == torch.device("cpu")
    assert torch.zeros(2, device=device).device.type == "cpu"


def test_megatron_fsdp_scales_gradients_before_a_gloo_sum_instead_of_premul_sum(adapted):
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers
    from megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config import (
        DistributedDataParallelConfig)
    config = DistributedDataParallelConfig(gradient_reduce_div_fusion=True)
    grad = torch.full((4,), 3.0)
    op = buffers.gradient_reduce_preprocessing(grad, 0.5, config)
    torch.distributed.all_reduce(grad, op=op)     # gloo: "Cannot use ReduceOp.PREMUL_SUM with Gloo"
    assert grad.tolist() == [1.5] * 4 and config.gradient_reduce_div_fusion


def test_megatron_fsdp_builds_its_default_device_mesh_on_the_cpu(adapted):
    import importlib      # the package's `fully_shard` attribute is the function, not this module
    fully_shard = importlib.import_module("megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard")
    mesh = fully_shard.init_device_mesh(device_type="cuda", mesh_shape=(1, 1), mesh_dim_names=("fsdp", "tp"))
    assert mesh.device_type == "cpu"      # DTensor.from_local moves shards to the mesh's device type
