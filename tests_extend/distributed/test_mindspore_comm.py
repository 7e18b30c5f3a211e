"""The mindspore backend's collectives in a real 4-process msrun job: native ones and those built
from AllReduce on CPU (reduce_scatter, all_to_all, max/min, sub-group all_gather/broadcast,
send_recv), their async variants, plus the gradients of the differentiable variants (the tensor-parallel
ones in PyNative and inside a traced graph), on the world group and on real
sub-groups: pairs {0,1},{2,3} and strided pairs {0,2},{1,3}, where a process's group rank differs
from its world rank (a mix-up of the two passes on 2 processes, not here). Run over both CPU
transports: shared memory and MindSpore's MCCL."""
import os

import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed.msrun_helper import run_msrun  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mindspore_comm_worker.py")
PER_GROUP = {"all_reduce_sum", "all_reduce_avg", "all_reduce_max", "all_reduce_min", "all_gather_dim0",
             "all_gather_dim1", "reduce_scatter_dim0", "reduce_scatter_dim1", "all_to_all_0_1", "all_to_all_1_0",
             "send_recv_ring", "broadcast", "grad_all_gather", "grad_reduce_scatter", "grad_all_to_all",
             "grad_copy_to_region_sums", "grad_reduce_from_region_identity", "traced_grad_all_gather",
             "traced_grad_reduce_scatter", "traced_grad_copy_to_region_sums",
             "traced_grad_reduce_from_region_identity", "traced_reduce_from_region_value", "all_reduce_async",
             "all_gather_async_dim0", "all_gather_async_dim1", "reduce_scatter_async_dim0",
             "reduce_scatter_async_dim1", "async_input_unchanged"}
EXPECTED = ({f"{tag}/{check}" for tag in ("world", "pairs", "strided") for check in PER_GROUP}
            | {"group_of_one/all_gather", "group_of_one/all_reduce"})


@pytest.mark.parametrize("transport", ["shared_memory", "mccl"])
def test_collectives_on_the_world_and_on_real_subgroups(tmp_path, monkeypatch, transport):
    """Both CPU transports: shared memory (the default on one x86-64 host) and MindSpore's MCCL
    (MINDSPEED_MS_SHM_COLLECTIVES=0, what other hosts get)."""
    if transport == "mccl":
        monkeypatch.setenv("MINDSPEED_MS_SHM_COLLECTIVES", "0")
    results = run_msrun(WORKER, [str(tmp_path)], str(tmp_path), workers=4, timeout=300)
    for rank, res in enumerate(results):
        assert res["ok"], f"rank {rank}:\n{res.get('error')}"
        assert res["world"] == 4
        assert set(res["checks"]) == EXPECTED
        mine = {"pairs": "0_1" if rank < 2 else "2_3", "strided": "0_2" if rank % 2 == 0 else "1_3"}
        want = ["mccl_world_group"] + sorted(f"mindspeed_g_{ranks}" for ranks in mine.values())
        assert res["shm_groups"] == (sorted(want) if transport == "shared_memory" else []), res["shm_groups"]
        assert res["shm_files_left"] == []          # names removed once every member mapped them
