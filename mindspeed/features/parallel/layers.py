"""Where the transformer layers go: --noop-layers (layers that pass their input through) and
--num-layer-list (how many layers each pipeline stage holds). MindSpeed's flag names.

Noop layers keep a model's layer numbering while removing the work, to even out pipeline stages
(upstream's use: give the stage that also holds the embedding or the logits fewer real layers).
On the torch backend they are Megatron-Core modules without parameters (features/parallel/
noop_hook.py); the MindSpore GPT skips them. FLOP counts (mindspeed/training/flops.py, and
Megatron-LM's own under its pretrain_gpt.py) leave them out.

--num-layer-list maps onto Megatron-Core's own pipeline layout (TransformerConfig's
pipeline_model_parallel_layout, Megatron-LM's --pipeline-model-parallel-layout): the first
stage also holds the embedding, the last the output layer and loss.
"""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag
from mindspeed.features.registry import register


def _int_list(flag: str, text: str) -> list[int]:
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isdigit() for p in parts):
        raise FeatureConfigError(f"{flag} takes comma-separated non-negative integers, got {text!r}")
    return [int(p) for p in parts]


def noop_layer_set(args) -> frozenset:
    """The 0-based indices --noop-layers names (empty when the flag is not given)."""
    text = args.noop_layers
    return frozenset(_int_list("--noop-layers", text)) if text else frozenset()


def layer_list(args) -> list[int] | None:
    text = args.num_layer_list
    return _int_list("--num-layer-list", text) if text else None


# the host's other ways of setting the split: --num-layer-list replaces them
CONFLICTING = (("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
               ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers"),
               ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage"),
               ("--pipeline-model-parallel-layout", "pipeline_model_parallel_layout"))
LAYOUT = "pipeline_model_parallel_layout"


def host_split(counts: list[int]) -> dict:
    """The host (Megatron) flags for a per-stage layer list: none when even; Megatron's uneven
    first/last stage when only those differ (every Megatron-Core version has it); else a full
    pipeline layout (Megatron-Core >= 0.13)."""
    if len(set(counts)) == 1:
        return {}
    middle = counts[1:-1]
    if len(set(middle)) <= 1:
        return {"decoder_first_pipeline_num_layers": counts[0], "decoder_last_pipeline_num_layers": counts[-1]}
    return {LAYOUT: layout_string(counts)}


def layout_string(counts: list[int]) -> str:
    """Megatron-Core's layout syntax: E embedding, t a transformer layer, | a stage boundary, L loss."""
    return "E" + "|".join("t" * n for n in counts) + "L"


@register
class NoopLayers(Feature):
    id = "noop-layers"
    category = "parallel"
    optimization_level = 0
    description = "layers that pass their input through (no parameters, no FLOPs): even out pipeline stages"
    flags = (Flag("--noop-layers", dict(default=None, help="comma-separated 0-based layer indices (of "
                                                         "--num-layers) that pass their input through")),)
    example = ("--num-layers", "2", "--noop-layers", "1")

    def enabled(self, args) -> bool:
        return args.noop_layers is not None

    def validate(self, args) -> None:
        indices = _int_list("--noop-layers", args.noop_layers)
        layers = args.num_layers
        if len(set(indices)) != len(indices):
            raise FeatureConfigError(f"--noop-layers {args.noop_layers} names a layer twice")
        if layers is not None and max(indices) >= layers:
            raise FeatureConfigError(f"--noop-layers {args.noop_layers}: each index must be below "
                                     f"--num-layers {layers} (0-based)")

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            from mindspeed.features.parallel import noop_hook  # imports Megatron-Core: features stay framework-free
            noop_hook.install(ctx.patcher, noop_layer_set(args))


@register
class UnevenPipelineLayers(Feature):
    id = "uneven-pipeline-layers"
    category = "parallel"
    optimization_level = 0
    description = "a given number of layers on each pipeline stage (Megatron's uneven stages or pipeline layout)"
    flags = (Flag("--num-layer-list", dict(default=None, help="comma-separated layers per pipeline stage, "
                                                            "e.g. 1,3 (sums to --num-layers)")),)
    requires = (Cap.SEND_RECV, Cap.PIPELINE_PARALLEL)
    alternatives = "leave out --num-layer-list (even stages)"
    example = ("--num-layers", "3", "--pipeline-model-parallel-size", "2", "--num-layer-list", "1,2")
    example_world = 2

    def enabled(self, args) -> bool:
        return args.num_layer_list is not None

    def validate(self, args) -> None:
        counts = _int_list("--num-layer-list", args.num_layer_list)
        pp = args.pipeline_model_parallel_size or 1
        layers = args.num_layers
        if len(counts) != pp:
            raise FeatureConfigError(f"--num-layer-list {args.num_layer_list} has {len(counts)} entries but "
                                     f"--pipeline-model-parallel-size is {pp}: give one per stage")
        if min(counts) < 1:
            raise FeatureConfigError(f"--num-layer-list {args.num_layer_list}: every stage needs at least one layer")
        if layers is not None and sum(counts) != layers:
            raise FeatureConfigError(f"--num-layer-list {args.num_layer_list} sums to {sum(counts)}, "
                                     f"not --num-layers {layers}")
        ours = self.host_values(args)
        # Megatron-LM's own args before its checks (megatron_lm.py): the layout flag only from core_v0.13 on
        others = [name for name, dest in CONFLICTING if getattr(args, dest, None) not in (None, ours.get(dest))]
        if others:     # (equal to ours: set by the Megatron-LM hook before Megatron's checks)
            raise FeatureConfigError(f"--num-layer-list sets each stage's layers: leave out {', '.join(others)}")

    # Megatron-LM's validate_args checks --num-layers against the pipeline size: the layout must
    # be in its args before that check (megatron_lm.py sets it there)
    before_host_checks = True

    def host_values(self, args) -> dict:
        return host_split(layer_list(args))
