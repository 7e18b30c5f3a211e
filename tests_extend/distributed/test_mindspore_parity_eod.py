"""--eod-mask-loss, --reset-position-ids and --reset-attention-mask on the MindSpore trainer give
Megatron-Core's losses (GPTModel on torch, CPU, fp32, same initial weights, |loss diff| <= 1e-4 per
step over 20 steps) on batches of packed documents: torch gets the masks and positions Megatron's
_get_ltor_masks_and_position_ids builds, MindSpore the ones its data pipeline builds. With learned
positions (where the reset positions count) and with RoPE (which ignores them in both)."""
import numpy as np
import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed import mindspore_parity as mp  # noqa: E402
from tests_extend.distributed import mindspore_parity_eod as pe  # noqa: E402
from tests_extend.distributed.harness import run_distributed  # noqa: E402

TOL = 1e-4
NORM_RTOL = 1e-4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("parity_eod"))


@pytest.fixture(scope="module")
def torch_runs(root):
    (result,) = run_distributed(pe.torch_all, world_size=1, args=(root,), timeout=600)
    return result


@pytest.mark.parametrize("case", list(pe.CASES))
def test_eod_flags_match_megatron(root, torch_runs, case):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    ms_run = pe.ms_run(MindSporeBackend("cpu"), root, case)
    t, m = np.array(torch_runs[case]["losses"]), np.array(ms_run["losses"])
    assert len(t) == len(m) == mp.STEPS
    np.testing.assert_allclose(m, t, atol=TOL, rtol=0)
    np.testing.assert_allclose(ms_run["grad_norms"], torch_runs[case]["grad_norms"], rtol=NORM_RTOL)
    assert ms_run["graph_mode"]         # the document mask and positions go through the traced graph
    assert m[-4:].mean() < m[:4].mean() - 0.05
