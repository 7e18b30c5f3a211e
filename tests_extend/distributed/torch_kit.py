"""Tensor creation and autograd for the CP test bodies on the torch backend."""
import numpy as np
import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64, "bool": torch.bool}


def tensor(array, dtype):
    return torch.from_numpy(np.ascontiguousarray(array)).to(_DTYPES[dtype])


def numpy(t):
    return t.detach().to(torch.float64).numpy() if t.dtype != torch.bool else t.numpy()


def run_with_grads(fn, inputs, dout):
    """(output, [input grads]) of fn at inputs with cotangent dout, as float64 numpy."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(dout)
    return numpy(out), [numpy(x.grad) for x in leaves]
