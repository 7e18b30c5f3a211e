"""Device shims that let an unmodified Megatron-Core (0.16.x) run on the chosen torch device.

cpu: Megatron-Core assumes CUDA everywhere (RNG tracker, current_device, streams, literal
'cuda' devices). Each mismatch is one listed patch through the PatchManager, so
`mindspeed.unadapt()` restores every original. cuda: torch's norms where Apex and Transformer
Engine are absent. npu: torch_npu's own cuda->npu transfer.
"""
from __future__ import annotations

import contextlib
import copy
import logging

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from mindspeed.backends.torch.absent_packages import apply_absent_package_probes
from mindspeed.backends.torch.clip_vit_norm import apply_clip_vit_norm
from mindspeed.backends.torch.cpu_torch_view import apply_cpu_torch_views, device_kwarg_to_cpu, names_cuda
from mindspeed.backends.torch.device import dist_backend_for
from mindspeed.backends.torch.fused_cpu_adam import apply_fused_cpu_adam
from mindspeed.backends.torch.torch_adam_fallback import apply_torch_adam_fallback
from mindspeed.backends.torch.megatron_training_shim import apply_cpu_training_shim
from mindspeed.backends.torch.dist_ckpt_write_item import apply_write_item_format
from mindspeed.backends.torch.mla_standin import apply_mla_standin
from mindspeed.backends.torch.multi_tensor import apply_foreach_multi_tensor
from mindspeed.backends.torch.native_linear import apply_native_linear
from mindspeed.backends.torch.nvtx_ranges import apply_profiler_nvtx
from mindspeed.backends.torch.one_rank_collectives import apply_one_rank_all_reduce
from mindspeed.backends.torch.one_rank_cross_entropy import apply_one_rank_cross_entropy
from mindspeed.backends.torch.one_rank_regions import apply_one_rank_regions
from mindspeed.backends.torch.stacked_all_gather import apply_stacked_all_gather
from mindspeed.backends.torch.megatron_fsdp_cpu import apply_megatron_fsdp_on_cpu
from mindspeed.backends.torch.process_groups import wrap_destroy_model_parallel
from mindspeed.backends.torch.sync_save_queue import apply_in_process_results_queue

log = logging.getLogger("mindspeed")


# --- cpu stand-ins for torch.cuda ----------------------------------------------------------------
class _CpuStream:
    """Stands in for torch.cuda.Stream: cpu work is synchronous, so every wait is complete."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event or _CpuEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _CpuEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_CPU_STREAM = _CpuStream()


def _stream_context(stream=None):
    return contextlib.nullcontext()


def _current_device():
    return "cpu"


# what Megatron's f"cuda:{torch.cuda.current_device()}" spells with the shim's current device
_CURRENT_CUDA_DEVICE = f"cuda:{_current_device()}"


def _manual_seed(seed):
    # the cpu generator plays the role of the cuda default generator
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly)
    torch.default_generator.manual_seed(int(seed))


def _get_rng_state(device="cuda", *args, **kwargs):
    return torch.get_rng_state()


def _set_rng_state(new_state, device=-1, *args, **kwargs):
    torch.set_rng_state(new_state)


def _memory_stat(*args, **kwargs):
    return 0


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites device='cuda' (and Tensor.cuda()) to cpu inside Megatron-Core's calls; drops
    pin_memory requests (CPU-only torch has no pinned allocator)."""

    rewrites = 0     # calls changed so far, process-wide: code that needed none can run without the mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            CudaToCpuMode.rewrites += 1
            return dense_if_overlapping(args[0]) if func is torch.Tensor.cuda else args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False   # no pinned allocator without an accelerator
            CudaToCpuMode.rewrites += 1
        if device_kwarg_to_cpu(kwargs):
            CudaToCpuMode.rewrites += 1
        if func is torch.device and args == (_CURRENT_CUDA_DEVICE,):
            CudaToCpuMode.rewrites += 1      # Megatron-FSDP's torch.device(f"cuda:{current_device()}")
            return torch.device("cpu")
        if func in (torch.Tensor.to,) and args and len(args) > 1 and names_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
            CudaToCpuMode.rewrites += 1
            return dense_if_overlapping(func(*args, **kwargs))
        return func(*args, **kwargs)


