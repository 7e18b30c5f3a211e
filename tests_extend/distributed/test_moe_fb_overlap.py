"""--moe-fb-overlap on the torch trainer at EP 2 (2 gloo processes, one spawn for every run), fp32, no
dropout, 2 MoE layers, 2 micro-batches a step:

* 20 steps give the plain run's losses within 1e-5 relative (TOLERANCE says why not bitwise);
* the all-to-all nodes really ran on the side stream's worker thread, beside the other micro-batch's
  compute: every MoE layer's dispatch and combine, forward and backward, every step, and part of
  their time under the host thread's compute (recorded intervals); without the flag nothing ran there;
* with DeepSeek-V3's full recompute flags (RECOMPUTE) the overlap gives its own losses bit for bit, each
  layer's attention and experts computed again in the backward and no all-to-all run twice;
* unadapt() gives back every object the hook patched;
* the run's step-10 checkpoint resumes under the flag bit for bit, and loads without the flag
  (the plain schedule), training on within 1e-5.
The refusals: tests_extend/unit/test_moe_fb_overlap_flags.py. Interleaved PP (4 processes):
MINDSPEED_SLOW_TESTS=1 (test_interleaved_pipeline_gives_the_plain_losses below).
"""
import json
import os
import threading

import pytest

from tests_extend.distributed.harness import next_rendezvous, run_distributed
from tests_extend.distributed.test_pipeline_layers import _relative

STEPS = 20
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--lr", "3e-3", "--mock-data",
        "--seed", "7", "--num-experts", "4", "--moe-token-dispatcher-type", "alltoall",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        # DeepSeek-V3's router: what it counts per step (tokens per expert, the aux loss) a recompute must not
        # count twice
        "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid", "--norm-topk-prob",
        "--moe-aux-loss-coeff", "1e-2"]
EP2 = ["--expert-model-parallel-size", "2"]
ON = ["--moe-fb-overlap"]
# fp32: the combined schedule cuts each layer's autograd graph at the node boundaries, so a tensor read
# by two nodes (the residual stream) has its gradient summed in another order than one backward sums it
TOLERANCE = 1e-5
# MindSpeed-LLM's DeepSeek-V3 recipe's recompute flags (fb_overlap_recompute.py)
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
COMM_NODES = {f"moe_{kind}.{phase}" for kind in ("dispatch", "combine") for phase in ("forward", "backward")}


def _train(rank, tmp, name, flags, layout=EP2, base=TINY):
    import torch

    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training import pretrain
    torch.set_num_threads(1)
    loss_file = os.path.join(tmp, name + ".jsonl")
    next_rendezvous(rank, loss_file + ".port")
    args = parse_args(base + layout + flags + ["--log-loss-file", loss_file])
    originals = _patched_originals()
    session = mindspeed.adapt(args)
    side = session.backend.device.side_stream()
    side.recording, side.intervals[:] = True, []
    counted = _counting_forwards()
    try:
        pretrain.run(args, session)
    finally:
        counted.restore()
        mindspeed.unadapt()
        side.recording = False
    from mindspeed.backends.torch.side_stream import hidden_seconds
    comm = [i for i in side.intervals if i[0] in COMM_NODES]
    losses = [json.loads(line)["lm_loss"] for line in open(loss_file)] if rank == 0 else None
    return {"losses": losses, "restored": _patched_originals() == originals, "comm": sorted({i[0] for i in comm}), "comm_count": len(comm),
            "host_thread": threading.get_ident() in {i[3] for i in comm}, "hidden": hidden_seconds(side.intervals, COMM_NODES),
            "comm_seconds": sum(i[2] - i[1] for i in comm), "forwards": counted.calls,
            "tokens_per_step": counted.tokens}


class _counting_forwards:
    """How often the layers' attention and expert computations ran (forward and recomputed), and the
    tokens per expert each step's expert-bias update was given: the real functions, counted."""
    NAMES = ("_forward_attention", "routed_experts_compute")

    def __init__(self):
        import importlib
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.transformer_layer import TransformerLayer
        finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the package
        # exports a function of that name
        self.owners = dict(zip(self.NAMES + ("get_updated_expert_bias",), (TransformerLayer, MoELayer, finalize)))
        self.calls, self.tokens = dict.fromkeys(self.NAMES, 0), []
        for name, owner in self.owners.items():
            setattr(owner, name, self._counted(name, getattr(owner, name)))

    def _counted(self, name, function):
        def counted(*args, **kwargs):
            if name in self.calls:
                self.calls[name] += 1
            else:
                self.tokens.append(args[0].sum().item())
            return function(*args, **kwargs)
        counted.original = function
        return counted

    def restore(self):
        for name, owner in self.owners.items():
            setattr(owner, name, getattr(owner, name).original)


def _patched_originals():
    """What the hook patches (fb_overlap.install), as stored on their owners."""
    import torch
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerLayerSchedulePlan
    from megatron.core.pipeline_parallel.utils import ScheduleNode
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    return [ScheduleNode.__dict__["_forward"], ScheduleNode.__dict__["_backward"],
            TransformerLayerSchedulePlan.__dict__["run"], TransformerConfig.__dict__["__init__"],
            TransformerConfig.__dict__["__post_init__"], MLATransformerConfig.__dict__["__init__"],
            torch.Tensor.record_stream, torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop]


