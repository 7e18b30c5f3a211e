"""Tensor parallelism with dropout and packed documents on the MindSpore trainer (one msrun launch
of 2 processes). Hidden dropout: Megatron drops the same positions on every TP rank without
sequence parallelism (the hidden stream is replicated) and each rank's slice of the sequence with
it; so TP=2, with and without SP, gives the TP=1 losses with the same --hidden-dropout (were the
ranks' masks different, their copies of the hidden stream would part). The EOD flags with learned
positions (per-sample rows of the table, sliced by SP) also give the TP=1 losses."""
import os

import numpy as np
import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed import mindspore_parity as mp  # noqa: E402
from tests_extend.distributed import mindspore_parity_eod as pe  # noqa: E402
from tests_extend.distributed.msrun_helper import run_msrun  # noqa: E402

STEPS = 3
TOL = 1e-4
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mindspore_tp_dropout_eod_worker.py")
RUNS = {"hidden_dropout": (("--hidden-dropout", "0.1"), None),
        "eod": (pe.FLAGS + ("--position-embedding-type", "learned_absolute"), pe.ms_batch)}
SP_CASES = {"hidden_dropout": (False, True), "eod": (True,)}     # eod: the SP slice of the per-sample positions


def run(backend, name: str, tp: int, sp: bool) -> dict:
    flags, batch_fn = RUNS[name]
    return mp.ms_train(backend, tp, sp, None, steps=STEPS, extra=flags, batch_fn=batch_fn)


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tp_dropout_eod")
    return run_msrun(WORKER, [str(out_dir)], str(out_dir), workers=2, timeout=480)


@pytest.mark.parametrize("name", list(RUNS))
def test_tp2_gives_tp1_losses(tp2, name):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    tp1 = run(MindSporeBackend("cpu"), name, 1, False)
    for rank in range(2):
        assert tp2[rank]["ok"], tp2[rank].get("error")
        for sp in map(int, SP_CASES[name]):
            np.testing.assert_allclose(tp2[rank][f"{name}_sp{sp}"]["losses"], tp1["losses"], atol=TOL, rtol=0,
                                       err_msg=f"rank {rank} sp {sp}")
