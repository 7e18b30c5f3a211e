"""Issue 15: the MindSpore trainer's --optimizer sgd and --lr-decay-style WSD give Megatron-Core's
losses (fp32, within 1e-4 per step over 20 steps, TP=1) and gradient norms (rtol 1e-4): torch side
Megatron-Core's GPTModel with the SGD and the OptimizerParamScheduler Megatron-Core builds; and a
checkpoint written mid-run by the MindSpore trainer resumes with its momentum (the same losses)."""
import numpy as np
import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed import optimizer_parity as op  # noqa: E402
from tests_extend.distributed.harness import run_distributed  # noqa: E402

TOL = 1e-4
NORM_RTOL = 1e-4
RESUME_AT = 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mindspeed.training.mindspore import schedule
    root = tmp_path_factory.mktemp("sgd_parity")
    (torch_run,) = run_distributed(op.torch_train, world_size=1, args=(str(root / "init"),), timeout=300)
    ms_run = op.ms_train(str(root / "init"), str(root / "ms_ckpt"), RESUME_AT)
    return torch_run, ms_run, schedule


def test_sgd_with_wsd_matches_megatron_core(runs):
    torch_run, ms_run, _ = runs
    t, m = np.array(torch_run["losses"]), np.array(ms_run["losses"])
    assert len(t) == len(m) == op.STEPS
    # the same lr each step: Megatron's scheduler object and the MindSpore trainer's schedule
    np.testing.assert_allclose(ms_run["lrs"], torch_run["lrs"], rtol=1e-12, atol=0)
    np.testing.assert_allclose(m, t, atol=TOL, rtol=0)
    np.testing.assert_allclose(ms_run["grad_norms"], torch_run["grad_norms"], rtol=NORM_RTOL)
    assert m[-4:].mean() < m[:4].mean() - 0.05      # it trains
    assert ms_run["graph_mode"]


def test_a_mid_run_checkpoint_resumes_sgds_momentum(runs):
    _, ms_run, _ = runs
    np.testing.assert_allclose(ms_run["resumed_losses"], ms_run["losses"][RESUME_AT:], atol=1e-6, rtol=0)


def test_the_torch_trainers_sgd_checkpoint_gives_its_momentum_to_the_mindspore_trainer(tmp_path):
    """The torch launch script (1 process, --optimizer sgd, 2 steps) saves torch_dist; the MindSpore
    trainer's reader finds a momentum buffer for every weight (no Adam moments, no refusal)."""
    import os
    import subprocess
    import sys

    from mindspeed.net import free_port
    from mindspeed.checkpoint.cross_format import neutral_from_torch_dist
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHON=sys.executable, TP="1", NPUS_PER_NODE="1", MASTER_PORT=str(free_port()),
               LOG_DIR=str(tmp_path / "logs"), NUM_LAYERS="1", HIDDEN_SIZE="32", NUM_HEADS="4", SEQ_LENGTH="32",
               MICRO_BATCH="4", GLOBAL_BATCH="4", TRAIN_ITERS="2", LR="1e-2", MIN_LR="1e-3", WARMUP_ITERS="1",
               EVAL_INTERVAL="100", EVAL_ITERS="0", CKPT_DIR=str(tmp_path / "ckpt"))
    r = subprocess.run(["bash", os.path.join(root, "tests_extend", "example", "train_distributed.sh"),
                        "--optimizer", "sgd", "--mock-data"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    model, moments, meta = neutral_from_torch_dist(str(tmp_path / "ckpt" / "iter_0000002"), True)
    assert sorted(moments) == sorted(f"momentum_buffer/{name}" for name in model)
    assert all(np.abs(v).max() > 0 for v in moments.values())
    assert meta["iteration"] == 2
