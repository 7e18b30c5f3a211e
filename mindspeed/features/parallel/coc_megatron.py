"""The Megatron-Core hook of --use-ascend-coc: ColumnParallelLinear's linear function and
RowParallelLinear's forward run through features/parallel/coc.py when the layer communicates over
its tensor-parallel group. Layers with nothing to overlap keep Megatron's path: frozen weights
(no backward GEMM), MoE experts with explicit expert communication (no TP collective in the
layer), a group of one."""
from __future__ import annotations

from mindspeed.features.parallel.coc import Coc

LAYERS = "megatron.core.tensor_parallel.layers"

#: calls that went through CoC, by layer kind (read by the wiring test)
CALLS = {"column": 0, "row": 0}


def column_impl(coc: Coc, chunks: int):
    def wrap(original):
        def _forward_impl(self, input, weight, *args, **kw):
            group = kw.get("tp_group")
            overlap = (not args and weight.requires_grad and kw.get("grad_output_buffer") is None
                       and (kw.get("allreduce_dgrad") or kw.get("sequence_parallel"))
                       and group is not None and coc.comm.world_size(group) > 1)
            if not overlap:
                return original(self, input, weight, *args, **kw)
            CALLS["column"] += 1
            out = coc.column_linear(input, weight, group, sequence_parallel=bool(kw.get("sequence_parallel")),
                                    chunks=chunks, accumulate=bool(kw.get("gradient_accumulation_fusion")))
            bias = kw.get("bias")
            return out if bias is None else out + bias
        return _forward_impl
    return wrap


def row_forward(coc: Coc, chunks: int):
    def wrap(original):
        def forward(self, input_):
            offload = getattr(self.config, "_cpu_offloading_context", None)
            overlap = (self.input_is_parallel and not self.explicit_expert_comm and self.weight.requires_grad
                       and (offload is None or not offload.inside_context) and coc.comm.world_size(self.tp_group) > 1)
            if not overlap:
                return original(self, input_)
            CALLS["row"] += 1
            out = coc.row_linear(input_, self.weight, self.tp_group, sequence_parallel=self.sequence_parallel,
                                 chunks=chunks, accumulate=self.gradient_accumulation_fusion)
            if self.skip_bias_add:
                return out, self.bias
            return (out + self.bias if self.bias is not None else out), None
        return forward
    return wrap


def install(patcher, backend, chunks: int) -> None:
    """The layers' hooks, running CoC over `backend` (the run's)."""
    why = f"--use-ascend-coc: GEMM in {chunks} chunk(s), each chunk's collective overlapped"
    coc = Coc(backend)
    patcher.wrap(f"{LAYERS}.ColumnParallelLinear._forward_impl", column_impl(coc, chunks), reason=why)
    patcher.wrap(f"{LAYERS}.RowParallelLinear.forward", row_forward(coc, chunks), reason=why)