def dense_if_overlapping(tensor):
    """A host-to-device copy gives every element its own memory; on the cpu `.cuda()` returns the
    tensor itself. A tensor whose elements share memory (expand's stride 0) is copied as the transfer
    would copy it: a write to one of its elements then stays in that element (Megatron's tests build
    batches with `torch.arange(n).expand(b, n).cuda()` and set single tokens)."""
    if any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride())):
        return tensor.contiguous()
    return tensor


class _CpuRNGTrackerMixin:
    """Megatron's fork() swaps the 'cuda' generator state; on cpu that generator is the cpu one,
    so its 'cpu state changed inside a GPU RNG context' warning would fire on every fork."""

    @contextlib.contextmanager
    def fork(self, name=None):
        from megatron.core.tensor_parallel import random as mrandom
        name = name or mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        orig_state = torch.get_rng_state()
        # core 0.16 tracks the active state's name (nested forks); core 0.12 does not
        orig_name = getattr(self, "_current_state_name", "default-rng")
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        if hasattr(self, "_current_state_name"):
            self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            if hasattr(self, "_current_state_name"):
                self._current_state_name = orig_name


def _wrap_torch_norm_new(original_new):
    """torch's own norms are fine under sequence parallelism: the weights are replicated across
    TP and their grads all-reduced when marked `sequence_parallel` (what Apex/TE norms do).
    persist_layer_norm (Megatron-LM's default) is an Apex kernel choice with no torch counterpart."""

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sp = config.sequence_parallel
        if sp or getattr(config, "persist_layer_norm", False):
            config = copy.copy(config)
            config.sequence_parallel = False
            config.persist_layer_norm = False
        norm = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        if sp:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm

    return __new__


def apply_torch_norm_shim(patcher) -> None:
    """Megatron-Core builds WrappedTorchNorm where neither Apex nor Transformer Engine is installed
    (always on cpu; on a CUDA machine without them), and it refuses Megatron-LM's defaults there."""
    patcher.wrap("megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__", _wrap_torch_norm_new,
                 reason="torch norms stand in for Apex/TE ones: under sequence parallelism, without persist")


def _wrap_all_to_all(original):
    """gloo's all_to_all needs python lists for split sizes; Megatron passes tensors."""

    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None):
        def as_list(sizes):
            return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes
        return original(group, input_, as_list(output_split_sizes_), as_list(input_split_sizes))

    return all_to_all


def _wrap_p2p_ops(original):
    """Megatron frees a pipeline stage's output right after posting its send (deallocate_output_tensor
    swaps the tensor's storage). On CUDA the caching allocator holds that memory until the send's
    stream is done; gloo reads the buffer from its own thread after isend returns, so it sent memory
    already reused: run-to-run different losses under the interleaved schedule, NaN under load.
    Each send gets a copy of its own, which only the pending send holds."""

    def p2p_ops(*, tensor_send_prev, tensor_send_next, **kwargs):
        def own(tensor):
            return None if tensor is None else tensor.clone()
        return original(tensor_send_prev=own(tensor_send_prev), tensor_send_next=own(tensor_send_next), **kwargs)

    return p2p_ops


def _wrap_tensor_type(original):
    """Megatron's optimizers and grad clipping check `t.type() == 'torch.cuda.FloatTensor'`:
    report cpu tensors under the cuda type name (conversions with a dtype argument are untouched)."""

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        return original(self, dtype, non_blocking, **kwargs)

    return type_


