"""The two ways of writing which layers each pipeline and virtual pipeline stage holds, read without
a framework (the support matrix and `python -m mindspeed check` run torch-free):

* upstream MindSpeed's --pipeline-num-transformer-layers matrix, "[[1,2],[3,2]]": one row per
  pipeline rank, one column per virtual stage of that rank; "[1,1]*4" repeats a row;
* Megatron-Core's --pipeline-model-parallel-layout string, "E|t|tt|tL": the virtual stages in the
  order Megatron runs them (virtual stage v of rank r is stage v x PP + r), E the embedding, t a
  transformer layer, m an MTP layer, L the loss; "(...)*n" and "x*n" repeat, commas are cosmetic.

The matrix becomes that string (matrix_layout), which Megatron-Core's PipelineParallelLayerLayout
builds from: no partitioner of MindSpeed's own.
"""
from __future__ import annotations

import re

LAYER_CHARS = "EtmL"


class LayoutSyntaxError(ValueError):
    """The text is not a matrix / layout string (the caller names the flag)."""


def parse_matrix(text: str) -> list[list[int]]:
    """Upstream's nested list: rows of non-negative layer counts; `[..]*n` repeats a row."""
    compact = re.sub(r"\s+", "", str(text))
    if not re.fullmatch(r"\[(\[\d+(,\d+)*\](\*\d+)?)(,\[\d+(,\d+)*\](\*\d+)?)*\]", compact):
        raise LayoutSyntaxError(compact)
    rows = []
    for row, times in re.findall(r"\[([\d,]+)\](?:\*(\d+))?", compact[1:-1]):
        rows.extend([[int(n) for n in row.split(",")]] * int(times or 1))
    return rows


def matrix_layout(rows: list[list[int]], mtp_layers: int = 0) -> str:
    """Megatron-Core's layout string for a matrix: the embedding before the first virtual stage,
    the MTP layers and the loss after the last, as Megatron-Core's uniform split places them."""
    pp, vpp = len(rows), len(rows[0])
    stages = ["t" * rows[r][v] for v in range(vpp) for r in range(pp)]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_layers + "L"
    return "|".join(stages)


def layout_stages(text: str) -> list[str]:
    """The virtual stages of a layout string, repetitions unrolled, in Megatron's order. The same
    reading as Megatron-Core's PipelineParallelLayerLayout.parse_str_to_list (tested against it),
    which cannot be imported without torch."""
    unrolled = str(text).replace(",", "")
    unrolled = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), unrolled)
    unrolled = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), unrolled)
    stages = unrolled.split("|")
    if any(c not in LAYER_CHARS for stage in stages for c in stage):
        raise LayoutSyntaxError(text)
    return stages


def stage_matrix(stages: list[str], pp: int) -> list[list[int]]:
    """Transformer layers per [pipeline rank][virtual stage] of a layout's stages."""
    vpp = len(stages) // pp
    return [[stages[v * pp + r].count("t") for v in range(vpp)] for r in range(pp)]
