"""The same context-parallel test body as test_context_parallel.py, on the mindspore backend in a
2-process msrun job: output and q/k/v gradients equal single-process attention for every
algorithm, causal and general masks, with and without GQA, in fp32. (bf16 runs on torch only:
MindSpore 2.10's CPU kernels reject bfloat16, in collectives and in autograd, e.g. Tile.)"""
import os

import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed import cp_cases  # noqa: E402
from tests_extend.distributed.msrun_helper import run_msrun  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cp_mindspore_worker.py")


def test_cp_attention_matches_single_process_on_mindspore(tmp_path):
    results = run_msrun(WORKER, [str(tmp_path), "float32"], str(tmp_path), workers=2, timeout=400)
    labels = {label for label, _, _ in cp_cases.cases_for(2)}
    for rank, res in enumerate(results):
        assert res["ok"], f"rank {rank}:\n{res.get('error')}"
        assert res["world"] == 2
        assert {k.split("/")[1] for k in res["errors"]} == labels and len(res["errors"]) == len(labels) * 4
