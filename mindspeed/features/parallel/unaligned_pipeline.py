"""Unaligned pipeline (feature 'unaligned-pipeline'): any number of transformer layers on each
pipeline and virtual pipeline stage, written as upstream MindSpeed's matrix
(--pipeline-num-transformer-layers "[[0,2],[1,1]]") or as Megatron-Core's own layout
(--pipeline-model-parallel-layout "E|t|tt|tL"); syntax in pipeline_layout.py.

Torch: the matrix becomes Megatron-Core's layout (TransformerConfig.pipeline_model_parallel_layout),
or, without virtual stages and with even middle stages, Megatron's uneven first/last stage flags,
which Megatron-LM core_v0.12 has too. MindSpore: GPTConfig.chunk_counts, the same split.
"""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, host_flag
from mindspeed.features.parallel.layers import LAYOUT, host_split, layer_list
from mindspeed.features.parallel.pipeline_layout import (LayoutSyntaxError, layout_stages, matrix_layout,
                                                          parse_matrix, stage_matrix)
from mindspeed.features.registry import register

MATRIX = "--pipeline-num-transformer-layers"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
# the host's other ways of setting the split or the virtual stages
OTHER_SPLITS = (("--num-layer-list", "num_layer_list"),
                ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
                ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers"),
                ("--num-virtual-stages-per-pipeline-rank", "num_virtual_stages_per_pipeline_rank"))
VPP_PER_STAGE = ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage")


def layer_matrix(args) -> list[list[int]] | None:
    """Transformer layers per [pipeline rank][virtual stage] the run's flags give, or None. (Read by
    both trainers; the flags were validated.)"""
    pp = args.pipeline_model_parallel_size or 1
    if args.pipeline_num_transformer_layers:
        return parse_matrix(args.pipeline_num_transformer_layers)
    if args.pipeline_model_parallel_layout:
        return stage_matrix(layout_stages(args.pipeline_model_parallel_layout), pp)
    return None


def _layer_list_layout(args) -> str | None:
    """The layout --num-layer-list sets in the host's args (its own feature's, not a typed one)."""
    try:
        counts = layer_list(args)
    except FeatureConfigError:
        return None             # the uneven-pipeline-layers feature refuses it
    return host_split(counts).get(LAYOUT) if counts else None


