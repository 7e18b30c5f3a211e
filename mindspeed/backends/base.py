"""The small interface every feature is written against.

A backend bundles five parts: device, comm, kernels, autograd, memory. Features never import a
framework or device API; they receive the run's backend (ApplyContext.backend, handed on to what
their hooks install) and use these parts. Tensors are the
backend's own tensor type; groups are opaque handles the backend hands out.
Capabilities are declared by name with a level, so the support matrix can be computed without
importing the framework behind a backend.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence


class Level(str, enum.Enum):
    NATIVE = "native"      # implemented by the device / framework directly
    EMULATED = "emulated"  # works, built from other primitives (slower, same semantics)
    ABSENT = "absent"      # not available: features that require it are refused

    @property
    def rank(self) -> int:
        return {"absent": 0, "emulated": 1, "native": 2}[self.value]


class Cap:
    """Capability names: one name per concept across flags, features, matrix and tests."""
    # device
    RNG_STATE = "device.rng_state"
    BF16_COMPUTE = "device.bf16_compute"     # bf16 kernels for the model's ops (else fp32 on upcast inputs)
    # collectives
    ALL_REDUCE = "comm.all_reduce"
    ALL_GATHER = "comm.all_gather"
    REDUCE_SCATTER = "comm.reduce_scatter"
    ALL_TO_ALL = "comm.all_to_all"
    SEND_RECV = "comm.send_recv"
    BROADCAST = "comm.broadcast"
    SUBGROUPS = "comm.subgroups"
    # kernels (docs/kernels.md)
    RMS_NORM = "kernel.rms_norm"
    SWIGLU = "kernel.swiglu"
    ROPE = "kernel.rope"
    FLASH_ATTENTION = "kernel.flash_attention"
    RING_ATTENTION_UPDATE = "kernel.ring_attention_update"
    GMM = "kernel.gmm"
    MATMUL_ADD_FP32 = "kernel.matmul_add_fp32"
    MOE_PERMUTE = "kernel.moe_permute"
    DROPOUT_ADD_LAYER_NORM = "kernel.dropout_add_layer_norm"
    ASYNC_COMM = "comm.async"               # collectives that run while the caller computes
    # autograd and memory
    CUSTOM_OP = "autograd.custom_op"
    RECOMPUTE = "memory.recompute"
    RECOMPUTE_OUTPUT = "memory.recompute_output"   # outputs freed after their consumer, rebuilt in backward
    HOST_OFFLOAD = "memory.host_offload"
    PEAK_MEMORY = "memory.peak_stats"
    # host model the features hook into
    MEGATRON_CORE = "host.megatron_core"      # torch backend: Megatron-Core modules
    NATIVE_TRAINER = "host.native_trainer"    # mindspore backend: MindSpeed's MindSpore GPT
    PIPELINE_PARALLEL = "host.pipeline_parallel"
    DISTRIBUTED_OPTIMIZER = "host.distributed_optimizer"
    MOE = "host.moe"
    PROFILER = "host.profiler"

    @classmethod
    def all(cls) -> list[str]:
        return [v for k, v in vars(cls).items() if k.isupper() and isinstance(v, str)]


Capabilities = dict  # name -> Level


class DeviceAPI(ABC):
    name: str  # "cpu", "cuda", "npu", "ascend", ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def manual_seed(self, seed: int) -> None: ...

    @abstractmethod
    def get_rng_state(self) -> Any: ...

    @abstractmethod
    def set_rng_state(self, state: Any) -> None: ...

    def side_stream(self) -> Any:
        """Where work meant to run beside the host's compute goes (communication a schedule overlaps):
        None where the device's own streams do it (CUDA, NPU); else an object whose submit(fn, *args,
        label=...) runs fn in order beside the host thread and returns a Future."""
        return None


class CommAPI(ABC):
    """Collectives over the backend's process groups. `group=None` means the world."""

    @abstractmethod
    def rank(self, group=None) -> int: ...

    @abstractmethod
    def world_size(self, group=None) -> int: ...

    @abstractmethod
    def new_group(self, ranks: Sequence[int]): ...

    @abstractmethod
    def all_reduce(self, tensor, op: str = "sum", group=None):
        """Returns the reduced tensor (op: sum | max | min | avg)."""

    @abstractmethod
    def all_gather(self, tensor, dim: int = 0, group=None):
        """Concatenates every rank's tensor along `dim`."""

    @abstractmethod
    def reduce_scatter(self, tensor, dim: int = 0, group=None):
        """Sums across ranks, then keeps this rank's slice of `dim`."""

    @abstractmethod
    def all_to_all(self, tensor, scatter_dim: int, gather_dim: int, group=None):
        """Splits `scatter_dim` into world chunks, sends chunk i to rank i, concatenates received
        chunks along `gather_dim`."""

    @abstractmethod
    def send_recv(self, send_tensor, dst: int, src: int, group=None):
        """Sends to `dst` and receives a tensor shaped like `send_tensor` from `src` (group ranks).
        Returns (received, handle) where handle.wait() completes the exchange; a synchronous
        backend returns a completed handle."""

    @abstractmethod
    def broadcast(self, tensor, src: int = 0, group=None): ...

    @abstractmethod
    def barrier(self, group=None) -> None: ...

    # differentiable variants, used inside models (backward = the adjoint collective)
    @abstractmethod
    def all_to_all_autograd(self, tensor, scatter_dim: int, gather_dim: int, group=None): ...

    @abstractmethod
    def all_gather_autograd(self, tensor, dim: int = 0, group=None): ...

    @abstractmethod
    def reduce_scatter_autograd(self, tensor, dim: int = 0, group=None): ...

    # asynchronous variants (Cap.ASYNC_COMM): start the collective and return a handle at once;
    # handle.wait() returns what the synchronous call would. The caller computes in between; the
    # input must not change before wait(). The defaults run the collective synchronously (a
    # completed handle): same result, nothing overlapped. Declare Cap.ASYNC_COMM emulated then.
    def all_reduce_async(self, tensor, op: str = "sum", group=None) -> "CommHandle":
        return Completed(self.all_reduce(tensor, op, group))

    def all_gather_async(self, tensor, dim: int = 0, group=None) -> "CommHandle":
        return Completed(self.all_gather(tensor, dim, group))

    def reduce_scatter_async(self, tensor, dim: int = 0, group=None) -> "CommHandle":
        return Completed(self.reduce_scatter(tensor, dim, group))

    def all_to_all_v_async(self, tensor, output_splits, input_splits, group=None) -> "CommHandle":
        """Uneven all-to-all along dim 0 (MoE token dispatch): rows [sum(input_splits[:i]), +
        input_splits[i]) go to rank i; wait() gives the received rows, output_splits[i] from rank
        i, in rank order. No generic default (the splits differ per rank, so an even all_to_all
        cannot stand in without an extra size exchange): a backend with MoE hosts provides it."""
        raise NotImplementedError(f"{type(self).__name__} has no uneven all-to-all")


