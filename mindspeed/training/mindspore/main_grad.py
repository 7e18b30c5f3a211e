"""--gradient-accumulation-fusion on the MindSpore trainer (Megatron's main_grad): the GPT's
column- and row-parallel linears add their weight gradient dy^T @ x straight into an fp32 buffer
per weight, summed over the step's micro-batches, by the backend's matmul_add_fp32 kernel (on CPU
its reference: `emulated`); MindSpore's grad function then gets a zero gradient for those weights,
and the step adds each buffer's mean to it. The output layer is one of them (with tied embeddings
the word embeddings, whose lookup gradient stays MindSpore's).

--gemm-gradient-accumulation-fusion with --moe-grouped-gemm (Megatron-Core GroupedMLP's main_grad):
the MoE layer's grouped expert GEMMs (moe.py) add their weight gradients x_g^T @ dy_g into one fp32
buffer per layer and GEMM, [local experts, K, N] (gmm's stacked weights), by the backend's
grouped_matmul_add_fp32 kernel; each expert's [N, K] weight then gets its slice, transposed, as its
main grad. Either flag alone fuses its own weights only (`dense`, `experts`).

The kernel writes in place inside a custom backward, which a traced graph does not call: the
trainer runs PyNative with it (trainer.graph_mode_ok)."""
from __future__ import annotations

import mindspore as ms
from mindspore import ops

from mindspeed.training.mindspore.layers import linear, stacked


class MainGrads:
    def __init__(self, backend, dense: bool = True, experts: bool = False):
        self.backend = backend
        self.dense, self.experts = dense, experts    # which weights are fused: linears, grouped experts
        self.buffers: dict = {}      # weight name -> fp32 main grad
        self.grouped: dict = {}      # expert weight names (one GEMM's, in group order) -> fp32 [G, K, N]
        self.slot: dict = {}         # expert weight name -> (its GEMM's buffer, its group index): `of` per step

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

    def grouped_linear(self, gmm, x, weights: list, sizes: list):
        """gmm(x, stacked(weights), sizes) with x [M, K] rows sorted by group (sizes[g] rows for
        weights[g], each [N, K]); backward: dx = gmm(dy, the weights [G, N, K]), and main_grad
        [G, K, N] [g] += x_g^T @ dy_g (fp32, in place). `gmm`: the model's grouped GEMM (in its precision)."""
        key = tuple(w.name for w in weights)
        main_grad = self.grouped.get(key)
        if main_grad is None:
            n, k = weights[0].shape
            main_grad = self.grouped[key] = ops.zeros((len(weights), k, n), ms.float32)
            self.slot.update((name, (main_grad, g)) for g, name in enumerate(key))
        kernels = self.backend.kernels

        def forward(ctx, x, *ws):
            ctx.save(x, *ws)
            return gmm(x, stacked(ws), sizes, 1)

        def backward(ctx, dy):
            x, *ws = ctx.saved
            kernels.grouped_matmul_add_fp32(x, dy, sizes, main_grad, 1)
            dx = gmm(dy, stacked(ws, transpose=False), sizes, 1)
            return (dx,) + (None,) * len(ws)     # the weights' gradients are in main_grad
        return self.backend.autograd.custom_op(forward, backward)(x, *weights)

    def zero(self) -> None:
        for main_grad in list(self.buffers.values()) + list(self.grouped.values()):
            main_grad.assign_value(ops.zeros_like(main_grad))

    def of(self, name: str):
        """The fp32 main grad of weight `name` (an expert's: its slice of the grouped buffer,
        transposed to the weight's [N, K]), None if it has none."""
        if name in self.buffers:
            return self.buffers[name]
        if name in self.slot:
            main_grad, g = self.slot[name]
            return main_grad[g].T
        return None

    def added_to(self, names: list, grads, n: int) -> tuple:
        """The step's gradients with each fused weight's main grad / n (the micro-batch mean) added:
        MindSpore's own gradient of such a weight is zero, unless it is used elsewhere too (a tied
        output layer's embedding, whose lookup gradient MindSpore still computes)."""
        mains = [self.of(name) for name in names]
        return tuple(g if m is None else g + m / n for m, g in zip(mains, grads))
