"""--quant-grads on Megatron-Core's DDP and optimizers (upstream MindSpeed's gradient quantization): the
grad buffer is fp16, each parameter's gradient held there multiplied by its own power-of-two scale.

- accumulate: the backward hook brings the held gradient back to fp32 (dividing by a power of two is
  exact), adds the new one, and stores the sum times the largest power of two that keeps its largest
  element within fp16's range: one fp16 rounding (2^-11 relative, for elements within 2^29 of the
  tensor's largest) per micro-batch, and no overflow from a finite gradient;
- agree: before the data-parallel reduction the scales are all-reduced to their minimum (one small
  collective per bucket) and a gradient whose scale fell is re-scaled to it, so the ranks sum values of
  one scale; Megatron's 1/dp pre-scaling keeps the sum within fp16's range;
- unscale: the optimizer's copy into its fp32 main grads divides by the scale (replacing Megatron's
  copy for FP32Optimizer, Float16OptimizerWithFloat16Params and DistributedOptimizer).

A non-finite gradient stays non-finite (its scale stays 1): the fp16 loss scaler skips the step as it
would with fp32 gradients. Checkpoints hold no gradients, so they do not change.
"""
from __future__ import annotations

import functools

import torch

FP16_MAX = torch.finfo(torch.float16).max
ZERO_SCALE = 2.0 ** 64      # the scale of an all-zero gradient: the minimum over ranks ignores it
BUFFER = "megatron.core.distributed.param_and_grad_buffer"
SITES = {
    "buffer": f"{BUFFER}._ParamAndGradBuffer.__init__",
    "sync": f"{BUFFER}._ParamAndGradBucketGroup.start_grad_sync",
    "check": f"{BUFFER}._ParamAndGradBucketGroup.check_grads",
    "hook": "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel._make_backward_post_hook",
    "fp32": "megatron.core.optimizer.optimizer.FP32Optimizer.prepare_grads",
    "float16": "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads",
    "distributed": "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._copy_model_grads_to_main_grads",
}
FUSION_REFUSAL = ("--quant-grads: a gradient was added into the fp16 grad buffer by the fused weight-gradient "
                  "kernel, unscaled; add --no-gradient-accumulation-fusion")


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The largest power of two s with amax * s <= fp16's largest (exact: from amax's exponent); an all-zero
    gradient gets ZERO_SCALE, a non-finite one 1."""
    mantissa, exponent = torch.frexp(amax.float())       # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    top = torch.where(mantissa <= FP16_MAX / 2.0 ** 16, 16, 15)
    scale = torch.ldexp(torch.ones_like(mantissa), (top - exponent).float())
    scale = torch.where(amax == 0, ZERO_SCALE, scale)
    return torch.where(torch.isfinite(amax), scale, torch.ones_like(scale))


def quantize_into(held: torch.Tensor, scale: torch.Tensor, value: torch.Tensor) -> None:
    """Store fp32 `value` into the fp16 tensor `held` at a fresh scale, written into `scale`."""
    new = pow2_scale(value.abs().amax() if value.numel() else torch.zeros(()))
    held.copy_(value.mul_(new))
    scale.copy_(new)


def unscaled(held: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 gradient an fp16 one held at `scale` stands for (exact)."""
    return held.float().div_(scale)


def accumulate(param, grad: torch.Tensor) -> None:
    held, scale = param.main_grad, param.quant_grad_scale
    quantize_into(held, scale, unscaled(held, scale).add_(grad))


# -- the grad buffer --------------------------------------------------------------------------------------
def _attach_scales(buffer) -> None:
    """One fp32 scale per parameter, a slice of its bucket's scale tensor (one collective per bucket)."""
    for bucket in buffer.buckets:
        bucket.quant_grad_scales = torch.ones(len(bucket.params_list), device=buffer.grad_data.device)
        for i, param in enumerate(bucket.params_list):
            param.quant_grad_scale = bucket.quant_grad_scales[i:i + 1]


def buffer_init(original):
    @functools.wraps(original)
    def init(self, ddp_config, param_dtype, grad_dtype, *a, **kw):
        original(self, ddp_config, param_dtype, torch.float16, *a, **kw)
        _attach_scales(self)
    return init


def _agreement_groups(group) -> list:
    if group.ddp_config.use_distributed_optimizer:
        groups = [group.intra_distributed_optimizer_instance_group,
                  getattr(group, "inter_distributed_optimizer_instance_group", None)]
    else:
        groups = [group.data_parallel_group]
    return [g for g in groups if g is not None and g.size() > 1]


def agree_scales(group) -> None:
    """Every rank's gradients of one parameter at the smallest of their scales (a power-of-two ratio:
    exact but for elements it pushes below fp16's normal range)."""
    for comm in _agreement_groups(group):
        for bucket in group.buckets:
            old = bucket.quant_grad_scales.clone()
            torch.distributed.all_reduce(bucket.quant_grad_scales, op=torch.distributed.ReduceOp.MIN, group=comm)
            for i in torch.nonzero(bucket.quant_grad_scales != old).flatten().tolist():
                held = bucket.params_list[i].main_grad
                held.copy_(held.float().mul_(bucket.quant_grad_scales[i] / old[i]))