class CommHandle(ABC):
    """An asynchronous collective in flight; wait() blocks until it is done and returns its result."""

    @abstractmethod
    def wait(self): ...


class Completed(CommHandle):
    def __init__(self, result):
        self.result = result

    def wait(self):
        return self.result


class KernelsAPI(ABC):
    """docs/kernels.md. Every backend provides each kernel (fast where it can, the reference where
    it cannot) and exposes its reference implementation under `reference`."""

    reference: "KernelsAPI"

    @abstractmethod
    def rms_norm(self, x, gamma, eps: float = 1e-6):
        """-> (y, rstd). y = cast(x * rsqrt(mean(x^2) + eps), x.dtype) * gamma; rstd fp32."""

    @abstractmethod
    def swiglu(self, x, dim: int = -1):
        """silu(first half) * second half along `dim`."""

    @abstractmethod
    def rope(self, x, cos, sin, mode: int = 0):
        """Rotary embedding; mode 0 rotate-half, 1 interleaved. Only the first cos.shape[-1]
        channels rotate; the rest pass through."""

    @abstractmethod
    def attention(self, q, k, v, *, layout: str = "SBH", head_num: int, mask=None, scale: float | None = None,
                  dropout_p: float = 0.0, pre_tokens: int = 2**31 - 1, next_tokens: int = 2**31 - 1,
                  causal: bool = False, actual_seq_qlen=None, actual_seq_kvlen=None, alibi=None):
        """-> (out, softmax_max, softmax_sum); stats fp32 shaped [b, n, sq] (TND: [t, n])."""

    @abstractmethod
    def ring_attention_update(self, prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum, *,
                              layout: str = "SBH"):
        """-> (out, max, sum) merged with the online-softmax rule; outs in `layout`."""

    @abstractmethod
    def gmm(self, x, weight, group_list, group_list_type: int = 0):
        """Grouped matmul; group_list cumulative ends (type 0) or sizes (type 1)."""

    @abstractmethod
    def matmul_add_fp32(self, x, dy, main_grad):
        """In place main_grad += dy^T @ x in fp32; returns main_grad."""

    @abstractmethod
    def grouped_matmul_add_fp32(self, x, dy, group_list, main_grad, group_list_type: int = 0):
        """In place main_grad (G*K*N values, read as [G, K, N]) [g] += x_g^T @ dy_g in fp32, with
        x [M, K] and dy [M, N] rows split into groups as gmm's; returns main_grad."""

    @abstractmethod
    def moe_permute(self, tokens, routing_map):
        """-> (permuted_tokens, sorted_indices); routing_map [T, E] bool, expert-major order."""

    @abstractmethod
    def moe_unpermute(self, permuted_tokens, sorted_indices, probs, restore_shape, *, routing_map=None):
        """Scatter-add back to [T, H], each row weighted by its routing prob. probs: None (1), [P]
        per permuted row, or [T, E] together with the routing_map that made the permutation."""

    @abstractmethod
    def dropout_add_layer_norm(self, x0, residual, weight, bias, dropout_p: float, epsilon: float, *,
                               rowscale=None, layerscale=None, prenorm: bool = False,
                               residual_in_fp32: bool = False, return_dropout_mask: bool = False):
        """z = dropout(x0 * rowscale * layerscale) + residual; out = layer_norm(z, weight, bias,
        epsilon). -> (out, mask), with prenorm (out, z, mask); mask is None unless asked for."""


