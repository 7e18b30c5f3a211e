"""--swap-attention and --swap-optimizer on the torch trainer (Megatron-Core GPT, Megatron's
optimizers): the same losses bit for bit with the flags on and off, bytes really held on the host
side (the memory layer's ledger) and gone from the device side, checkpoints that cross the flags,
and one-line refusals. One worker process runs every training case (swap_workers.py)."""
import json
import os
import re
import subprocess
import sys

import pytest

from mindspeed.adaptor_core import MindSpeedConfigError, plan
from tests_extend.unit import swap_workers
from tests_extend.unit.bf16_rounding import largest_gap, losses_before_a_differing_tie


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("swap_ckpt"))
    result = subprocess.run([sys.executable, "-m", swap_workers.__name__, root], capture_output=True, text=True,
                            timeout=600, env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("off, on", [("off", "attention"), ("off", "optimizer"), ("bf16_off", "bf16_optimizer"),
                                     ("bf16_dist_off", "bf16_dist_both")])
def test_losses_are_bitwise_the_same_with_the_swap_on(report, off, on):
    losses = report["losses"]
    assert losses[on] == losses[off]
    assert len(set(losses[off])) == len(losses[off])          # it trained: every step's loss differs


def test_swap_attention_moves_saved_activations_to_the_host(report):
    off, on = report["attention"]["off"], report["attention"]["on"]
    moved = on["host_after_forward"]
    assert off["host_after_forward"] == 0 and moved > 0.25 * off["device_saved"]
    # what the host holds is what the device side no longer holds (within one shared small tensor)
    assert off["device_saved"] - on["device_saved"] == pytest.approx(moved, rel=0.02)
    assert on["host_after_backward"] == 0                       # host copies freed after backward
    assert on["device_reload_peak"] == moved                    # each copy came back once
    assert on["groups"] == 2                                    # one per layer's self_attention
    # backward reaches layer 2 first: its group is loaded on demand and layer 1's prefetched with it
    assert on["loads"] == [[2, "demand"], [1, "prefetch"]]


@pytest.mark.parametrize("flags, bytes_per_param", [
    ("--swap-optimizer --swap-optimizer-times 3", 8),                      # fp32: both moments
    ("--bf16 --swap-optimizer --swap-optimizer-times 4", 12),              # + the fp32 master copy
    ("--bf16 --use-distributed-optimizer --swap-attention --swap-optimizer", 12)])
def test_swap_optimizer_keeps_states_on_the_host_between_updates(report, flags, bytes_per_param):
    state = report["optimizer"][flags]
    assert state["attached"] == [True]
    assert state["resident"] == 0                                # device side: no state storage left
    assert state["host_bytes"] == state["managed"]
    # norm weights stay fp32 in bf16 models (no separate master): a little under 12 bytes/param
    assert state["host_bytes"] / state["params"] == pytest.approx(bytes_per_param, rel=0.01)
    times = int(re.search(r"times (\d+)", flags).group(1)) if "times" in flags else 16
    steps = swap_workers.STEPS
    assert steps * min(times, 7) <= state["chunks"] <= steps * times   # 7 = fewest params a chunk can hold here
    assert state["device_peak"] < state["managed"] / 2            # the update never holds it all at once


def test_without_the_flag_nothing_is_swapped(report):
    for flags in ("", "--bf16", "--bf16 --use-distributed-optimizer"):
        state = report["optimizer"][flags]
        assert state["attached"] == [False] and state["host_bytes"] == 0


@pytest.mark.parametrize("direction", ["on_to_off", "off_to_on"])
def test_checkpoints_cross_the_swap_flags(report, direction):
    run = report["checkpoint"][direction]
    assert run["iteration"] == 2
    assert run["resumed"] == run["continued"]


@pytest.mark.parametrize("argv, message", [
    (["--swap-optimizer", "--swap-optimizer-times", "0"], "--swap-optimizer-times must be >= 1, got 0"),
    (["--swap-attention", "--swap-modules", "self_attention,attn"], "unknown module attn"),
    (["--swap-modules", "mlp"], "--swap-modules has no effect without --swap-attention"),
    (["--swap-optimizer-times", "2"], "--swap-optimizer-times has no effect without --swap-optimizer"),
])
def test_bad_swap_flags_are_refused_in_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError) as err:
        plan(argv, unknown_flags="trainer")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unadapt_restores_what_the_swaps_patch():
    import mindspeed
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from mindspeed.patching import _raw_get
    classes = (TransformerLayer, Float16OptimizerWithFloat16Params, FP32Optimizer, DistributedOptimizer)
    before = [_raw_get(c, "__init__") for c in classes]
    state = mindspeed.adapt(["--swap-attention", "--swap-optimizer"])
    assert [_raw_get(c, "__init__") is b for c, b in zip(classes, before)] == [False] * 4
    assert {"swap-attention", "swap-optimizer"} <= {f.id for f in state.plan.features}
    mindspeed.unadapt()
    assert [_raw_get(c, "__init__") is b for c, b in zip(classes, before)] == [True] * 4


