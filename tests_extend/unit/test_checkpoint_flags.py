"""The checkpoint flags do what they say in both trainers, or are refused in one line:
--ckpt-step needs --load; --no-load-optim leaves the optimizer as built (the weights still load);
--no-load-rng: torch_dist and neutral checkpoints hold no RNG state, so a resume leaves the RNG as seeded
(--ckpt-format torch's legacy checkpoint holds it and restores it: tests_extend/distributed/test_legacy_checkpoint.py)."""
import json
import os
import random
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from mindspeed.errors import ArgumentError
from mindspeed.flags.trainer_flags import parse_args
from tests_extend.unit import checkpoint_flag_workers


@pytest.mark.parametrize("backend", ["torch", "mindspore"])
def test_ckpt_step_without_load_is_refused_in_one_line(backend, tmp_path):
    with pytest.raises(ArgumentError, match=re.escape("--ckpt-step needs --load")) as err:
        parse_args(["--backend", backend, "--ckpt-step", "4"], world_size=1)
    assert "\n" not in str(err.value)
    args = parse_args(["--backend", backend, "--ckpt-step", "4", "--load", str(tmp_path)], world_size=1)
    assert (args.ckpt_step, args.load) == (4, str(tmp_path))


# --- torch: pretrain.resume on a real Megatron-Core model, optimizer and checkpoint ---------------