#: the kernels KernelsAPI declares, in declaration order (read from the class: they cannot drift)
KERNEL_NAMES = tuple(name for name, member in vars(KernelsAPI).items()
                     if getattr(member, "__isabstractmethod__", False))

#: capability -> the kernels that must all have a fast path for the capability to be native
#: (grouped_matmul_add_fp32 has none: the gmm weight-gradient fusion, served by the reference everywhere)
KERNEL_CAPS = {
    Cap.RMS_NORM: ("rms_norm",),
    Cap.SWIGLU: ("swiglu",),
    Cap.ROPE: ("rope",),
    Cap.FLASH_ATTENTION: ("attention",),
    Cap.RING_ATTENTION_UPDATE: ("ring_attention_update",),
    Cap.GMM: ("gmm",),
    Cap.MATMUL_ADD_FP32: ("matmul_add_fp32",),
    Cap.MOE_PERMUTE: ("moe_permute", "moe_unpermute"),
    Cap.DROPOUT_ADD_LAYER_NORM: ("dropout_add_layer_norm",),
}


def kernel_levels(fast: set) -> dict:
    """Kernel capability levels given the kernels with a fast path: native, else emulated by
    the reference implementation."""
    return {cap: (Level.NATIVE if all(k in fast for k in kernels) else Level.EMULATED)
            for cap, kernels in KERNEL_CAPS.items()}


