"""The same context-parallel test body as test_context_parallel.py, on the mindspore backend in
msrun jobs: output and q/k/v gradients equal single-process attention, causal and general masks,
with and without GQA, in fp32. 2 workers: every CP-2 algorithm. 4 workers: hybrid Ulysses 2 x
ring 2 (sub-groups {0,1},{2,3} and {0,2},{1,3}, collectives emulated from AllReduce on CPU) and
the double ring (inner rings of 2). (bf16 runs on torch only: MindSpore 2.10's CPU kernels reject
bfloat16, in collectives and in autograd, e.g. Tile.)"""
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
        errors = {k: v for k, v in res["errors"].items() if not k.endswith(("/arrangement", "/fused_merges"))}
        assert {k.split("/")[1] for k in errors} == labels and len(errors) == len(labels) * 4
        # MindSpore's CPU kernels are the reference ones, the fused merge's too: nothing to tell apart
        # (torch's CPU has its own fused merge: test_context_parallel.py counts its calls)
        merges = {k.split("/")[1]: v for k, v in res["errors"].items() if k.endswith("/fused_merges")}
        assert set(merges.values()) == {None} and "ring-fused" in merges, merges
        assert {k.split("/")[1]: v for k, v in res["errors"].items() if k.endswith("/arrangement")} == \
            cp_cases.ARRANGEMENTS[2]


FOUR_WORKER_LABELS = ("hybrid", "double-ring")


@pytest.mark.skipif(not os.environ.get("MINDSPEED_SLOW_TESTS"),
                    reason="4 msrun workers on 2 cores: ~75 s, over CI's 40-minute budget; MINDSPEED_SLOW_TESTS=1 runs it")
def test_cp4_hybrid_and_double_ring_match_single_process_on_mindspore(tmp_path):
    results = run_msrun(WORKER, [str(tmp_path), "float32", ",".join(FOUR_WORKER_LABELS)], str(tmp_path),
                        workers=4, timeout=500)
    for rank, res in enumerate(results):
        assert res["ok"], f"rank {rank}:\n{res.get('error')}"
        assert res["world"] == 4
        errors = {k: v for k, v in res["errors"].items() if not k.endswith(("/arrangement", "/fused_merges"))}
        assert {k.split("/")[1] for k in errors} == set(FOUR_WORKER_LABELS) and len(errors) == 2 * 4
        built = {k.split("/")[1]: v for k, v in res["errors"].items() if k.endswith("/arrangement")}
        assert built == {label: cp_cases.ARRANGEMENTS[4][label] for label in FOUR_WORKER_LABELS}