def _ms_losses(flags, steps=2):
    """The MindSpore trainer (world of one, in this process) with `flags`: losses, the ledger, the swapper."""
    import mindspeed
    from mindspeed.backends import get_backend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore.model import GPTConfig, init_full_weights
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    from tests_extend.distributed import mindspore_parity as kit
    args = parse_args(kit.trainer_argv(1) + ["--backend", "mindspore"] + flags, world_size=1)
    session = mindspeed.adapt(args)
    try:
        backend = get_backend()
        trainer = Trainer(args, backend, build_parallel_state(backend.comm, 1), GPTConfig.from_args(args, kit.VOCAB),
                          session)
        trainer.model.load_full(init_full_weights(trainer.cfg, 3))
        losses = []
        for step in range(steps):
            tokens, labels, mask = kit.batch(step)
            losses.append(trainer.train_step([{"tokens": tokens, "labels": labels, "loss_mask": mask}], step + 1)[0])
        return losses, backend.memory.ledger, trainer.model
    finally:
        mindspeed.unadapt()


def test_mindspore_swap_attention_same_losses_and_bytes_through_the_host():
    pytest.importorskip("mindspore")
    off, off_ledger, _ = _ms_losses([])
    on, ledger, model = _ms_losses(["--swap-attention", "--swap-modules", "self_attention,mlp"])
    assert on == off and len(set(off)) == len(off)
    assert off_ledger.moved["host"] == 0
    assert model.swap_modules == {"self_attention", "mlp"}
    # every step copied each layer's saved activations out and back, and dropped the host copies
    assert ledger.moved["host"] > 0 and ledger.moved["device"] == ledger.moved["host"]
    assert ledger.held["host"] == 0 and ledger.peak["host"] > 0


# --reuse-fp32-param (same worker process: swap_workers.reuse_fp32_param)

@pytest.mark.cpu_numerics
def test_reuse_fp32_param_trains_as_megatron_rounding_ties_away_from_zero(report):
    reuse = report["reuse"]
    assert len(reuse["on"]["losses"]) == 20 and reuse["on"]["losses"] == reuse["reference"]["losses"]


@pytest.mark.cpu_numerics
def test_reuse_fp32_param_keeps_the_losses_within_bf16_rounding(report):
    reuse = report["reuse"]
    off, on, fp32 = reuse["off"]["losses"], reuse["on"]["losses"], reuse["fp32"]["losses"]
    # the same updates until one leaves a master where ties-away and to-even rounding differ (when
    # depends on the CPU's kernels: bf16_rounding.py)
    same = losses_before_a_differing_tie(reuse["off"]["differing_ties"])
    assert same >= 1 and on[:same] == off[:same]
    # after it, a few bf16 parameters one step apart: less than bf16 itself moves the losses off fp32
    assert largest_gap(on, off) <= largest_gap(off, fp32)
    assert off[-1] < off[0] - 1.5                               # it trained


@pytest.mark.cpu_numerics
def test_reuse_fp32_param_masters_are_bitwise_and_params_differ_only_at_ties(report):
    first = report["reuse"]["after_first_update"]
    assert first["masters_bitwise"]
    # a bf16 parameter differs from Megatron's round-to-nearest-even copy only where its master's low
    # 16 bits are exactly 0x8000, and there exactly where the rounded-down value is even
    assert first["params_differ_off_ties"] == 0
    assert first["params_differ"] == report["reuse"]["off"]["differing_ties"][0] <= first["ties"]


@pytest.mark.cpu_numerics
def test_reuse_fp32_param_masters_read_as_megatron_lm_params_norm_reads_them(report):
    # calc_params_l2_norm (--log-params-norm) reads `param.main_param`, between updates a view of the
    # [bf16 | residual] buffer: through the wrapper, fp32 values (it read nan under Megatron-LM before)
    assert report["reuse"]["on"]["masters_norm"] == report["reuse"]["reference"]["masters_norm"]


def test_reuse_fp32_param_stores_a_bf16_parameter_and_its_master_in_4_bytes(report):
    assert report["reuse"]["off"]["bytes_per_bf16_param"] == 6 and not report["reuse"]["off"]["attached"]
    assert report["reuse"]["on"]["bytes_per_bf16_param"] == 4 and report["reuse"]["on"]["attached"]


@pytest.mark.cpu_numerics
@pytest.mark.parametrize("direction", ["on_to_off", "off_to_on"])
def test_reuse_fp32_param_checkpoints_cross_the_flag(report, direction):
    """Megatron's Float16 optimizer, other side with --swap-optimizer (a --bf16 checkpoint without the
    distributed optimizer once failed: "Param id N does not match any model sharded param"); that
    side rounds ties away from zero as the flag does (bf16_rounding.py), so the losses agree bit for bit."""
    run = report["reuse"]["checkpoint"][direction]
    assert run["iteration"] == 2 and run["resumed"] == run["continued"]


def test_model_only_loads_set_the_masters_from_the_parameters(report):
    # --no-load-optim with --bf16: the trainer refreshes the masters (reload_model_params) ...
    assert report["reuse"]["model_only_load_masters_equal_params"]
    # ... which, with --reuse-fp32-param, clears the residuals of the shared buffers
    for name in ("off", "on"):
        assert report["reuse"][name]["reloaded_masters_equal_params"]