@pytest.fixture(scope="module")
def torch_report(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("torch_ckpt"))
    result = subprocess.run([sys.executable, "-m", checkpoint_flag_workers.__name__, root], capture_output=True,
                            text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_torch_resume_loads_weights_and_optimizer_by_default(torch_report):
    saved, default = torch_report["saved"], torch_report["default"]
    assert saved["moments"] > 0
    assert (default["iteration"], default["consumed"]) == (1, 2)
    assert default["weights"] == pytest.approx(saved["weights"], rel=1e-6)
    assert default["moments"] == pytest.approx(saved["moments"], rel=1e-6)


def test_torch_no_load_optim_keeps_the_fresh_optimizer(torch_report):
    saved, run = torch_report["saved"], torch_report["no_load_optim"]
    assert run["moments"] == 0.0                                   # Adam's moments were not loaded
    assert run["weights"] == pytest.approx(saved["weights"], rel=1e-6)
    assert (run["iteration"], run["consumed"]) == (1, 2)           # the iteration and schedule go on
    assert torch_report["finetune"]["moments"] == 0.0 and torch_report["finetune"]["iteration"] == 0


def test_torch_no_save_optim_checkpoint_refuses_a_resume_that_wants_the_state(torch_report):
    run = torch_report["no_save_optim"]
    assert run["refused"] and "holds no optimizer state (saved with --no-save-optim): resume it with " \
        "--no-load-optim" in run["refused"] and "\n" not in run["refused"]
    assert run["no_load_optim"] == [1, 2]


def test_torch_resume_leaves_the_rng_as_seeded(torch_report):
    assert torch_report["no_load_rng"]["rng_untouched"]
    assert torch_report["default"]["rng_untouched"]      # torch_dist checkpoints hold no RNG state at all


# --- MindSpore: trainer.resume on a neutral checkpoint -----------------------------------------------

class _Model:
    def __init__(self):
        self.ps = SimpleNamespace(tp_rank=0, tp_size=1)
        # no vocabulary rows to fit here; SwiGLU fc1; no experts split over TP
        self.cfg = SimpleNamespace(full_shapes=lambda: {}, swiglu=True, experts_tp_sharded=False)
        self.expert_bias = None        # a dense model: no router bias to load
        self.loaded = None

    def load_full(self, full):
        self.loaded = {k: np.array(v) for k, v in full.items()}


class _Optimizer:
    def __init__(self):
        self.loaded = None

    def load_state_arrays(self, shards, step_count):
        self.loaded = (dict(shards), step_count)


def _ms_resume(root, *flags):
    from mindspeed.training.mindspore.trainer import resume
    args = parse_args(["--backend", "mindspore", "--load", root, *flags], world_size=1)
    trainer = SimpleNamespace(model=_Model(), optimizer=_Optimizer(), scaler=None)     # fp32: no loss scaler
    np.random.seed(4321)
    random.seed(4321)
    before = (np.random.get_state()[1].copy(), random.getstate())
    iteration, consumed = resume(args, trainer, SimpleNamespace(print=lambda *_: None))
    untouched = np.array_equal(before[0], np.random.get_state()[1]) and before[1] == random.getstate()
    return trainer, iteration, consumed, untouched


@pytest.fixture
def neutral_checkpoint(tmp_path):
    pytest.importorskip("mindspore")
    from mindspeed.checkpoint import neutral as neutral_format
    root = str(tmp_path / "ckpt")
    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    neutral_format.save(root, 3, {"final_norm.weight": weights},
                        {"final_norm.weight.exp_avg": weights * 0.5, "final_norm.weight.exp_avg_sq": weights * 0.25},
                        {"consumed_samples": 24, "optimizer_steps": 3})
    return root, weights


def test_mindspore_resume_loads_weights_and_optimizer_by_default(neutral_checkpoint):
    root, weights = neutral_checkpoint
    trainer, iteration, consumed, _ = _ms_resume(root)
    assert (iteration, consumed) == (3, 24)
    np.testing.assert_array_equal(trainer.model.loaded["final_norm.weight"], weights)
    moments, steps = trainer.optimizer.loaded
    assert steps == 3 and sorted(moments) == ["final_norm.weight.exp_avg", "final_norm.weight.exp_avg_sq"]


@pytest.mark.parametrize("flag", ["--no-load-optim", "--finetune"])
def test_mindspore_no_load_optim_keeps_the_fresh_optimizer(neutral_checkpoint, flag):
    root, weights = neutral_checkpoint
    trainer, iteration, _, _ = _ms_resume(root, flag)
    assert trainer.optimizer.loaded is None                          # moments and step count not loaded
    np.testing.assert_array_equal(trainer.model.loaded["final_norm.weight"], weights)
    assert iteration == (0 if flag == "--finetune" else 3)


def test_mindspore_resume_leaves_the_rng_as_seeded(neutral_checkpoint):
    root, _ = neutral_checkpoint
    assert _ms_resume(root, "--no-load-rng")[3] and _ms_resume(root)[3]


# --- --no-save-optim on the MindSpore trainer: its real checkpoint code on a world of one -----------------

def test_mindspore_no_save_optim_writes_no_state_and_a_resume_that_wants_it_is_refused(tmp_path):
    """The checkpoint holds the weights only and says so; a resume that asks for the optimizer state (either
    trainer: the torch one reads the neutral meta too) is refused in one line; --no-load-optim loads it."""
    pytest.importorskip("mindspore")
    import mindspeed
    from mindspeed.checkpoint import neutral as neutral_format
    from mindspeed.checkpoint.torch_dist import saved_without_optimizer
    from mindspeed.errors import CheckpointError
    from mindspeed.training.mindspore import checkpoint
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    from tests_extend.distributed import mindspore_parity as kit
    args = parse_args(kit.trainer_argv(1) + ["--backend", "mindspore", "--no-save-optim"], world_size=1)
    session = mindspeed.adapt(args)
    try:
        backend = session.backend
        ps = build_parallel_state(backend.comm, 1)
        trainer = Trainer(args, backend, ps, GPTConfig.from_args(args, kit.VOCAB), session)
        root = str(tmp_path / "ckpt")
        for with_optimizer, where in ((False, root), (True, str(tmp_path / "full"))):
            checkpoint.save(backend, ps, where, 2, trainer.model, trainer.optimizer, {"consumed_samples": 4},
                            with_optimizer=with_optimizer)
        weights, state, meta = neutral_format.load(root)
        assert state is None and meta["no_optimizer"] and sorted(weights) == sorted(trainer.model.master_params())
        assert saved_without_optimizer(root, 2) and not saved_without_optimizer(str(tmp_path / "full"), 2)
        with pytest.raises(CheckpointError) as refused:
            checkpoint.load(root, trainer.model, trainer.optimizer)
        assert "holds no optimizer state (saved with --no-save-optim): resume it with --no-load-optim" \
            in str(refused.value) and "\n" not in str(refused.value)
        assert checkpoint.load(root, trainer.model, trainer.optimizer, load_optimizer=False)["iteration"] == 2
    finally:
        session.close()
