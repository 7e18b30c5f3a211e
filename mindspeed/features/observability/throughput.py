"""--op-cal-tflops (MindSpeed's name for Megatron's --log-throughput): model TFLOP/s per device and
MFU against the device's peak (mindspeed/training/peak.py) in the iteration log line and in
TensorBoard. The FLOPs are the model's, counted by mindspeed/training/flops.py in both trainers."""
from __future__ import annotations

from mindspeed.features.base import Feature, switch
from mindspeed.features.registry import register


@register
class OpCalTflops(Feature):
    id = "op-cal-tflops"
    category = "observability"
    optimization_level = 0
    description = "TFLOP/s per device and MFU (against a datasheet or measured peak) in the log and TensorBoard"
    flags = (switch("--op-cal-tflops", "log model TFLOP/s per device and MFU (as --log-throughput does)"),)
    example = ("--op-cal-tflops",)
    # Megatron's flag: the built-in trainers log TFLOP/s and MFU for it; inside Megatron-LM's own
    # pretrain_gpt.py its training_log prints TFLOP/s per GPU for it
    host_flags = {"log_throughput": True}