class DispatchKernels(KernelsAPI):
    """Serves each kernel from a device's fast module where it has one, else from the reference
    module; `reference` is the reference alone, through the same class (its methods).

    A kernel module holds one function per kernel, named as KernelsAPI's method. The fast kernels
    are chosen by name because the catalogue that lists them is framework-free (the support matrix
    reads it without importing the modules); the names are KERNEL_NAMES, checked by the tests."""

    def __init__(self, reference, fast=None, fast_names=frozenset()):
        self._impl = {name: getattr(reference, name) for name in KERNEL_NAMES}
        if fast_names:
            self._impl.update({name: getattr(fast, name) for name in fast_names})
            self.reference = self._serving_only(reference)
        else:
            self.reference = self

    def _serving_only(self, reference) -> "DispatchKernels":
        # the subclass's own methods (a backend may extend a kernel's keywords), no fast path
        kernels = object.__new__(type(self))
        DispatchKernels.__init__(kernels, reference)
        return kernels

    def implementation(self, name: str):
        """The callable that serves `name` (for tests and logs)."""
        return self._impl[name]

    def rms_norm(self, x, gamma, eps: float = 1e-6):
        return self._impl["rms_norm"](x, gamma, eps)

    def swiglu(self, x, dim: int = -1):
        return self._impl["swiglu"](x, dim)

    def rope(self, x, cos, sin, mode: int = 0):
        return self._impl["rope"](x, cos, sin, mode)

    def attention(self, q, k, v, *, layout: str = "SBH", head_num: int, mask=None, scale: float | None = None,
                  dropout_p: float = 0.0, pre_tokens: int = 2**31 - 1, next_tokens: int = 2**31 - 1,
                  causal: bool = False, actual_seq_qlen=None, actual_seq_kvlen=None, alibi=None):
        return self._impl["attention"](q, k, v, layout=layout, head_num=head_num, mask=mask, scale=scale,
                                       dropout_p=dropout_p, pre_tokens=pre_tokens, next_tokens=next_tokens,
                                       causal=causal, actual_seq_qlen=actual_seq_qlen,
                                       actual_seq_kvlen=actual_seq_kvlen, alibi=alibi)

    def ring_attention_update(self, prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum, *,
                              layout: str = "SBH"):
        return self._impl["ring_attention_update"](prev_out, prev_max, prev_sum, cur_out, cur_max, cur_sum,
                                                   layout=layout)

    def gmm(self, x, weight, group_list, group_list_type: int = 0):
        return self._impl["gmm"](x, weight, group_list, group_list_type)

    def matmul_add_fp32(self, x, dy, main_grad):
        return self._impl["matmul_add_fp32"](x, dy, main_grad)

    def grouped_matmul_add_fp32(self, x, dy, group_list, main_grad, group_list_type: int = 0):
        return self._impl["grouped_matmul_add_fp32"](x, dy, group_list, main_grad, group_list_type)

    def moe_permute(self, tokens, routing_map):
        return self._impl["moe_permute"](tokens, routing_map)

    def moe_unpermute(self, permuted_tokens, sorted_indices, probs, restore_shape, *, routing_map=None):
        return self._impl["moe_unpermute"](permuted_tokens, sorted_indices, probs, restore_shape,
                                           routing_map=routing_map)

    def dropout_add_layer_norm(self, x0, residual, weight, bias, dropout_p: float, epsilon: float, *,
                               rowscale=None, layerscale=None, prenorm: bool = False,
                               residual_in_fp32: bool = False, return_dropout_mask: bool = False):
        return self._impl["dropout_add_layer_norm"](x0, residual, weight, bias, dropout_p, epsilon,
                                                    rowscale=rowscale, layerscale=layerscale, prenorm=prenorm,
                                                    residual_in_fp32=residual_in_fp32,
                                                    return_dropout_mask=return_dropout_mask)


class TensorAPI(ABC):
    """The tensor operations features need beyond the methods torch and MindSpore tensors share
    (shape, reshape, slicing, arithmetic): joining and splitting, differentiable, no extra copies."""

    @abstractmethod
    def cat(self, tensors: Sequence, dim: int = 0):
        """The tensors joined along `dim` (other dims equal)."""

    @abstractmethod
    def split(self, tensor, sizes: int | Sequence[int], dim: int = 0) -> list:
        """Views of `tensor` along `dim`: pieces of `sizes` each (an int) or of the listed sizes."""


class AutogradAPI(ABC):
    @abstractmethod
    def custom_op(self, forward: Callable, backward: Callable) -> Callable:
        """Build a differentiable op. forward(ctx, *inputs) -> outputs; backward(ctx, *grads)
        -> input grads. `ctx.save(*tensors)` / `ctx.saved` keep what backward needs."""


class MemoryLedger:
    """Bytes the swap features (--swap-attention, --swap-optimizer) hold on each side.

    On a CPU "host" and "device" are the same RAM, so the allocator cannot tell them apart; the
    backends copy for real on every offload/reload and count here, per side, the bytes alive now
    (a host copy is counted until it is garbage, through a weakref finalizer), the peak of each,
    and the bytes moved each way."""

    def __init__(self):
        self.held = {"host": 0, "device": 0}
        self.peak = {"host": 0, "device": 0}
        self.moved = {"host": 0, "device": 0}     # bytes copied towards each side, in total

    def hold(self, side: str, obj, nbytes: int) -> None:
        """`obj` (a copy on `side`) holds nbytes until it is garbage-collected."""
        import weakref
        self.held[side] += nbytes
        self.moved[side] += nbytes
        self.peak[side] = max(self.peak[side], self.held[side])
        weakref.finalize(obj, self._drop, side, nbytes)

    def _drop(self, side: str, nbytes: int) -> None:
        self.held[side] -= nbytes

    def adjust(self, side: str, nbytes: int) -> None:
        """Storage that stays one object (an optimizer state emptied and refilled in place)."""
        self.held[side] += nbytes
        if nbytes > 0:
            self.moved[side] += nbytes
        self.peak[side] = max(self.peak[side], self.held[side])

    def reset_peaks(self) -> None:
        self.peak = dict(self.held)