def _all_runs(rank, world_size, tmp):
    saved = os.path.join(tmp, "fb")
    steps = ["--train-iters", str(STEPS)]
    resume = steps + ["--load", saved, "--ckpt-step", str(STEPS // 2)]
    import time
    runs = {"plain": _train(rank, tmp, "plain", steps),
            "fb": _train(rank, tmp, "fb", steps + ON + ["--save", saved, "--save-interval", str(STEPS // 2)]),
            "fb-recompute": _train(rank, tmp, "fb-recompute", steps + ON + RECOMPUTE),
            "fb-resumed": _train(rank, tmp, "fb-resumed", resume + ON),
            "fb-to-plain": _train(rank, tmp, "fb-to-plain", resume)}
    return dict(runs, cpu_seconds=time.process_time())      # this rank's CPU, imports included (CI budget)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("fb_overlap"))
    return run_distributed(_all_runs, world_size=2, args=(tmp,), timeout=400,
                           daemon=False)    # checkpoint saves start a helper process


def test_fb_overlap_trains_with_the_plain_losses(runs):
    fb, plain = runs[0]["fb"]["losses"], runs[0]["plain"]["losses"]
    assert len(fb) == len(plain) == STEPS
    assert _relative(fb, plain) <= TOLERANCE, (fb, plain)
    assert plain[0] != plain[-1]        # it trained: equal losses say something


def test_all_to_alls_ran_on_the_side_stream_under_compute(runs):
    for rank in (0, 1):
        fb = runs[rank]["fb"]
        assert not fb["host_thread"] and fb["comm"] == sorted(COMM_NODES)
        # every step: 2 layers x 2 micro-batches (8 samples / 2 per micro-batch / DP 2) x (dispatch,
        # combine) x (forward, backward)
        assert fb["comm_count"] == STEPS * 2 * 2 * 4
        assert 0 < fb["hidden"] <= fb["comm_seconds"]
        assert runs[rank]["plain"]["comm_count"] == 0 and runs[rank]["plain"]["hidden"] == 0
        assert fb["restored"]        # unadapt() gave Megatron and torch their own objects back


def test_full_recompute_gives_the_overlap_losses_bit_for_bit(runs):
    # recomputation repeats each compute node's arithmetic: the same losses, not within a tolerance
    assert runs[0]["fb-recompute"]["losses"] == runs[0]["fb"]["losses"]
    for rank in (0, 1):      # the all-to-alls still ran on the side stream, once per node: none recomputed
        assert runs[rank]["fb-recompute"]["comm"] == sorted(COMM_NODES)
        assert runs[rank]["fb-recompute"]["comm_count"] == runs[rank]["fb"]["comm_count"]
        # every layer's attention and experts ran twice a micro-batch: forward, and again in the backward
        forwards = runs[rank]["fb"]["forwards"]
        assert forwards == dict.fromkeys(forwards, STEPS * 2 * 2)
        assert runs[rank]["fb-recompute"]["forwards"] == dict.fromkeys(forwards, 2 * STEPS * 2 * 2)
        # ... but the router counted each token once (the expert-bias update), as without recompute
        assert len(runs[rank]["fb"]["tokens_per_step"]) == STEPS
        assert runs[rank]["fb-recompute"]["tokens_per_step"] == runs[rank]["fb"]["tokens_per_step"]


def test_checkpoint_resumes_bit_for_bit_and_loads_without_the_flag(runs):
    print("CPU seconds per rank:", [round(r["cpu_seconds"], 1) for r in runs])
    fb = runs[0]["fb"]["losses"]
    assert runs[0]["fb-resumed"]["losses"] == fb[STEPS // 2:]
    to_plain = runs[0]["fb-to-plain"]["losses"]
    assert len(to_plain) == STEPS // 2 and _relative(to_plain, fb[STEPS // 2:]) <= TOLERANCE


def _interleaved(rank, world_size, tmp):
    layout = ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "4"]
    steps = ["--train-iters", str(STEPS)]
    return {"plain": _train(rank, tmp, "pp-plain", steps, layout), "fb": _train(rank, tmp, "pp-fb", steps + ON, layout)}


@pytest.mark.skipif(os.environ.get("MINDSPEED_SLOW_TESTS") != "1", reason="4 processes: MINDSPEED_SLOW_TESTS=1")
def test_interleaved_pipeline_gives_the_plain_losses(tmp_path):
    runs = run_distributed(_interleaved, world_size=4, args=(str(tmp_path),), timeout=600)
    fb, plain = runs[0]["fb"]["losses"], runs[0]["plain"]["losses"]
    assert len(fb) == len(plain) == STEPS and _relative(fb, plain) <= TOLERANCE, (fb, plain)
    assert all(runs[r]["fb"]["comm_count"] > 0 for r in range(4))