@pytest.mark.parametrize("argv, message", [
    (["--reuse-fp32-param"], "needs --bf16 (bf16) to be on too"),
    (["--reuse-fp32-param", "--fp16"], "--reuse-fp32-param (reuse-fp32-param) needs --bf16"),
    (["--reuse-fp32-param", "--bf16", "--swap-optimizer"], "conflicts with 'swap-optimizer'"),
])
def test_bad_reuse_fp32_param_combinations_are_refused_in_one_line(argv, message):
    with pytest.raises(MindSpeedConfigError) as err:
        plan(argv, unknown_flags="trainer")
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("world, more", [
    ("1", []), ("2", ["--tensor-model-parallel-size", "2"]), ("2", []), ("4", ["--tensor-model-parallel-size", "2"]),
    # Qwen3's recipe (numerics: test_reuse_fp32_param_distributed.py, DP=2 and PP 2 of 2 processes, DP=1)
    ("2", ["--overlap-grad-reduce", "--overlap-param-gather"]),
    ("2", ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce", "--overlap-param-gather"]),
    ("2", ["--num-experts", "4", "--expert-model-parallel-size", "2"]),      # the experts' EDP 1
    ("4", ["--num-experts", "4", "--expert-model-parallel-size", "2"])])
def test_reuse_fp32_param_with_the_distributed_optimizer_is_accepted_at_every_data_parallel_size(monkeypatch, world,
                                                                                                 more):
    # at (expert-)data-parallel size 1 a master shard is the whole buffer: no neighbour shard to borrow, the
    # buffer's storage grows to hold the residuals (reuse_fp32_param_distrib.WholeBuffer)
    monkeypatch.setenv("WORLD_SIZE", world)
    argv = ["--reuse-fp32-param", "--bf16", "--use-distributed-optimizer"] + more
    assert "reuse-fp32-param" in {f.id for f in plan(argv, unknown_flags="trainer").features}


@pytest.mark.parametrize("experts, refused", [(None, False), (4, True)])
def test_reuse_fp32_param_with_megatron_lm_overlap_param_gather_with_optimizer_step(monkeypatch, experts, refused):
    """Megatron-LM's --overlap-param-gather-with-optimizer-step starts the all-gather after the first of
    the chained optimizers' updates: with MoE before the expert optimizer's, whose buckets are then fp32
    pairs. Not a flag of the built-in trainer: the feature's own check, on Megatron-LM's namespace."""
    from argparse import Namespace
    from mindspeed.features.base import FeatureConfigError
    from mindspeed.features.memory.reuse_fp32_param import ReuseFp32Param
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = Namespace(backend=None, bf16=True, fp16=False, use_distributed_optimizer=True, overlap_param_gather=True,
                     overlap_param_gather_with_optimizer_step=True, num_experts=experts,
                     expert_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    if not refused:
        ReuseFp32Param().validate(args)
        return
    with pytest.raises(FeatureConfigError, match="drop --overlap-param-gather-with-optimizer-step"):
        ReuseFp32Param().validate(args)


def test_unadapt_restores_what_reuse_fp32_param_patches():
    import mindspeed
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from mindspeed.patching import _raw_get
    classes = (Float16OptimizerWithFloat16Params, DistributedOptimizer)
    before = [_raw_get(c, "__init__") for c in classes]
    mindspeed.adapt(["--reuse-fp32-param", "--bf16"])
    assert [_raw_get(c, "__init__") is b for c, b in zip(classes, before)] == [False, False]
    mindspeed.unadapt()
    assert [_raw_get(c, "__init__") is b for c, b in zip(classes, before)] == [True, True]


# shared attention mask (always on; same worker process: swap_workers.shared_mask_report)

def test_every_layer_and_micro_batch_gets_the_one_causal_mask(report):
    mask = report["mask"]
    assert mask["calls"] == mask["layers"] * mask["micro_batches"] == 8
    assert mask["mask_objects"] == 1 and mask["mask_storages"] == 1 and mask["mask_shapes"] == [[1, 1, 16, 16]]


def test_the_shared_mask_gives_the_losses_of_per_micro_batch_masks_bit_for_bit(report):
    mask = report["mask"]
    assert mask["shared"] == mask["stacked"] and len(set(mask["shared"])) == len(mask["shared"])


def test_megatron_default_causal_mask_is_built_once_for_all_layers(report):
    # no mask passed: every layer's softmax asks for the default mask; one storage is saved, not one per layer
    assert report["mask"]["default_mask_storages_saved"] == 1


@pytest.mark.parametrize("flags, shared", [([], True), (["--reset-attention-mask"], False),
                                           (["--context-parallel-size", "2"], False)])
def test_only_the_plain_causal_mask_is_shared(flags, shared):
    from mindspeed.features.memory.shared_mask import plain_causal
    from mindspeed.flags.trainer_flags import parse_args
    assert plain_causal(parse_args(flags, world_size=2)) is shared
