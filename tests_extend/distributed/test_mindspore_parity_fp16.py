"""--fp16 on the MindSpore trainer against Megatron-Core's fp16 (Float16Module, fp32 masters in
Float16OptimizerWithFloat16Params, DynamicGradScaler) on torch/CPU: same fp16-representable initial
weights, same batches, 20 steps.

fp16 cannot hold fp32's 1e-4. The per-step bound is half of fp16's own effect on torch, measured in
the same run (the largest gap between torch's fp16 and fp32 losses over the 20 steps; how large it
is depends on torch's CPU kernels): the two fp16 runs agree more closely than fp16 moves either of
them, and that effect must exceed fp32's bound (1e-4) for the comparison to say anything.

Forced overflow (--initial-loss-scale 2**24): the same steps are skipped and the scale follows the
same sequence (hysteresis 2, then halving) as Megatron-Core's scaler; the checkpoint holds the fp32
masters and the scaler state, and Megatron-Core (fp32) loads it. Two processes (one msrun launch):
TP=2, TP=2 + SP, DP=2 with the distributed optimizer and PP=2 follow the TP=1 fp16 losses, and an
inf on one rank only makes every rank skip; in the same launch --bf16 at TP=2 + SP, PP=2 and CP=2
(ring attention; its bf16 activations through the TP and pipeline collectives) follows the TP=1 bf16
run (test_mindspore_parity_bf16.py carries the 20-step bf16 claim against torch)."""
import os

import numpy as np
import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed import mindspore_parity as mp  # noqa: E402
from tests_extend.distributed import mindspore_parity_fp16 as pf  # noqa: E402
from tests_extend.distributed.harness import run_distributed  # noqa: E402
from tests_extend.distributed.msrun_helper import run_msrun  # noqa: E402

NORM_RTOL = 1e-3
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mindspore_parity_fp16_worker.py")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp16")
    init, init_bf16 = str(root / "init"), str(root / "init_bf16")
    pf.write_init(init)
    pf.write_init(init_bf16, "bf16")
    return {"root": root, "init": init, "init_bf16": init_bf16, "ms_final": str(root / "ms_final")}


@pytest.fixture(scope="module")
def ms_runs(paths):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    backend = MindSporeBackend("cpu")
    return {"fp16": pf.ms_train_fp16(backend, paths["init"], save_dir=paths["ms_final"]),
            "overflow": pf.ms_train_fp16(backend, paths["init"], pf.OVERFLOW, pf.OVERFLOW_STEPS)}


@pytest.fixture(scope="module")
def torch_runs(paths, ms_runs):
    (result,) = run_distributed(pf.torch_runs, world_size=1, args=(paths["init"], paths["ms_final"]), timeout=300)
    return result


@pytest.fixture(scope="module")
def fp16_tol(torch_runs):
    """Half of how far fp16 moves torch's losses off fp32's in this run."""
    return pf.bf16_effect(torch_runs["fp16"], torch_runs["fp32"]) / 2


@pytest.mark.cpu_numerics
def test_fp16_losses_match_torch_fp16(ms_runs, torch_runs, fp16_tol):
    m, t16 = (np.array(r["losses"]) for r in (ms_runs["fp16"], torch_runs["fp16"]))
    assert len(m) == len(t16) == mp.STEPS
    assert 2 * fp16_tol > mp.FP32_TOL                   # fp16 moves torch's losses beyond fp32's bound
    np.testing.assert_allclose(m, t16, atol=fp16_tol, rtol=0)
    np.testing.assert_allclose(ms_runs["fp16"]["grad_norms"], torch_runs["fp16"]["grad_norms"], rtol=NORM_RTOL)
    # the scale doubled after each 10 clean steps on both sides; nothing skipped
    assert ms_runs["fp16"]["scales"] == torch_runs["fp16"]["scales"]
    assert ms_runs["fp16"]["scales"][-1] == 4 * 2.0 ** 14 and not any(ms_runs["fp16"]["skipped"])
    assert ms_runs["fp16"]["param_dtypes"] == ["Float16"] and ms_runs["fp16"]["graph_mode"]
    assert m[-4:].mean() < m[:4].mean() - 0.05      # it trains


