"""Tensor creation and autograd for the CP test bodies on the mindspore backend (PyNative)."""
import mindspore as ms
import numpy as np

_DTYPES = {"float32": ms.float32, "bfloat16": ms.bfloat16, "float64": ms.float64, "bool": ms.bool_}


def tensor(array, dtype):
    if dtype == "bool":
        return ms.Tensor(np.ascontiguousarray(array), ms.bool_)
    return ms.Tensor(np.ascontiguousarray(array, dtype=np.float32)).astype(_DTYPES[dtype])


def numpy(t):
    return t.astype(ms.float64).asnumpy() if t.dtype != ms.bool_ else t.asnumpy()


def run_with_grads(fn, inputs, dout):
    """(output, [input grads]) of fn at inputs with cotangent dout, as float64 numpy."""
    def loss(*xs):
        out = fn(*xs)
        return (out.astype(ms.float32) * dout.astype(ms.float32)).sum(), out

    grad_fn = ms.value_and_grad(loss, grad_position=tuple(range(len(inputs))), has_aux=True)
    (_, out), grads = grad_fn(*inputs)
    return numpy(out), [numpy(g) for g in grads]
