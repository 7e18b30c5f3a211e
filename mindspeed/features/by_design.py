"""MindSpeed's catalogue features this project refuses by design: upstream runs them only on its
legacy (non-Megatron-Core) models, which this project does not carry, or they need a device driver
capability no backend here can stand in for. Their flags parse, so an upstream launch script gets
an answer, and the gate refuses any of them on every backend, before any work, in one line that
says why (`Feature.by_design`) and what to use instead; unlike features/planned.py, no issue
tracks them.
"""
from __future__ import annotations

from mindspeed.features.base import Flag, switch
from mindspeed.features.planned import PlannedFeature, _example
from mindspeed.features.registry import register

LEGACY = "upstream MindSpeed runs it only on Megatron's legacy (non-Megatron-Core) models, which this project does not carry"


def by_design(feature_id: str, category: str, why: str, alternatives: str, description: str, *flags: Flag) -> None:
    cls = type("ByDesign" + feature_id.title().replace("-", ""), (PlannedFeature,), dict(
        id=feature_id, category=category, by_design=why, alternatives=alternatives, description=description,
        flags=flags, example=_example(flags[0])))
    register(cls)


def on(name: str) -> Flag:
    return switch(name, "refused by design (python -m mindspeed matrix says why)")


def value(name: str, kind=str, **kwargs) -> Flag:
    return Flag(name, dict(type=kind, default=None, help="refused by design (python -m mindspeed matrix says why)",
                           **kwargs))


by_design("pipe-experts", "moe", f"MoE MLP communication hiding: {LEGACY} (its DeepSpeed-style MoE layer)",
          "--moe-alltoall-overlap-comm (Megatron-Core's alltoall dispatcher overlapped with the experts)",
          "MoE MLP communication hiding",
          on("--use-pipe-experts"), on("--pipe-experts-multi-stream"), value("--pipe-experts-multi-data", int))
by_design("nanopipe", "parallel", f"nano-pipe: {LEGACY} (its schedule refuses Megatron-Core models)",
          "Megatron-Core's interleaved pipeline (--num-layers-per-virtual-pipeline-stage)",
          "nano-pipe pipeline schedule", on("--use-nanopipe"), on("--use-nanopipe-swap"))
by_design("adaptive-recompute-device-swap", "memory",
          f"adaptive recompute's device swap: {LEGACY} (its argument check refuses Megatron-Core models)",
          "--swap-attention or --recompute-granularity", "adaptive recompute with activation swapping",
          on("--adaptive-recompute-device-swap"))
by_design("virtual-optimizer", "memory",
          "the virtual optimizer keeps Adam's moments in host memory that the Ascend driver maps into the "
          "device's address space (torch_npu.empty_with_swapped_memory); no backend here has such a mapping",
          "--swap-optimizer (the moments on the host, swapped in by chunks for the update)",
          "optimizer moments in driver-mapped host memory",
          Flag("--virtual-optimizer", dict(nargs="+", default=None, metavar="GB|all",
                                           help="refused by design (python -m mindspeed matrix says why)")))
