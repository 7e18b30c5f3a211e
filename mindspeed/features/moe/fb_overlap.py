"""The Megatron-Core hook of --moe-fb-overlap: Megatron-Core 0.16's combined-1F1B schedule
(TransformerConfig.overlap_moe_expert_parallel_comm, switched on after the config's own checks).

Megatron splits each MoE layer of a micro-batch into nodes (attn, dispatch, mlp, combine) and runs
one micro-batch's forward nodes between another's backward nodes (model_chunk_schedule_plan.py):
dispatch and combine (the all-to-alls) on a communication stream, attn and mlp on the compute
stream, each micro-batch's nodes ordered by its plan's event.

Where the device has no second stream (CPU), the backend's side stream stands in
(DeviceAPI.side_stream): a communication node's forward or backward is submitted to it and returns
a Pending at once; the host thread goes on with the other micro-batch's compute node. A compute
node first waits for its own micro-batch's communication (the event) and takes the Pending's
value; every layer's step ends with its results taken, so no Pending leaves it. The arithmetic is
Megatron's, in the same order per micro-batch.
"""
from __future__ import annotations

import logging

from mindspeed.features.fused import config_fields

WHY = "--moe-fb-overlap: Megatron-Core's combined 1F1B (one micro-batch's all-to-alls under another's compute)"
NODE = "megatron.core.pipeline_parallel.utils.ScheduleNode"
LAYER_RUN = "megatron.core.models.common.model_chunk_schedule_plan.TransformerLayerSchedulePlan.run"
NVTX = ("torch.cuda.nvtx.range_push", "torch.cuda.nvtx.range_pop")
CONFIGS = ("megatron.core.transformer.transformer_config.TransformerConfig.__init__",
           "megatron.core.transformer.transformer_config.MLATransformerConfig.__init__")
log = logging.getLogger("mindspeed")


class Pending:
    """A node's result still being computed on the side stream."""

    def __init__(self, future):
        self.future = future


def taken(value):
    """value with every Pending in it (or in its tuple) replaced by its result."""
    if isinstance(value, Pending):
        return value.future.result()
    if isinstance(value, tuple):
        return tuple(taken(v) for v in value)
    return value


def _arguments(values: tuple) -> tuple:
    """A node's arguments: ScheduleNode.forward/backward wrap a lone value in a tuple, a Pending too
    (whose value may be a tuple itself)."""
    values = taken(values)
    if len(values) == 1 and isinstance(values[0], tuple):
        return values[0]
    return values


def _field_set_after_checks(original):
    def __init__(self, *args, **kwargs):
        # the host's own flag (Megatron-LM's) is set after the config's checks too (`_on`): they assert
        # bf16/fp16, which the CPU runs do without (fp32: tested equal to the plain run); the plan
        # checked the rest (fb_overlap_feature.py)
        kwargs["overlap_moe_expert_parallel_comm"] = False
        original(self, *args, **kwargs)
    return __init__


def _on(config):
    return True if (config.num_moe_experts and config.expert_model_parallel_size > 1) else None


class SideStreamNodes:
    """ScheduleNode._forward/_backward and the layer step, with communication nodes on `side`."""

    def __init__(self, side):
        self.side = side
        self.last = {}        # id(plan event) -> the Future of that micro-batch's last communication

    def _is_comm(self, node) -> bool:
        from megatron.core.pipeline_parallel.utils import get_comm_stream
        return node.stream is get_comm_stream()

    def step(self, original, phase: str):
        def run(node, *values):
            label = f"{node.name}.{phase}"
            if self._is_comm(node):
                pending = self.side.submit(lambda: original(node, *_arguments(values)), label=label)
                self.last[id(node.event)] = pending
                return Pending(pending)
            before = self.last.pop(id(node.event), None)     # the event: this micro-batch's all-to-alls
            if before is not None:
                before.result()
            return self.side.timed(label, original, node, *_arguments(values))
        return run

    def layer_run(self, original):
        def run(*args, **kwargs):
            return taken(original(*args, **kwargs))
        return run


def _no_range(*args, **kwargs):
    return None


def _record_stream(original):
    def record_stream(tensor, stream):
        # an allocator hint for a tensor used on another CUDA stream; the CPU allocator has none
        if tensor.device.type != "cpu":
            return original(tensor, stream)
        return None
    return record_stream


def install(patcher, backend, delay_wgrad: bool) -> None:
    for target in CONFIGS:
        patcher.wrap(target, _field_set_after_checks, reason=WHY)
    config_fields.override(patcher, "overlap_moe_expert_parallel_comm", _on, WHY)
    if delay_wgrad:
        log.info("MindSpeed: --delay-wgrad-compute has no effect here: Megatron-Core's local layers (no Transformer "
                 "Engine) compute weight gradients within the backward itself")
    side = backend.device.side_stream()
    if side is None:
        return                    # the device's own streams
    nodes = SideStreamNodes(side)
    patcher.wrap(f"{NODE}._forward", lambda original: nodes.step(original, "forward"), reason=WHY)
    patcher.wrap(f"{NODE}._backward", lambda original: nodes.step(original, "backward"), reason=WHY)
    patcher.wrap(LAYER_RUN, nodes.layer_run, reason=WHY)
    patcher.wrap("torch.Tensor.record_stream", _record_stream, reason=WHY)
    for target in NVTX:          # markers only: a CPU build of torch raises on them
        if patcher.find(target) is None:     # the cpu shim's profiler ranges already answer them
            patcher.replace(target, _no_range, reason=WHY)