class MemoryAPI(ABC):
    @property
    def ledger(self) -> MemoryLedger:
        if "_ledger" not in self.__dict__:
            self._ledger = MemoryLedger()
        return self._ledger

    @abstractmethod
    def recompute(self, fn: Callable, *args):
        """Run fn(*args) without keeping its activations; recompute them in backward."""

    def recompute_output(self, fn: Callable, *args) -> "RecomputedOutput":
        """Run fn(*args) keeping only its inputs: for a cheap op (a norm, an activation) whose
        output the next op saves for backward. `recompute` alone cannot drop that output, since the
        consumer holds it; here the caller frees it once the consumer has run, with
        `handle.discard(consumer_output)`, and it is rebuilt, in place, when the consumer's output
        gradient arrives. fn must be deterministic (no dropout)."""
        raise NotImplementedError(f"{type(self).__name__} has no output-discarding recompute")

    @abstractmethod
    def offload_to_host(self, tensor):
        """A host copy of tensor (counted in ledger.held['host'] while it lives)."""

    @abstractmethod
    def reload_to_device(self, tensor):
        """A device copy of a host copy (counted in ledger.held['device'] while it lives)."""

    def saved_tensors_hooks(self, pack: Callable, unpack: Callable):
        """Context in which tensors saved for backward go through pack() and come back through
        unpack() (--swap-attention). Backends without such a hook refuse."""
        raise NotImplementedError(f"{type(self).__name__} has no saved-tensor hooks")

    def nbytes(self, tensor) -> int:
        return int(tensor.numel()) * int(tensor.element_size())

    def view_of(self, tensor):
        """(base, recipe): the tensor whose storage `tensor` views and how make_view rebuilds it
        from a copy of that base; (tensor, None) when it is not a view."""
        return tensor, None

    def make_view(self, base, recipe):
        raise NotImplementedError(f"{type(self).__name__} has no views")

    def is_parameter(self, tensor) -> bool:
        """A trainable leaf (a weight): saved for backward by reference, never swapped."""
        return bool(getattr(tensor, "requires_grad", False)) and bool(getattr(tensor, "is_leaf", False))

    @abstractmethod
    def peak_memory_bytes(self) -> int: ...

    @abstractmethod
    def reset_peak_memory(self) -> None: ...


class RecomputedOutput(ABC):
    """What MemoryAPI.recompute_output returns: `output` (fn's result) and `discard`."""
    output: Any

    @abstractmethod
    def discard(self, consumer_output) -> None:
        """Free `output`'s memory now; rebuild it when consumer_output's gradient is computed."""


class ProfilerAPI(ABC):
    """One profiling window: start() ... stop(); stop() writes the trace and returns its paths."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def stop(self) -> list[str]: ...


class Backend(ABC):
    """A framework on a device. Made by mindspeed.backends.set_backend (mindspeed.adapt); a run's is Session.backend."""

    name: str  # "torch" | "mindspore"
    device: DeviceAPI
    comm: CommAPI
    kernels: KernelsAPI
    tensors: TensorAPI
    autograd: AutogradAPI
    memory: MemoryAPI

    @classmethod
    @abstractmethod
    def declared_capabilities(cls, device: str) -> Capabilities:
        """What this backend provides on `device`, without importing its framework."""

    @classmethod
    @abstractmethod
    def devices(cls) -> list[str]:
        """Devices this backend can run on, in the support matrix's column order."""

    def capabilities(self) -> Capabilities:
        return self.declared_capabilities(self.device.name)

    def profiler(self, save_path: str, *, level: str = "level0", with_cpu: bool = True,
                 with_stack: bool = False, with_memory: bool = False, record_shapes: bool = False,
                 tag: str = "") -> ProfilerAPI:
        """A profiler for one window of steps (Cap.PROFILER). Backends without one refuse."""
        raise NotImplementedError(f"backend {self.name!r} has no profiler ({Cap.PROFILER})")
