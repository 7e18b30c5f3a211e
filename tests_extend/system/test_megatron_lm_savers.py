"""MindSpeed's memory savers inside Megatron-LM's own pretrain_gpt.py, at TP=2 with sequence
parallelism (mock data, 4 layers, hidden 64): the savers that promise the same math all together, and
each other saver the support matrix accepts on torch (each of the first alone too with
MINDSPEED_SLOW_TESTS=1). Each run must train; where a saver promises the same math
(recompute, swapping), its losses must be those of the run without it, bit for bit.

core_v0.16.1 runs in CI; core_v0.12.1 with the other 0.12.1 training runs (MINDSPEED_SLOW_TESTS=1).
The shared causal mask needs no flag: it is on in every run here. --optimizer-selection fused_ema_adamw
(not a saver: it adds an EMA of the weights) rides along as the one more Megatron optimizer hook.
"""
import math
import os

import pytest

from tests_extend.system import megatron_lm_kit as kit

# a user's flags: TP=2 with SP, MindSpeed's fused kernels (the fused RMSNorm keeps --recompute-norm
# bitwise; the unfused one differs in the last bit), gradient-accumulation fusion (Megatron's default)
ENV = {"TP": "2", "MOCK_DATA": "1", "FUSED": "1", "TRAIN_ITERS": "4"}
BASE = ["--sequence-parallel"]
# name: (flags, the feature MindSpeed must report, same losses as the run without it)
SAVERS = {
    "swap-attention": (["--swap-attention"], "swap-attention", True),
    "recompute-activation-function": (["--recompute-activation-function"], "recompute-activation-function", True),
    "recompute-norm": (["--recompute-norm"], "recompute-norm", True),
    "swap-optimizer": (["--swap-optimizer"], "swap-optimizer", True),
    # bf16 only, and not with --swap-optimizer (it would empty the shared storage): refused together;
    # its bf16 rounding differs from Megatron's in ties, so it trains but is not bitwise
    "reuse-fp32-param": (["--bf16", "--reuse-fp32-param"], "reuse-fp32-param", False),
    # AdamW as Megatron's plus an EMA of the weights: the same losses, though --use-ema validates with the
    # EMA weights every 2 iterations (they must be the model's own again after); its checkpoint holds the EMA
    "fused-ema-adamw": (["--optimizer-selection", "fused_ema_adamw", "--ema-decay", "0.6", "--use-ema",
                         "--eval-interval", "2", "--eval-iters", "1"], "fused-ema-adamw", True),
}
TOGETHER = ["swap-attention", "recompute-activation-function", "recompute-norm", "swap-optimizer"]


def _skip_older_core(version):
    if version != kit.VERSIONS[-1] and not os.environ.get("MINDSPEED_SLOW_TESTS"):
        pytest.skip(f"trains on core_v{kit.VERSIONS[-1]} only (CI time budget; MINDSPEED_SLOW_TESTS=1 runs it)")


@pytest.fixture(scope="module", params=kit.VERSIONS, ids=lambda v: f"core_v{v}")
def checkout(request, tmp_path_factory):
    _skip_older_core(request.param)
    return kit.checkout_or_skip(request.param, tmp_path_factory)


def _train(checkout, flags):
    result = kit.launch(kit.with_dataset_helpers(checkout), 2, BASE + flags, ENV)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    losses = kit.losses(output)
    assert sorted(losses) == list(range(1, int(ENV["TRAIN_ITERS"]) + 1)), output[-3000:]
    assert all(math.isfinite(v) and 0 < v < 20 for v in losses.values()), losses
    assert losses[max(losses)] < losses[1], losses     # it learns (mock tokens: slowly)
    return output, losses


@pytest.fixture(scope="module")
def without_savers(checkout):
    return _train(checkout, [])[1]


# CI's time: the bitwise savers train together (each one's hooks run, and one that changed the math
# would change the losses); each alone with MINDSPEED_SLOW_TESTS=1
ALONE = list(SAVERS) if os.environ.get("MINDSPEED_SLOW_TESTS") else [n for n in SAVERS if n not in TOGETHER]


@pytest.mark.parametrize("name", ALONE + ["together"])
def test_saver_trains_under_megatron_lm_at_tp2_with_sp(checkout, without_savers, name, tmp_path):
    names = TOGETHER if name == "together" else [name]
    flags = [flag for saver in names for flag in SAVERS[saver][0]]
    # the EMA weights are checkpointed on both cores (core_v0.12.1's torch_dist save through
    # mindspeed/backends/torch/dist_ckpt_write_item.py and sync_save_queue.py)
    save = ema = name == "fused-ema-adamw"
    output, losses = _train(checkout, flags + (["--save", str(tmp_path), "--save-interval", ENV["TRAIN_ITERS"]]
                                               if save else []))
    if ema:
        assert "validation loss at iteration 2" in output, output[-3000:]
    if save:
        from megatron.core.dist_checkpointing.serialization import load_tensors_metadata
        keys = list(load_tensors_metadata(str(tmp_path / f"iter_{int(ENV['TRAIN_ITERS']):07d}")))
        assert sum(".ema_params." in k for k in keys) == sum(".exp_avg." in k for k in keys) > 0, keys
    print(f"{os.path.basename(checkout)} {name}: {losses}")
    reported = kit.mindspeed_features(output)
    assert {SAVERS[saver][1] for saver in names} | {"gradient-accumulation-fusion"} <= reported, reported
    if all(SAVERS[saver][2] for saver in names):
        assert losses == without_savers, (losses, without_savers)
