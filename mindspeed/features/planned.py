"""MindSpeed's catalogue features this project does not implement yet. Their flags parse (so a
launch script written for MindSpeed upstream gets a clear answer, not "unrecognized argument") and
any of them is refused by the support-matrix gate, before any work, as "not implemented yet".

`planned` names the issue that tracks the feature, or "not scheduled".
"""
from __future__ import annotations

from mindspeed.features.base import Feature, Flag, switch
from mindspeed.features.registry import register


class PlannedFeature(Feature):
    optimization_level = 0          # never dropped by --optimization-level: always refused

    def enabled(self, args) -> bool:
        return any(getattr(args, fl.dest) != fl.default for fl in self.flags)


def planned(feature_id: str, category: str, tracked: str, description: str, *flags: Flag) -> None:
    cls = type("Planned" + feature_id.title().replace("-", ""), (PlannedFeature,), dict(
        id=feature_id, category=category, planned=tracked, description=description, flags=flags,
        example=_example(flags[0])))
    register(cls)


def _example(flag: Flag) -> tuple:
    if flag.kwargs.get("action") == "store_true":
        return (flag.name,)
    choices = [c for c in flag.kwargs.get("choices") or [] if c != flag.default]
    return (flag.name, str(choices[0]) if choices else "1")


def value(name: str, kind=str, **kwargs) -> Flag:
    kwargs.setdefault("default", None)
    return Flag(name, dict(type=kind, help="not implemented yet", **kwargs))


def on(name: str) -> Flag:
    return switch(name, "not implemented yet")


MEMORY, PARALLEL, FUSED, MOE = "memory", "parallel", "fused", "moe"

planned("hccl-group-buffer", MEMORY, "not scheduled", "per-group HCCL buffer sizes (Ascend)",
        value("--hccl-group-buffer"), on("--hccl-group-buffer-adaptive"),
        value("--hccl-ep-group-buffer-adaptive-factor", float))
planned("automated-pipeline", PARALLEL, "not scheduled", "automated pipeline memory balancing",
        on("--automated-pipeline"), on("--automated-pipeline-perf"))
planned("multiparameter-pipeline", PARALLEL, "not scheduled", "pipeline stages passing several tensors",
        on("--use-multiparameter-pipeline-model-parallel"))
planned("ascend-mc2", FUSED, "not scheduled", "Ascend MC2 fused matmul + collective", on("--use-ascend-mc2"))
planned("fusion-attn-v2", FUSED, "not scheduled", "fusion attention v2 (Ascend)", on("--use-fusion-attn-v2"))
planned("moe-bmm-mc2", MOE, "not scheduled", "MoE batched matmul fused with communication (Ascend)",
        on("--moe-bmm-mc2"))
planned("deepspeed-moe", MOE, "not scheduled", "DeepSpeed-style MoE (token rearrange, dropless)",
        value("--moe-model-type", choices=["megatron_moe", "deepspeed_moe"], default="megatron_moe"), on("--moe-no-drop"),
        on("--enable-token-rearrange-opt"))
planned("ampipe", MOE, "not scheduled", "Ampipe attention/MoE pipelining",
        value("--ampipe-degree", int), on("--ampipe-tp-sp-comm-overlap"))
