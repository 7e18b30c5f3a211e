"""--bf16 on the MindSpore trainer (emulated on CPU: bf16 parameters, activations and gradients, the
ops without a bf16 CPU kernel in fp32) against Megatron-Core's bf16 (Float16Module, fp32 masters in
Float16OptimizerWithFloat16Params, no loss scaling) on torch/CPU: same bf16-representable initial
weights, same batches, 20 steps.

The bounds come from torch's own bf16 effect measured in the same run: the largest gap between
torch's bf16 and fp32 losses over the 20 steps (how large it is depends on torch's CPU kernels: the
AVX-512 BF16 and the AVX2 ones round differently). MindSpore rounds at a subset of the points torch
rounds at (its attention block computes in fp32 and rounds its output once; torch rounds q/k/v, the
scores and the probabilities too), so bf16 moves its losses off fp32 by no more than it moves torch's,
and the two bf16 runs, each within torch's effect of fp32, are within GAP_FACTOR = 2 times it of each
other. A lower bound holds MindSpore's bf16 in effect: its losses leave its fp32 run's by more than
the fp32 parity bound (mp.FP32_TOL), which an fp32 run in disguise cannot do. The gradient norms likewise against
torch's own bf16 effect on them. The checkpoint holds the fp32 masters and Megatron-Core (fp32) loads
it. TP=2 with bf16 runs in the --fp16 test's msrun launch (test_mindspore_parity_fp16.py).

--reuse-fp32-param (training/mindspore/reuse_fp32_param.py, with the distributed optimizer) runs the same 20
steps: torch's split bit for bit (the bf16 weight the master rounded ties away from zero, the master kept
exactly), losses within the same bounds of torch's bf16, nothing fp32 kept by the model, and its checkpoint
(exact fp32 masters) loads with and without the flag."""
import numpy as np
import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed import mindspore_parity as mp  # noqa: E402
from tests_extend.distributed import mindspore_parity_fp16 as pf  # noqa: E402
from tests_extend.distributed.harness import run_distributed  # noqa: E402

pytestmark = pytest.mark.cpu_numerics      # torch's bf16 effect: CI measures it with torch's AVX2 kernels too
GAP_FACTOR = pf.GAP_FACTOR
REUSE = ("--reuse-fp32-param",)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    init = str(root / "init")
    pf.write_init(init, "bf16")
    return {"root": root, "init": init, "ms_final": str(root / "ms_final"), "ms_reuse": str(root / "ms_reuse")}


@pytest.fixture(scope="module")
def ms_runs(paths):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    backend = MindSporeBackend("cpu")
    return {"bf16": pf.ms_train_fp16(backend, paths["init"], pf.BF16, save_dir=paths["ms_final"]),
            "fp32": pf.ms_train_fp16(backend, paths["init"], ()),
            "reuse": pf.ms_train_fp16(backend, paths["init"], pf.BF16 + REUSE, distributed_optimizer=True,
                                      save_dir=paths["ms_reuse"])}


@pytest.fixture(scope="module")
def torch_runs(paths, ms_runs):
    (result,) = run_distributed(pf.torch_bf16_runs, world_size=1, args=(paths["init"], paths["ms_final"]),
                                timeout=300)
    return result


def torch_bf16_effect(torch_runs, key: str = "losses", relative: bool = False) -> float:
    return pf.bf16_effect(torch_runs["bf16"], torch_runs["fp32"], key, relative)


def test_bf16_losses_match_torch_bf16_within_torchs_bf16_effect(ms_runs, torch_runs):
    m, t16 = np.array(ms_runs["bf16"]["losses"]), np.array(torch_runs["bf16"]["losses"])
    effect = torch_bf16_effect(torch_runs)
    assert len(m) == len(t16) == mp.STEPS and effect > 1e-4
    np.testing.assert_allclose(m, t16, atol=GAP_FACTOR * effect, rtol=0)
    np.testing.assert_allclose(ms_runs["bf16"]["grad_norms"], torch_runs["bf16"]["grad_norms"],
                               rtol=GAP_FACTOR * torch_bf16_effect(torch_runs, "grad_norms", relative=True))
    # bf16 moves MindSpore's losses off its fp32 run beyond fp32's bound, and no further than twice
    # what it moves torch's (it rounds at fewer points)
    own = np.abs(m - np.array(ms_runs["fp32"]["losses"])).max()
    assert mp.FP32_TOL < own < effect * GAP_FACTOR, (own, effect)
    assert ms_runs["bf16"]["param_dtypes"] == ["BFloat16"] and not ms_runs["bf16"]["graph_mode"]
    assert ms_runs["bf16"]["scales"] == [None] * mp.STEPS and not any(ms_runs["bf16"]["skipped"])
    assert m[-4:].mean() < m[:4].mean() - 0.05      # it trains


