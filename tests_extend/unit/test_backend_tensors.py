"""TensorAPI (backend.tensors.cat / split) on both backends: values and gradients against numpy."""
import numpy as np
import pytest


def _torch():
    from mindspeed.backends.torch.backend import TorchBackend
    return TorchBackend("cpu")


def _mindspore():
    pytest.importorskip("mindspore")
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    return MindSporeBackend("cpu")


A = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
B = -np.arange(12, dtype=np.float32).reshape(1, 3, 4) - 1
W = np.random.default_rng(0).standard_normal((3, 3, 4)).astype(np.float32)


def _cat_and_grads(backend):
    """cat([A, B], 0), then d/dA, d/dB of sum(W * cat) (each part gets its own rows of W)."""
    if backend.name == "torch":
        import torch
        a, b = torch.tensor(A, requires_grad=True), torch.tensor(B, requires_grad=True)
        out = backend.tensors.cat([a, b], 0)
        (out * torch.tensor(W)).sum().backward()
        return out.detach().numpy(), a.grad.numpy(), b.grad.numpy()
    import mindspore as ms
    out = backend.tensors.cat([ms.Tensor(A), ms.Tensor(B)], 0)
    grad = ms.grad(lambda a, b: (backend.tensors.cat([a, b], 0) * ms.Tensor(W)).sum(), grad_position=(0, 1))
    ga, gb = grad(ms.Tensor(A), ms.Tensor(B))
    return out.asnumpy(), ga.asnumpy(), gb.asnumpy()


@pytest.mark.parametrize("make", [_torch, _mindspore], ids=["torch", "mindspore"])
def test_cat_joins_in_order_and_routes_gradients_back(make):
    out, ga, gb = _cat_and_grads(make())
    np.testing.assert_array_equal(out, np.concatenate([A, B], 0))
    np.testing.assert_array_equal(ga, W[:2])
    np.testing.assert_array_equal(gb, W[2:])


@pytest.mark.parametrize("make", [_torch, _mindspore], ids=["torch", "mindspore"])
def test_split_by_size_and_by_sections(make):
    backend = make()
    as_np = (lambda t: t.numpy()) if backend.name == "torch" else (lambda t: t.asnumpy())
    if backend.name == "torch":
        import torch
        x = torch.tensor(A)
    else:
        import mindspore as ms
        x = ms.Tensor(A)
    parts = backend.tensors.split(x, 2, 2)
    assert [p.shape[2] for p in parts] == [2, 2]
    np.testing.assert_array_equal(as_np(parts[1]), A[:, :, 2:])
    parts = backend.tensors.split(x, [1, 2], 1)
    np.testing.assert_array_equal(as_np(parts[0]), A[:, :1])
    np.testing.assert_array_equal(as_np(parts[1]), A[:, 1:])