def check_grads(self, check_for_nan_or_inf, check_for_large):
    """_ParamAndGradBucketGroup.check_grads on the scaled fp16 values, their norm taken in fp32 (fp16's
    would overflow at these scales; finite exactly when every element is). The large-gradient check
    compares norms across steps, which per-step scales make meaningless: off, as upstream's."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    rerun = get_rerun_state_machine()
    for i, bucket in enumerate(self.buckets):
        norm = torch.linalg.vector_norm(bucket.grad_data, dtype=torch.float32)
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            if check_for_nan_or_inf:
                rerun.validate_result(result=norm, rejection_func=reject, tolerance=0.001, fatal=True,
                                      message=f"found {what} in local grad norm for bucket #{i} in backward "
                                              f"pass before data-parallel communication collective")


def start_grad_sync(original):
    @functools.wraps(original)
    def start(self, *a, **kw):
        if not (self.is_first_batch and self.grad_reduce_handle is not None):   # else Megatron's no-op
            agree_scales(self)
        return original(self, *a, **kw)
    return start


def backward_hook(self, param):
    """DistributedDataParallel._make_backward_post_hook: Megatron-Core's hook with the quantized
    accumulation in place of main_grad.add_(grad)."""
    def hook(*unused):
        if param not in self.param_to_bucket_group:
            return
        if getattr(param, "grad_added_to_main_grad", False) and not getattr(param, "zero_out_wgrad", False):
            raise RuntimeError(FUSION_REFUSAL)
        if self.ddp_config.overlap_grad_reduce:
            assert param.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
        if param.grad is not None:
            accumulate(param, param.grad.data)
        param.grad = None
        if self.ddp_config.overlap_grad_reduce:
            self.param_to_bucket_group[param].register_grad_ready(param, self.force_all_reduce)
    return hook


# -- the optimizers' fp32 main grads ------------------------------------------------------------------------
def fp32_prepare_grads(self) -> bool:
    """FP32Optimizer.prepare_grads: the model params' grads are the unscaled fp16 ones."""
    if not self.is_stub_optimizer:
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if hasattr(param, "main_grad"):
                    param.grad = unscaled(param.main_grad, param.quant_grad_scale)
    return False


def float16_copy_grads(self) -> None:
    """Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads with the unscaling."""
    for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
        for model_param, main_param in zip(model_group, main_group):
            main_param.grad = unscaled(model_param.main_grad, model_param.quant_grad_scale)
            model_param.grad = None
    for model_group in self.fp32_from_fp32_groups:
        for model_param in model_group:
            model_param.grad = unscaled(model_param.main_grad, model_param.quant_grad_scale)


def distributed_copy_grads(self) -> None:
    """DistributedOptimizer._copy_model_grads_to_main_grads with the unscaling: only this rank's shard
    of each gradient becomes fp32."""
    if self.is_stub_optimizer:
        return
    for model_groups, shard_groups in ((self.model_float16_groups, self.shard_fp32_from_float16_groups),
                                       (self.model_fp32_groups, self.shard_fp32_groups)):
        for model_group, shard_group in zip(model_groups, shard_groups):
            for model_param, shard_param in zip(model_group, shard_group):
                span = self._get_model_param_range_map(model_param)["param"]
                shard = model_param.main_grad.view(-1)[span.start:span.end]
                shard_param.grad = unscaled(shard, model_param.quant_grad_scale)


def grad_buffer_bytes(model_chunks) -> tuple[int, int]:
    """(bytes of the DDP grad buffers, parameters they hold) over `model_chunks`."""
    held = params = 0
    for chunk in model_chunks:
        for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            held += buffer.grad_data.numel() * buffer.grad_data.element_size()
            params += sum(p.numel() for p in buffer.params)
    return held, params


def install(patcher) -> None:
    """Every DDP grad buffer built from now on holds fp16 gradients at per-parameter scales."""
    import megatron.core.distributed.distributed_data_parallel  # noqa: F401  (the sites' modules)
    import megatron.core.optimizer.distrib_optimizer  # noqa: F401
    why = "--quant-grads: gradients held in fp16 at per-parameter power-of-two scales"
    patcher.wrap(SITES["buffer"], buffer_init, reason=why)
    patcher.replace(SITES["check"], check_grads, reason=why + " (the NaN check's norm in fp32)")
    patcher.wrap(SITES["sync"], start_grad_sync, reason=why + " (agreed over data-parallel ranks)")
    patcher.replace(SITES["hook"], backward_hook, reason=why + " (accumulated in fp32, stored in fp16)")
    patcher.replace(SITES["fp32"], fp32_prepare_grads, reason=why + " (unscaled into fp32)")
    patcher.replace(SITES["float16"], float16_copy_grads, reason=why + " (unscaled into fp32)")
    patcher.replace(SITES["distributed"], distributed_copy_grads, reason=why + " (unscaled into fp32)")