def test_bf16_checkpoint_holds_fp32_masters_and_crosses_to_torch(paths, ms_runs, torch_runs):
    params, moments, meta = pf.checkpoint_of_masters(paths["ms_final"], ms_runs["bf16"]["masters"])
    w = params["decoder.final_layernorm.weight"]
    assert (pf.to_bf16(w) != w).any()         # fp32 masters, not the bf16 weights
    assert moments is not None and meta["optimizer_steps"] == mp.STEPS and "grad_scaler" not in meta
    # Megatron-Core in fp32 loads it: its loss is the bf16 model's within bf16's effect
    assert torch_runs["fp32"]["eval_loss_of_other"] == pytest.approx(ms_runs["bf16"]["eval_loss"],
                                                                    abs=torch_bf16_effect(torch_runs))


# --- --reuse-fp32-param ------------------------------------------------------------------------------

def _ties_away(a: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bf16 with ties away from zero (torch's --reuse-fp32-param split), as fp32."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x8000)) & np.uint32(0xFFFF0000)).view(np.float32)


def test_reuse_fp32_param_splits_and_joins_as_torchs_bit_for_bit():
    import torch
    from mindspeed.features.memory import reuse_fp32_param_megatron as torch_side
    from mindspeed.training.mindspore.reuse_fp32_param import join, split
    import mindspore as ms
    bits = np.random.default_rng(0).integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)
    bits = bits[np.isfinite(bits.view(np.float32))][:4000]
    bits[:300] = (bits[:300] & 0xFFFF0000) | 0x8000         # ties: where the two roundings differ
    values = bits.view(np.float32).reshape(-1, 8)
    low, high = split(ms.Tensor(values))
    pairs = torch_side.split(torch.from_numpy(values.copy()))
    np.testing.assert_array_equal(high.astype(ms.float32).asnumpy().reshape(-1), pairs[:, 1].float().numpy())
    np.testing.assert_array_equal(low.asnumpy().reshape(-1), pairs[:, 0].view(torch.int16).numpy())
    assert (high.astype(ms.float32).asnumpy() != pf.to_bf16(values)).any()     # not round-to-even
    np.testing.assert_array_equal(join(low, high).asnumpy().view(np.uint32), values.view(np.uint32))


def test_reuse_fp32_param_trains_as_torchs_bf16_keeping_no_fp32_copy_in_the_model(ms_runs, torch_runs):
    reuse, plain = ms_runs["reuse"], ms_runs["bf16"]
    m = np.array(reuse["losses"])
    assert len(m) == mp.STEPS
    np.testing.assert_allclose(m, torch_runs["bf16"]["losses"], atol=GAP_FACTOR * torch_bf16_effect(torch_runs), rtol=0)
    # the run without the flag but where a tie rounds the other way: the same first step (the initial weights
    # are bf16 values), then apart by less than bf16's own effect
    assert m[0] == plain["losses"][0]
    np.testing.assert_allclose(m, plain["losses"], atol=torch_bf16_effect(torch_runs), rtol=0)
    # the model keeps bf16 weights and int16 residuals (2 + 2 bytes), no fp32 master beside them
    assert reuse["kept_dtypes"] == ["BFloat16", "Int16"] and plain["kept_dtypes"] == ["BFloat16", "Float32"]
    for name, master in reuse["masters"].items():
        np.testing.assert_array_equal(np.array(reuse["weights"][name], np.float32),
                                      _ties_away(np.array(master, np.float32)), err_msg=name)


def test_reuse_fp32_param_checkpoint_holds_the_masters_and_loads_with_and_without_the_flag(paths, ms_runs):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    params, _, meta = pf.checkpoint_of_masters(paths["ms_reuse"], ms_runs["reuse"]["masters"])
    w = params["decoder.final_layernorm.weight"]
    assert (pf.to_bf16(w) != w).any() and meta["optimizer_steps"] == mp.STEPS    # fp32 masters, not bf16 weights
    backend = MindSporeBackend("cpu")
    for flags in (pf.BF16 + REUSE, pf.BF16):
        loaded = pf.ms_train_fp16(backend, paths["ms_reuse"], flags, 0, distributed_optimizer=True,
                                  save_dir=str(paths["root"] / f"loaded{len(flags)}"))
        for name, value in params.items():
            np.testing.assert_array_equal(np.array(loaded["masters"][name], np.float32), value, err_msg=name)
        assert loaded["eval_loss"] == pytest.approx(ms_runs["reuse"]["eval_loss"], abs=mp.FP32_TOL)


def test_reuse_fp32_param_on_mindspore_without_the_distributed_optimizer_is_refused_in_one_line():
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    with pytest.raises(MindSpeedConfigError) as err:
        plan(["--backend", "mindspore", "--bf16", "--reuse-fp32-param"])
    assert "--reuse-fp32-param on MindSpore needs --use-distributed-optimizer" in str(err.value)
    assert "\n" not in str(err.value)
    plan(["--backend", "mindspore", "--bf16", "--reuse-fp32-param", "--use-distributed-optimizer"])
    plan(["--backend", "torch", "--bf16", "--reuse-fp32-param"])        # Megatron's Float16 optimizer folds it
