"""The MindSpore trainer's hook of --use-ascend-coc: its GPT's column- and row-parallel linears
(training/mindspore/layers.py) run through features/parallel/coc.py, as Megatron-Core's do on
torch (coc_megatron.py). The algorithm's collectives are MsComm's *_async."""
from __future__ import annotations

from mindspeed.features.parallel.coc import Coc

#: calls that went through CoC, by layer kind (read by the parity test: the path was taken)
CALLS = {"column": 0, "row": 0}


class CocLinears:
    """What ParallelState.tp_linear holds: y = the layer's GEMM and collective, without bias (CoC over
    the run's backend)."""

    def __init__(self, backend, chunks: int):
        self.coc, self.chunks = Coc(backend), chunks

    def column(self, x, weight, group, sequence_parallel: bool):
        CALLS["column"] += 1
        return self.coc.column_linear(x, weight, group, sequence_parallel=sequence_parallel, chunks=self.chunks)

    def row(self, x, weight, group, sequence_parallel: bool):
        CALLS["row"] += 1
        return self.coc.row_linear(x, weight, group, sequence_parallel=sequence_parallel, chunks=self.chunks)
