"""--schedules-method dualpipev with --moe-fb-overlap on the torch trainer: PP 2 x EP 2 (4 gloo
processes, one spawn for every run), fp32, no dropout, 4 MoE layers and an MTP layer (DeepSeek-V3's
combination), 3 micro-batches a step (the V's fewest at PP 2).

* 20 steps give plain DualPipeV's losses bit for bit: each chunk holds one layer, so no tensor is read
  across two of the combined step's node boundaries inside a chunk (where that happens the gradient
  sums run in another order: 1e-5 relative in tests_extend/distributed/test_moe_fb_overlap.py);
* the overlap really ran in the V's F-B slots: the all-to-all nodes on the side stream's worker
  thread, every MoE layer's dispatch and combine (the MTP layer's too), forward and backward, every
  micro-batch and step,
  and part of their time under the host thread's compute; the program each rank ran is
  schedule_sim.fb_overlapped of DualPipeV's (its F/B order; Pairs where a forward meets another
  micro-batch's backward).
* the MTP block is on rank 0's chunk 1 only, its copy of the word embeddings still chunk 0's after training.
The programs' pairing for other sizes: tests_extend/unit/test_dualpipev_schedule.py. DualPipeV with MTP
against PP 1: tests_extend/distributed/test_dualpipev_mtp.py.
"""
import os

import pytest

from tests_extend.distributed.harness import next_rendezvous, run_distributed
from tests_extend.distributed.test_moe_fb_overlap import COMM_NODES
from tests_extend.distributed.test_pipeline_layers import _losses

STEPS = 20
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "6",
        "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--lr", "3e-3", "--mock-data",
        "--seed", "7", "--num-experts", "4", "--moe-token-dispatcher-type", "alltoall",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(STEPS),
        "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
        "--untie-embeddings-and-output-weights", "--schedules-method", "dualpipev", "--mtp-num-layers", "1",
        "--position-embedding-type", "rope"]
ON = ["--moe-fb-overlap"]


def _train(rank, tmp, name, flags):
    import torch

    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training import pretrain, dualpipev
    from tests_extend.distributed.test_dualpipev_mtp import _copies_equal, _probe
    torch.set_num_threads(1)
    loss_file = os.path.join(tmp, name + ".jsonl")
    next_rendezvous(rank, loss_file + ".port")
    args = parse_args(TINY + flags + ["--log-loss-file", loss_file])
    session = mindspeed.adapt(args)
    side = session.backend.device.side_stream()
    side.recording, side.intervals[:] = True, []
    programs, original, build, seen = [], dualpipev.fb_overlapped, pretrain.Trainer._build_model, {}
    dualpipev.fb_overlapped = lambda program: programs.append(original(program)) or programs[-1]
    pretrain.Trainer._build_model = lambda self: _probe(build(self), seen)
    try:
        pretrain.run(args, session)
    finally:
        dualpipev.fb_overlapped, pretrain.Trainer._build_model = original, build
        mindspeed.unadapt()
        side.recording = False
    from mindspeed.backends.torch.side_stream import hidden_seconds
    comm = [i for i in side.intervals if i[0] in COMM_NODES]
    return {"losses": _losses(loss_file) if rank == 0 else None, "comm": sorted({i[0] for i in comm}),
            "comm_count": len(comm), "hidden": hidden_seconds(side.intervals, COMM_NODES),
            "comm_seconds": sum(i[2] - i[1] for i in comm), "programs": programs, "mtp": seen["mtp"],
            "copies_equal": _copies_equal(seen["model"])}


def _all_runs(rank, world_size, tmp):
    import time
    runs = {"v": _train(rank, tmp, "v", []), "v-fb": _train(rank, tmp, "v-fb", ON)}
    return dict(runs, cpu_seconds=time.process_time())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_all_runs, world_size=4, args=(str(tmp_path_factory.mktemp("v_fb")),), timeout=500)


def test_the_v_with_fb_overlap_trains_with_the_plain_vs_losses(runs):
    print("CPU seconds per rank:", [round(r["cpu_seconds"], 1) for r in runs])
    fb, plain = runs[0]["v-fb"]["losses"], runs[0]["v"]["losses"]
    assert len(fb) == len(plain) == STEPS
    assert fb == plain
    assert plain[0] != plain[-1]


def test_the_all_to_alls_ran_on_the_side_stream_in_the_vs_slots(runs):
    from mindspeed.features.parallel.dualpipev_schedule import dualpipev_order
    from mindspeed.features.parallel.schedule_sim import Pair, fb_overlapped, v_layout, with_transfers
    for rank in range(4):
        fb, pp_rank = runs[rank]["v-fb"], rank // 2
        # 2 chunks of 1 layer (+ the MTP layer on rank 0), 3 micro-batches (6 / DP 2), dispatch and combine,
        # forward and backward
        layers = 3 if pp_rank == 0 else 2
        assert fb["comm"] == sorted(COMM_NODES) and fb["comm_count"] == STEPS * layers * 3 * 4
        assert fb["mtp"] == ([False, True] if pp_rank == 0 else [False, False])
        assert fb["copies_equal"] == (pp_rank == 0)
        assert 0 < fb["hidden"] <= fb["comm_seconds"]
        assert runs[rank]["v"]["comm_count"] == 0 and runs[rank]["v"]["programs"] == []
        expected = fb_overlapped(with_transfers(v_layout(2), pp_rank, dualpipev_order(2, 3, pp_rank)))
        assert fb["programs"] == [expected] * STEPS and any(isinstance(i, Pair) for i in expected)