CPU_CUDA_REPLACEMENTS = {
    "torch.cuda.current_device": _current_device,
    "torch.cuda.synchronize": lambda *a, **k: None,
    "torch.cuda.Stream": _CpuStream,
    "torch.cuda.Event": _CpuEvent,
    "torch.cuda.current_stream": lambda *a, **k: _CPU_STREAM,
    "torch.cuda.default_stream": lambda *a, **k: _CPU_STREAM,
    "torch.cuda.stream": _stream_context,
    "torch.cuda.manual_seed": _manual_seed,
    "torch.cuda.get_rng_state": _get_rng_state,
    "torch.cuda.set_rng_state": _set_rng_state,
    "torch.cuda.max_memory_allocated": _memory_stat,
    "torch.cuda.memory_allocated": _memory_stat,
    "torch.cuda.max_memory_reserved": _memory_stat,
    "torch.cuda.memory_reserved": _memory_stat,
    "torch.cuda.reset_peak_memory_stats": lambda *a, **k: None,
    "torch.cuda.empty_cache": lambda *a, **k: None,
}


def _device_backend(backend, device: str):
    """'nccl' in a backend string ('nccl', 'cuda:nccl', 'cpu:gloo,cuda:nccl') names the device's own."""
    if isinstance(backend, str) and "nccl" in backend:
        return backend.replace("nccl", dist_backend_for(device))
    return backend


def _wrap_group_maker(device: str, backend_position: int):
    """init_process_group / new_group asked for nccl get the device's collective backend (gloo on
    cpu), as torch_npu maps nccl to hccl. backend_position: where `backend` sits positionally."""
    def wrapper(original):
        def make_group(*args, **kwargs):
            if "backend" in kwargs:
                kwargs["backend"] = _device_backend(kwargs["backend"], device)
            elif len(args) > backend_position:
                args = (args[:backend_position] + (_device_backend(args[backend_position], device),)
                        + tuple(args[backend_position + 1:]))
            return original(*args, **kwargs)
        return make_group
    return wrapper


#: torch.distributed's group makers and where each takes `backend` positionally
GROUP_MAKERS = {"init_process_group": 0, "new_group": 2}


def apply_cpu_shim(patcher) -> None:
    for target, replacement in CPU_CUDA_REPLACEMENTS.items():
        patcher.replace(target, replacement, reason="cpu stands in for cuda")
    for maker, backend_position in GROUP_MAKERS.items():
        patcher.wrap(f"torch.distributed.{maker}", _wrap_group_maker("cpu", backend_position),
                     reason="backend 'nccl' -> gloo, the cpu's collective backend", aliases="torch.distributed")
    apply_absent_package_probes(patcher)
    import megatron.core.parallel_state as parallel_state
    patcher.wrap("megatron.core.parallel_state.destroy_model_parallel", wrap_destroy_model_parallel(parallel_state),
                 reason="gloo groups hold threads from creation: destroy the ones Megatron forgets", aliases="megatron")
    import megatron.core.tensor_parallel.random as mrandom
    patcher.replace("megatron.core.tensor_parallel.random._get_cuda_rng_state", _get_rng_state,
                    reason="cpu generator is the device generator", aliases="megatron")
    patcher.replace("megatron.core.tensor_parallel.random._set_cuda_rng_state", _set_rng_state,
                    reason="cpu generator is the device generator", aliases="megatron")
    cpu_tracker = type("CpuRNGStatesTracker", (_CpuRNGTrackerMixin, mrandom.CudaRNGStatesTracker), {})
    patcher.replace("megatron.core.tensor_parallel.random.CudaRNGStatesTracker", cpu_tracker,
                    reason="fork without the cuda/cpu state warning", aliases="megatron")
    apply_torch_norm_shim(patcher)
    patcher.wrap("megatron.core.tensor_parallel.mappings.all_to_all", _wrap_all_to_all,
                 reason="gloo all_to_all needs list split sizes", aliases="megatron")
    # the overlapped (interleaved-schedule) sends; the batched ones are waited on before Megatron frees
    patcher.wrap("megatron.core.pipeline_parallel.p2p_communication._p2p_ops", _wrap_p2p_ops,
                 reason="gloo reads a send buffer after isend returns: each send owns its buffer")
    patcher.wrap("torch.Tensor.type", _wrap_tensor_type,
                 reason="Megatron optimizers check tensor.type() == 'torch.cuda.FloatTensor'")
    _define_missing_te_names(patcher)
    _skip_empty_fp8_quantize(patcher)
    apply_foreach_multi_tensor(patcher)
    apply_native_linear(patcher)
    apply_fused_cpu_adam(patcher)
    apply_torch_adam_fallback(patcher)
    apply_profiler_nvtx(patcher)
    apply_one_rank_all_reduce(patcher)
    apply_stacked_all_gather(patcher)
    apply_megatron_fsdp_on_cpu(patcher)
    apply_one_rank_regions(patcher)
    apply_one_rank_cross_entropy(patcher)
    apply_cpu_torch_views(patcher)
    apply_in_process_results_queue(patcher)
    mode = CudaToCpuMode()
    patcher.enter("torch.overrides.TorchFunctionMode[CudaToCpuMode]", mode,
                  reason="device='cuda' / .cuda() -> cpu")
    patcher.wrap("torch.autograd.function.BackwardCFunction.apply", _backward_under(mode),
                 reason="custom autograd Functions' backward allocate on 'cuda' too (Megatron's fused kernels)")


