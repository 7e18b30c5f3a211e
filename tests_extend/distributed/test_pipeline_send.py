"""A pipeline stage's output reaches the next stage intact on CPU/gloo although Megatron frees it right
after posting the send, as its interleaved schedule does (overlapped p2p: the sends are waited on later).

gloo reads a send buffer from its own thread after isend returns; a message larger than the socket
buffers is still being read when the receiver posts its receive late. Before MindSpeed gave each send
a buffer of its own, the memory freed by deallocate_output_tensor was reused and the receiver got
part garbage (here the sender dies instead: a 16 MiB block goes back to the system, and gloo reads
unmapped memory): Megatron-LM's pretrain_gpt.py with PP=2 and a virtual pipeline trained to different
losses on each run, and to NaN on a loaded CI machine.
"""
import time

from tests_extend.distributed.harness import run_distributed

ELEMENTS = 4 << 20          # 16 MiB of fp32: far more than the socket buffers hold


def _send_then_free(rank, world_size):
    import torch

    import mindspeed
    mindspeed.adapt([])
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor
    from tests_extend import megatron_tiny
    megatron_tiny.init_parallel(pp=2)
    group = ps.get_pipeline_model_parallel_group()
    peer = 1 - rank
    sends = dict(tensor_send_prev=None, tensor_recv_next=None, group=group,
                 prev_pipeline_rank=peer, next_pipeline_rank=peer)
    if rank == 0:
        output = torch.full((ELEMENTS,), 1.0)
        requests = p2p._p2p_ops(tensor_send_next=output, tensor_recv_prev=None, **sends)
        deallocate_output_tensor(output, deallocate_pipeline_outputs=True)
        reused = [torch.full((ELEMENTS,), float("nan")) for _ in range(4)]   # the freed memory is taken again
        for request in requests.values():
            request.wait()
        return len(reused)
    time.sleep(1.0)         # the sender has freed its output before this receive is posted
    received = torch.empty(ELEMENTS)
    requests = p2p._p2p_ops(tensor_send_next=None, tensor_recv_prev=received, **sends)
    for request in requests.values():
        request.wait()
    return int((received != 1.0).sum())


def test_a_freed_pipeline_output_arrives_intact():
    _, wrong = run_distributed(_send_then_free, world_size=2, timeout=180)
    assert wrong == 0, f"{wrong} of {ELEMENTS} received values are not what the stage sent"
