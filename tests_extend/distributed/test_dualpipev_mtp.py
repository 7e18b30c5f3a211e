"""--schedules-method dualpipev with --mtp-num-layers 1 on the torch trainer against PP 1, PP 2 (2
processes, one spawn for every run), fp32, no dropout, rotary positions (the MTP block's copy of the
embeddings then holds only the word embeddings, the copy Megatron ties). A second 20-step parity, so
MINDSPEED_SLOW_TESTS=1 runs it (CI's share: the MTP block's place and its embedding copy are checked in
tests_extend/distributed/test_dualpipev_fb_overlap.py's launch, DualPipeV with MTP and --moe-fb-overlap).

* the MTP block sits where upstream puts it, on the V's last stage (rank 0's chunk 1, beside the
  output layer), and nowhere else;
* from one checkpoint (PP 1 with MTP, one step, loaded with --finetune: the same weights, a fresh
  optimizer) the V with MTP trains 20 steps with PP 1's losses within 1e-5 relative (PP 1 runs at
  DP 2 here: its gradients are summed over the two ranks, the V's micro-batch by micro-batch);
* the MTP block's copy of the word embeddings is chunk 0's when built and still, bit for bit, after
  20 steps (their gradients summed on the rank, as Megatron's embedding-group all-reduce sums them).
"""
import os

import pytest

from tests_extend.distributed import test_pipeline_layers as pipeline_layers
from tests_extend.distributed.harness import run_distributed
from tests_extend.distributed.test_pipeline_layers import _relative

STEPS = 20
MTP = ["--hidden-dropout", "0", "--attention-dropout", "0", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights", "--mtp-num-layers", "1"]
V = ["--pipeline-model-parallel-size", "2", "--schedules-method", "dualpipev"]
TOLERANCE = 1e-5


def _probe(model, seen):
    seen["mtp"] = [chunk.module.mtp_process for chunk in model]
    seen["model"] = model
    seen["copies_equal_when_built"] = _copies_equal(model)     # before the checkpoint loads into both
    return model


def _copies_equal(model) -> bool:
    copies = [chunk.module.embedding.word_embeddings.weight for chunk in model if hasattr(chunk.module, "embedding")]
    return len(copies) == 2 and bool((copies[0] == copies[1]).all())


def _train(rank, tmp, name, flags):
    """test_pipeline_layers' run (its TINY: the same sizes, seed and data) with MTP, and what the probe saw."""
    losses, seen = pipeline_layers._train(rank, tmp, name, MTP + flags, _probe)
    seen["copies_equal"] = _copies_equal(seen.pop("model"))
    return {"losses": losses, "seen": seen}


def _all_runs(rank, world_size, tmp):
    init = os.path.join(tmp, "init")
    _train(rank, tmp, "init", ["--train-iters", "1", "--save", init])
    start = ["--train-iters", str(STEPS), "--load", init, "--finetune"]
    import time
    runs = {"pp1": _train(rank, tmp, "pp1", start), "v": _train(rank, tmp, "v", start + V)}
    return dict(runs, cpu_seconds=time.process_time())      # this rank's CPU, imports included (CI budget)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not os.environ.get("MINDSPEED_SLOW_TESTS"):
        pytest.skip("a second 20-step parity (2 processes, ~15 CPU-s): MINDSPEED_SLOW_TESTS=1")
    return run_distributed(_all_runs, world_size=2, args=(str(tmp_path_factory.mktemp("v_mtp")),), timeout=400,
                           daemon=False)    # checkpoint saves start a helper process


def test_the_mtp_block_is_on_the_vs_last_stage(runs):
    assert runs[0]["v"]["seen"]["mtp"] == [False, True] and runs[1]["v"]["seen"]["mtp"] == [False, False]
    assert runs[0]["v"]["seen"]["copies_equal_when_built"] and runs[0]["v"]["seen"]["copies_equal"]


def test_the_v_with_mtp_trains_with_pp1s_losses(runs):
    print("CPU seconds per rank:", [round(r["cpu_seconds"], 1) for r in runs])
    v, pp1 = runs[0]["v"]["losses"], runs[0]["pp1"]["losses"]
    assert len(v) == len(pp1) == STEPS
    print("relative difference", _relative(v, pp1))
    assert _relative(v, pp1) <= TOLERANCE, (v, pp1)
    assert pp1[0] != pp1[-1]