def test_overflow_skips_steps_and_lowers_the_scale_as_megatron(ms_runs, torch_runs, fp16_tol):
    m, t = ms_runs["overflow"], torch_runs["overflow"]
    assert m["skipped"] == t["skipped"] and m["scales"] == t["scales"] and m["lrs"] == t["lrs"]
    # hysteresis 2: the first overflow keeps the scale, each next one halves it
    assert m["skipped"][:3] == [True, True, True] and m["scales"][:3] == [2.0 ** 24, 2.0 ** 23, 2.0 ** 22]
    assert not m["skipped"][-1] and m["grad_norms"][0] is None and m["grad_norms"][-1] is not None
    # skipped steps leave the weights (same loss on the repeated batch) and the lr schedule alone
    assert m["losses"][4] == m["losses"][0] and m["lrs"][:m["skipped"].index(False) + 1] == [0.0] * (
        m["skipped"].index(False) + 1)
    np.testing.assert_allclose(m["losses"], t["losses"], atol=fp16_tol, rtol=0)


def test_checkpoint_holds_fp32_masters_and_the_scaler(paths, ms_runs, torch_runs, fp16_tol):
    params, moments, meta = pf.checkpoint_of_masters(paths["ms_final"], ms_runs["fp16"]["masters"])
    # fp32 values, not the fp16 weights: most of them are not fp16-representable
    w = params["decoder.final_layernorm.weight"]
    assert (w.astype(np.float16).astype(np.float32) != w).any()
    assert meta["grad_scaler"] == {"scale": 4 * 2.0 ** 14, "growth_tracker": 0, "hysteresis_tracker": 2}
    assert moments is not None and meta["optimizer_steps"] == mp.STEPS
    # Megatron-Core in fp32 loads it: its loss is the fp16 model's within fp16's effect
    assert torch_runs["fp32"]["eval_loss_of_other"] == pytest.approx(ms_runs["fp16"]["eval_loss"], abs=fp16_tol)


def test_resume_restores_masters_scaler_and_skip_count(paths, ms_runs):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer, resume
    backend = MindSporeBackend("cpu")
    args = parse_args(mp.trainer_argv(1) + list(pf.PARITY) + ["--load", paths["ms_final"]], world_size=1)
    trainer = Trainer(args, backend, build_parallel_state(backend.comm, 1), GPTConfig.from_args(args, mp.VOCAB))
    lines = []
    iteration, _ = resume(args, trainer, type("Log", (), {"print": staticmethod(lines.append)}))
    assert iteration == mp.STEPS and trainer.loss_scale == 4 * 2.0 ** 14 and trainer.optimizer.step_count == mp.STEPS
    name = "decoder.final_layernorm.weight"
    np.testing.assert_array_equal(trainer.model.masters[name].asnumpy(), np.array(ms_runs["fp16"]["masters"][name],
                                                                                  np.float32))
    np.testing.assert_array_equal(trainer.model.params[name].asnumpy(),
                                  np.array(ms_runs["fp16"]["masters"][name], np.float16))


@pytest.fixture(scope="module")
def two_process(paths):
    out_dir = paths["root"] / "msrun"
    out_dir.mkdir()
    return run_msrun(WORKER, [str(out_dir), paths["init"], paths["init_bf16"]], str(out_dir), workers=2, timeout=600)


def test_two_process_fp16_follows_tp1(two_process, ms_runs, torch_runs, fp16_tol):
    from tests_extend.distributed.mindspore_parity_fp16_worker import RUNS
    for rank in range(2):
        assert two_process[rank]["ok"], two_process[rank].get("error")
        for run in RUNS:
            r = two_process[rank][run]
            steps = len(r["losses"])
            np.testing.assert_allclose(r["losses"], torch_runs["fp16"]["losses"][:steps], atol=fp16_tol, rtol=0,
                                       err_msg=run)
            np.testing.assert_allclose(r["losses"], ms_runs["fp16"]["losses"][:steps], atol=fp16_tol, rtol=0,
                                       err_msg=run)
            assert r["param_dtypes"] == ["Float16"] and not any(r["skipped"]), run
        assert two_process[rank]["overflow_on_rank1_only"] is True


def test_two_process_bf16_follows_tp1(paths, two_process):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed.mindspore_parity_fp16_worker import BF16_RUNS, STEPS
    backend = MindSporeBackend("cpu")
    tp1 = pf.ms_train_fp16(backend, paths["init_bf16"], pf.BF16, STEPS)
    # the layouts round at other points than TP=1: within twice how far bf16 moves TP=1 off fp32 here
    effect = pf.bf16_effect(tp1, pf.ms_train_fp16(backend, paths["init_bf16"], (), STEPS))
    tol = max(pf.GAP_FACTOR * effect, mp.FP32_TOL)      # or fp32's bound, where bf16 has moved it less
    for rank in range(2):
        assert two_process[rank]["ok"], two_process[rank].get("error")
        for run in BF16_RUNS:
            r = two_process[rank][run]
            np.testing.assert_allclose(r["losses"], tp1["losses"], atol=tol, rtol=0, err_msg=run)
            assert r["param_dtypes"] == ["BFloat16"] and not r["graph_mode"], run