def _backward_under(mode):
    """torch turns a mode off while its handler runs, and `Tensor.backward` goes through the handler:
    a custom autograd Function's backward would run without the mode its forward ran under."""
    def wrapper(original):
        def apply(self, *args):
            if any(isinstance(active, CudaToCpuMode) for active in _get_current_function_mode_stack()):
                return original(self, *args)
            with mode:
                return original(self, *args)
        return apply
    return wrapper


def _define_missing_te_names(patcher) -> None:
    """moe_utils reads `te_general_gemm` even when Transformer Engine failed to import."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        patcher.define("megatron.core.transformer.moe.moe_utils.te_general_gemm", None,
                       reason="Transformer Engine absent")


def _wrap_quantize_param_shard(original):
    def quantize_param_shard(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None      # nothing is fp8: the TE-less fallback would raise for nothing
        return original(model_params, *args, **kwargs)
    return quantize_param_shard


def _skip_empty_fp8_quantize(patcher) -> None:
    """core 0.12's distributed optimizer calls quantize_param_shard on every step, and without
    Transformer Engine that raises even when no parameter is fp8."""
    import megatron.core.fp8_utils as fp8_utils
    from megatron.core.utils import is_te_min_version   # noqa: F401  (present in every tested core)
    if hasattr(fp8_utils, "quantize_param_shard") and _raises_without_te(fp8_utils):
        patcher.wrap("megatron.core.fp8_utils.quantize_param_shard", _wrap_quantize_param_shard,
                     reason="TE-less core 0.12 raises on an empty fp8 parameter list", aliases="megatron")


def _raises_without_te(fp8_utils) -> bool:
    try:
        fp8_utils.quantize_param_shard([], [], [], None)
    except RuntimeError:
        return True
    return False


def apply_npu_shim(patcher) -> None:
    """On Ascend, torch_npu maps torch.cuda.* and 'cuda' devices to the NPU itself."""
    import torch_npu  # noqa: F401  (only reached when device == 'npu')
    from torch_npu.contrib import transfer_to_npu  # noqa: F401
    apply_absent_package_probes(patcher)
    log.info("MindSpeed: torch_npu transfer_to_npu active")


def apply_device_shim(patcher, device: str, megatron_lm: bool = False) -> None:
    """megatron_lm: the user's script is Megatron-LM's own (megatron.training on top of core)."""
    if device == "cpu":
        if megatron_lm:   # before megatron.training (and with it megatron.core) is imported
            apply_cpu_training_shim(patcher)
        apply_cpu_shim(patcher)
    elif device == "cuda":
        apply_torch_norm_shim(patcher)
        apply_torch_adam_fallback(patcher)
    elif device == "npu":
        apply_npu_shim(patcher)
    apply_mla_standin(patcher)     # every device: MindSpeed's Megatron-Core runs without Transformer Engine
    apply_clip_vit_norm(patcher)   # every device: CLIP's own no-TE default norm cannot be built
    apply_write_item_format(patcher)   # every device: Megatron-Core 0.12's checkpoint writer on this torch
