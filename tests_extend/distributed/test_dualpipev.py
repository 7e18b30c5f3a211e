"""--schedules-method dualpipev on the torch trainer, PP 2 (2 processes, one spawn for every run).

fp32, no dropout; three runs (CI time): the V trains 30 steps and saves at step 10; from that checkpoint
* the V resumes bit for bit;
* plain PP 2 (Megatron's 1F1B) loads it (torch_dist resharding by the global layer numbers) and its 20
  steps give the V's losses within 1e-5 relative, and the same validation loss at the end (the V's
  forward-only program);
* the V is built: rank 0 holds layers 1 and 4 (the embedding with the first, the output layer with
  the last), rank 1 layers 2 and 3.
Every V run defers weight gradients (phase 3: rank 0's B1-W-F1 at PP 2), so the deferred path is in it;
the run with --dualpipev-dw-detach (the cool-down's too) is in the slow set (MINDSPEED_SLOW_TESTS=1: one
more 20-step run from the checkpoint).
The schedule's order itself is tested without processes in tests_extend/unit/test_dualpipev_schedule.py.
"""
import os

import pytest

from tests_extend.distributed.harness import next_rendezvous, run_distributed
from tests_extend.distributed.test_pipeline_layers import TINY, _chunk_probe, _losses

SLOW = bool(os.environ.get("MINDSPEED_SLOW_TESTS"))

PP2 = ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]
V = ["--schedules-method", "dualpipev"]
STEPS = 20          # compared after the checkpoint
SAVED = 10
EVAL = ["--eval-iters", "1", "--eval-interval", "1000"]
TOLERANCE = 1e-5    # fp32; the V sums each parameter's gradients in the same micro-batch order, the grad
                    # norm's partial sums are grouped by rank differently


def _train(rank, tmp, name, flags, inspect=None):
    import mindspeed
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    loss_file = os.path.join(tmp, name + ".jsonl")
    next_rendezvous(rank, loss_file + ".port")
    args = parse_args(TINY + PP2 + flags + ["--log-loss-file", loss_file])
    session = mindspeed.adapt(args)
    seen, original = {}, pretrain.Trainer._build_model
    if inspect is not None:
        pretrain.Trainer._build_model = lambda self: inspect(original(self), seen)
    try:
        summary = pretrain.run(args, session)
    finally:
        pretrain.Trainer._build_model = original
        mindspeed.unadapt()
    return {"losses": _losses(loss_file) if rank == 0 else None, "seen": seen,
            "valid": summary.get("final_valid_loss")}


def _all_runs(rank, world_size, tmp):
    saved = os.path.join(tmp, "v")
    total = ["--train-iters", str(SAVED + STEPS)] + EVAL
    resume = total + ["--load", saved, "--ckpt-step", str(SAVED)]
    out = {"v": _train(rank, tmp, "v", total + V + ["--save", saved, "--save-interval", str(SAVED)], _chunk_probe),
           "v-resumed": _train(rank, tmp, "v-resumed", resume + V),
           "plain": _train(rank, tmp, "plain", resume)}
    if SLOW:
        out["v-detach"] = _train(rank, tmp, "v-detach", resume + V + ["--dualpipev-dw-detach"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dualpipev"))
    return run_distributed(_all_runs, world_size=2, args=(tmp,), timeout=400,
                           daemon=False)    # checkpoint saves start a helper process


def _relative(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_the_v_puts_both_ends_on_rank_0(runs):
    assert runs[0]["v"]["seen"]["chunks"] == [([1], True, False), ([4], False, True)]
    assert runs[1]["v"]["seen"]["chunks"] == [([2], False, False), ([3], False, False)]


def test_dualpipev_checkpoint_resumes_bit_for_bit(runs):
    full = runs[0]["v"]["losses"][SAVED:]
    assert len(full) == STEPS and runs[0]["v-resumed"]["losses"] == full


@pytest.mark.parametrize("run", ["v-resumed", pytest.param("v-detach", marks=pytest.mark.skipif(
    not SLOW, reason="one more 20-step run; MINDSPEED_SLOW_TESTS=1 runs it"))])
def test_dualpipev_trains_with_the_1f1b_losses_from_its_checkpoint(runs, run):
    v, plain = runs[0][run]["losses"], runs[0]["plain"]["losses"]
    assert len(v) == len(plain) == STEPS
    assert _relative(v, plain) <= TOLERANCE, (v, plain)
    assert plain[0] != plain[-1]        # it trained: equal losses say something
    assert abs(runs[0][run]["valid"] - runs[0]["plain"]["valid"]) <= TOLERANCE * runs[0]["plain"]["valid"]