@register
class UnalignedPipeline(Feature):
    id = "unaligned-pipeline"
    category = "parallel"
    optimization_level = 0
    description = "layers per pipeline and virtual pipeline stage as a matrix (Megatron-Core's pipeline layout)"
    flags = (Flag(MATRIX, dict(default=None, help="transformer layers per pipeline rank (rows) and virtual stage "
                                                 "(columns), e.g. [[0,2],[1,1]] or [[1],[2]*2,[1]]; sums to "
                                                 "--num-layers")),
             host_flag(LAYOUT_FLAG))
    requires = (Cap.SEND_RECV, Cap.PIPELINE_PARALLEL)
    alternatives = "leave out the matrix: even stages, or --num-layer-list for one number per stage"
    example = ("--num-layers", "4", "--pipeline-model-parallel-size", "2", MATRIX, "[[0,2],[1,1]]",
               "--untie-embeddings-and-output-weights", "--global-batch-size", "4", "--micro-batch-size", "1")
    example_world = 2
    before_host_checks = True      # Megatron-LM's validate_args derives its virtual stages from the layout
    inert_example = ("--num-layers", "4", MATRIX, "[[4]]")

    def enabled(self, args) -> bool:
        layout = getattr(args, LAYOUT, None)
        return bool(args.pipeline_num_transformer_layers) or (
            bool(layout) and layout != _layer_list_layout(args))

    def inert(self, args) -> str:
        rows = self._matrix_or_none(args)
        if rows is not None and len(rows) == 1 and len(rows[0]) == 1 and rows[0][0] == args.num_layers:
            return "at --pipeline-model-parallel-size 1 one stage holds every layer"
        return ""

    def _matrix_or_none(self, args):
        try:
            return layer_matrix(args)
        except LayoutSyntaxError:
            return None

    def validate(self, args) -> None:
        rows = self._rows(args)
        self._check_shape(args, rows)
        ours = self.host_values(args)
        given = [name for name, dest in OTHER_SPLITS if getattr(args, dest, None) not in (None, ours.get(dest))]
        if self._matrix_given(args) and getattr(args, LAYOUT, None) not in (None, ours.get(LAYOUT)):
            given.append(LAYOUT_FLAG)
        if given:
            raise FeatureConfigError(f"{self.trigger(args)} sets each stage's layers: leave out {', '.join(given)}")
        self._check_virtual_flag(args, len(rows), len(rows[0]))
        if not self._matrix_given(args):
            self._check_layout_places(args)

    def _check_shape(self, args, rows) -> None:
        pp = args.pipeline_model_parallel_size or 1
        if len(rows) != pp:
            raise FeatureConfigError(f"{self.trigger(args)} has {len(rows)} pipeline stage(s) but "
                                     f"--pipeline-model-parallel-size is {pp}: give one row per stage")
        vpp = len(rows[0])
        if any(len(row) != vpp for row in rows):
            raise FeatureConfigError(f"{self.trigger(args)}: every pipeline stage needs the same number of "
                                     f"virtual stages (columns), got {[len(row) for row in rows]}")
        total = sum(map(sum, rows))
        if args.num_layers is not None and total != args.num_layers:
            raise FeatureConfigError(f"{self.trigger(args)} holds {total} transformer layers, not --num-layers "
                                     f"{args.num_layers}")
        if vpp > 1 and pp < 2:
            raise FeatureConfigError(f"{self.trigger(args)}: virtual stages need --pipeline-model-parallel-size >= 2")

    def _matrix_given(self, args) -> bool:
        return bool(args.pipeline_num_transformer_layers)

    def _rows(self, args) -> list[list[int]]:
        try:
            if not self._matrix_given(args):
                stages, pp = layout_stages(args.pipeline_model_parallel_layout), args.pipeline_model_parallel_size or 1
                if len(stages) % pp:
                    raise FeatureConfigError(f"{LAYOUT_FLAG} {args.pipeline_model_parallel_layout} has {len(stages)} "
                                             f"stages, not a multiple of --pipeline-model-parallel-size {pp}")
            return layer_matrix(args)
        except LayoutSyntaxError:
            if self._matrix_given(args):
                raise FeatureConfigError(f"{MATRIX} takes one row of non-negative layer counts per pipeline stage, "
                                         f"one count per virtual stage, e.g. [[0,2],[1,1]] or [[1],[2]*2,[1]]; got "
                                         f"{args.pipeline_num_transformer_layers!r}") from None
            raise FeatureConfigError(f"{LAYOUT_FLAG} takes stages separated by | made of E (embedding), t "
                                     f"(transformer layer), m (MTP layer), L (loss), e.g. E|t|tt|tL; got "
                                     f"{args.pipeline_model_parallel_layout!r}") from None

    def _check_virtual_flag(self, args, pp: int, vpp: int) -> None:
        """Upstream's scripts give --num-layers-per-virtual-pipeline-stage with the matrix: accepted
        where it means the matrix's virtual stages (Megatron then takes them from the layout)."""
        per_stage = getattr(args, VPP_PER_STAGE[1], None)
        if per_stage is None:
            return
        if not self._matrix_given(args):      # Megatron-LM refuses the two together
            raise FeatureConfigError(f"{self.trigger(args)} sets the virtual stages: leave out {VPP_PER_STAGE[0]}")
        implied = args.num_layers // pp // per_stage if per_stage else 0
        if implied != vpp:
            raise FeatureConfigError(f"{self.trigger(args)} has {vpp} virtual stage(s) per pipeline stage but "
                                     f"{VPP_PER_STAGE[0]} {per_stage} gives {implied}: leave it out")

    def _check_layout_places(self, args) -> None:
        """What Megatron-Core's layout check asserts, in one line before any work."""
        flat = "|".join(layout_stages(args.pipeline_model_parallel_layout))
        mtp = getattr(args, "mtp_num_layers", None) or 0
        problems = []
        if flat.count("E") != 1 or not flat.startswith("E"):
            problems.append("the embedding E once, first")
        if flat.count("L") != 1 or not flat.endswith("L"):
            problems.append("the loss L once, last")
        if flat.count("m") != mtp:
            problems.append(f"{mtp} MTP layer(s) m (--mtp-num-layers)")
        if "m" in flat and "t" in flat[flat.index("m"):]:
            problems.append("the MTP layers after every transformer layer")
        stages, pp = layout_stages(args.pipeline_model_parallel_layout), args.pipeline_model_parallel_size or 1
        with_mtp = [s for s, stage in enumerate(stages) if "m" in stage]
        if len(with_mtp) > 1 or any(s // pp != len(stages) // pp - 1 for s in with_mtp):
            problems.append("the MTP layers together in one last virtual stage of a pipeline stage "
                            "(Megatron-Core's rule)")
        if problems:
            raise FeatureConfigError(f"{LAYOUT_FLAG} {args.pipeline_model_parallel_layout} needs "
                                     f"{'; '.join(problems)}")

    def host_values(self, args) -> dict:
        """The matrix in Megatron's terms; a layout given as Megatron's own flag is the host's already."""
        if not self._matrix_given(args):
            return {}
        rows = parse_matrix(args.pipeline_num_transformer_layers)
        if len(rows[0]) == 1 and min(r[0] for r in rows) >= 1 and LAYOUT not in host_split([r[0] for r in rows]):
            return host_split([r[0] for r in rows])     # core_v0.12's uneven first/last stages serve it
        return {LAYOUT: matrix_layout(rows, getattr(args, "mtp_num_layers", None) or 0), VPP_PER_STAGE[1]: None}
