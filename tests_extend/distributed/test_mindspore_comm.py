"""The mindspore backend's collectives in a real 2-process msrun job: native ones and those built
from AllReduce on CPU (reduce_scatter, all_to_all, max/min, sub-group all_gather/broadcast,
send_recv), plus the gradients of the differentiable variants."""
import os

import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed.msrun_helper import run_msrun  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mindspore_comm_worker.py")
EXPECTED = {"all_reduce_sum", "all_reduce_avg", "all_reduce_max", "all_reduce_min", "all_gather_dim0",
            "all_gather_dim1", "reduce_scatter_dim0", "reduce_scatter_dim1", "all_to_all_0_1", "all_to_all_1_0",
            "send_recv_ring", "broadcast_world", "group_of_one_all_gather", "group_of_one_all_reduce",
            "subgroup_all_gather", "subgroup_broadcast", "subgroup_all_to_all", "grad_all_gather",
            "grad_reduce_scatter", "grad_all_to_all", "grad_copy_to_region_sums", "grad_reduce_from_region_identity"}


def test_collectives_two_processes(tmp_path):
    results = run_msrun(WORKER, [str(tmp_path)], str(tmp_path), workers=2, timeout=240)
    for rank, res in enumerate(results):
        assert res["ok"], f"rank {rank}:\n{res.get('error')}"
        assert res["world"] == 2
        assert set(res["checks"]) == EXPECTED
