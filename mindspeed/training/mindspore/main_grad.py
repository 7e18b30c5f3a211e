"""--gradient-accumulation-fusion on the MindSpore trainer (Megatron's main_grad): the GPT's
column- and row-parallel linears add their weight gradient dy^T @ x straight into an fp32 buffer
per weight, summed over the step's micro-batches, by the backend's matmul_add_fp32 kernel (on CPU
its reference: `emulated`); MindSpore's grad function then gets a zero gradient for those weights,
and the step adds each buffer's mean to it. The output layer is one of them (with tied embeddings
the word embeddings, whose lookup gradient stays MindSpore's).

The kernel writes in place inside a custom backward, which a traced graph does not call: the
trainer runs PyNative with it (trainer.graph_mode_ok)."""
from __future__ import annotations

import mindspore as ms
from mindspore import ops

from mindspeed.training.mindspore.layers import linear


class MainGrads:
    def __init__(self, backend):
        self.backend = backend
        self.buffers: dict = {}      # weight name -> fp32 main grad

    def linear(self, x, weight):
        """x @ weight^T; backward: dx = dy @ weight, and main_grad += dy^T @ x (fp32, in place)."""
        main_grad = self.buffers.get(weight.name)
        if main_grad is None:
            main_grad = self.buffers[weight.name] = ops.zeros(weight.shape, ms.float32)
        kernels = self.backend.kernels

        def forward(ctx, x, w):
            ctx.save(x, w)
            return linear(x, w)

        def backward(ctx, dy):
            x, w = ctx.saved
            kernels.matmul_add_fp32(x, dy, main_grad)
            dx = ops.matmul(dy.reshape(-1, dy.shape[-1]), w).reshape(x.shape)
            return dx, None        # the weight's gradient is in main_grad
        return self.backend.autograd.custom_op(forward, backward)(x, weight)

    def zero(self) -> None:
        for main_grad in self.buffers.values():
            main_grad.assign_value(ops.zeros_like(main_grad))

    def added_to(self, names: list, grads, n: int) -> tuple:
        """The step's gradients with each fused weight's main grad / n (the micro-batch mean) added:
        MindSpore's own gradient of such a weight is zero, unless it is used elsewhere too (a tied
        output layer's embedding, whose lookup gradient MindSpore still computes)."""
        return tuple(g + self.buffers[name] / n if name in self.buffers else g for name, g in zip(names, grads))
