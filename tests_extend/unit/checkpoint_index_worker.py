"""Writes a real torch_dist checkpoint index with Megatron-Core's own writer, in one process:
python checkpoint_index_worker.py DIR (the test reads DIR/.metadata)."""
import os
import sys


def main(directory: str) -> None:
    import torch
    import mindspeed.megatron_adaptor  # noqa: F401  (the device shim: Megatron's save synchronizes "cuda")
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from mindspeed.net import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo")
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.randn(4, 3)),
             "b": ShardedTensor.from_rank_offsets("b", torch.zeros(3, dtype=torch.bfloat16))}
    dist_checkpointing.save(state, directory)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":      # Megatron's writer starts a multiprocessing manager (spawn)
    main(sys.argv[1])
