"""Acceptance of the foundation: Megatron-Core's GPTModel runs forward+backward on CPU after
mindspeed.adapt(), and tensor parallelism gives the same loss as one process."""
import pytest

from tests_extend.distributed.harness import run_distributed


def _gpt_body(rank, world_size, tp, sp):
    import mindspeed
    mindspeed.adapt([])
    from tests_extend import megatron_tiny
    megatron_tiny.init_parallel(tp=tp)
    model = megatron_tiny.build_gpt(tp=tp, sp=sp)
    loss, _ = megatron_tiny.loss_and_grad_norm(model)
    grads_finite = all(p.grad is None or bool(p.grad.isfinite().all()) for p in model.parameters())
    return loss, grads_finite


@pytest.fixture(scope="module")
def tp1_loss():
    (loss, finite), = run_distributed(_gpt_body, world_size=1, args=(1, False), timeout=240)
    assert finite
    return loss


def test_single_process_forward_backward(tp1_loss):
    import math
    assert math.isfinite(tp1_loss) and 3.0 < tp1_loss < 7.0   # ~ln(128) for random init


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_tensor_parallel_matches_single_process(tp1_loss, sp):
    results = run_distributed(_gpt_body, world_size=2, args=(2, sp), timeout=240)
    for loss, finite in results:
        assert finite
        assert loss == pytest.approx(tp1_loss, abs=1e-5)
