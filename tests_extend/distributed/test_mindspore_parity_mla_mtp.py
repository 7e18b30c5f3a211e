"""Issue 55: multi-latent attention and multi-token prediction on the MindSpore trainer give Megatron-Core's
losses (MLASelfAttention and MultiTokenPredictionBlock on the local spec, torch, CPU, fp32, TP 1, the same initial
weights and batches, |loss diff| <= 1e-4 per step, gradient norms within 1e-4 relative):

- DeepSeek-V3's pair: MLA with the compressed and normed query, the kv norm, v's own head size, YaRN with
  mscale_all_dim (its softmax scale), and one MTP layer (--mtp-loss-scaling-factor 0.3) over 20 steps, in the
  traced graph; the trainer's checkpoint, loaded by Megatron-Core's GPT (its names:
  self_attention.linear_q_down_proj.weight, mtp.layers.0.eh_proj.weight, ...), gives MindSpore's evaluation loss;
- MLA with the uncompressed query (linear_q_proj), plain RoPE and no norms; two MTP layers on the GQA model
  (each a few steps, PyNative).
The gate's refusals (MLA at TP > 1; MTP beyond PP/TP/CP 1, with dropout): unit/test_family_flags.py; MTP with
MoE layers: test_mindspore_parity_moe.py -k mtp."""
import numpy as np
import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed import mindspore_parity as mp  # noqa: E402
from tests_extend.distributed import mindspore_parity_mla_mtp as pm  # noqa: E402
from tests_extend.distributed.harness import run_distributed  # noqa: E402

TOL = mp.FP32_TOL
NORM_RTOL = 1e-4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("parity_mla_mtp"))


@pytest.fixture(scope="module")
def torch_runs(root):
    (result,) = run_distributed(pm.torch_all, world_size=1, args=(root,), timeout=600)
    return result


def _ms(root, case, save_dir=None):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    _, flags, steps = pm.CASES[case]
    return mp.ms_train(MindSporeBackend("cpu"), 1, False, pm.init_ckpt(root, case), save_dir=save_dir, steps=steps,
                       extra=flags)


def _assert_matches(ms_run, torch_run, what):
    np.testing.assert_allclose(ms_run["losses"], torch_run["losses"], atol=TOL, rtol=0, err_msg=what)
    np.testing.assert_allclose(ms_run["grad_norms"], torch_run["grad_norms"], rtol=NORM_RTOL, err_msg=what)


def test_mla_and_mtp_match_megatron_core_and_cross_its_checkpoint(root, torch_runs):
    run = _ms(root, pm.FULL, save_dir=f"{root}/ms_full")
    assert len(run["losses"]) == mp.STEPS and run["graph_mode"]     # what matched is the traced graph
    _assert_matches(run, torch_runs[pm.FULL], pm.FULL)
    assert np.mean(run["losses"][-4:]) < np.mean(run["losses"][:4]) - 0.05     # it trains
    (evaluated,) = run_distributed(pm.torch_evaluates, world_size=1, timeout=300,
                                   args=(root, pm.FULL, f"{root}/ms_full"))
    assert evaluated["eval_loss_of_other"] == pytest.approx(run["eval_loss"], abs=TOL)


@pytest.mark.parametrize("case", [pm.PLAIN, pm.MTP2])
def test_each_variant_matches_megatron_core(root, torch_runs, case, monkeypatch):
    monkeypatch.setenv("MINDSPEED_MS_PYNATIVE", "1")     # a few steps: quicker than compiling a graph
    run = _ms(root, case)
    _assert_matches(run, torch_runs[case], case)
    assert not run["graph_mode"]
