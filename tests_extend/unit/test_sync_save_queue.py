"""A synchronous dist-checkpoint save hands its write results back in-process: Megatron-Core's
spawned Manager process (which imports torch to relay them) is never started for it, the
checkpoint loads back the same, and asynchronous saves keep Megatron's queue
(mindspeed/backends/torch/sync_save_queue.py)."""
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async

import mindspeed


def test_a_synchronous_save_starts_no_manager_and_loads_back(tmp_path, monkeypatch):
    megatron_queue = filesystem_async._get_write_results_queue
    monkeypatch.setattr(filesystem_async, "_results_queue", None)   # whatever an earlier test started
    mindspeed.adapt([])
    try:
        dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
        weight = torch.arange(12.0).reshape(3, 4)
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight)}, str(tmp_path))
        assert filesystem_async._results_queue is None          # no Manager process was spawned
        assert filesystem_async._get_write_results_queue is megatron_queue   # async saves: Megatron's
        loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(3, 4))},
                                         str(tmp_path))
        assert torch.equal(loaded["w"], weight)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        mindspeed.unadapt()
