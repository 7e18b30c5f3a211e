"""Worker for test_cpu_step_costs: Megatron-Core's own training step (its schedule, DDP, its
optimizer with gradient clipping) on a tiny GPT with biases, under the cpu shim."""
from __future__ import annotations

from functools import partial

import torch


def _loss(labels_mask, output):
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach()}


def rewrites_per_step(rank, world_size, steps: int = 3):
    """CudaToCpuMode's rewrites made by each step, and the step's losses."""
    import mindspeed
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from mindspeed.backends.torch.megatron_shim import CudaToCpuMode
    from tests_extend import megatron_tiny

    mindspeed.unadapt()
    mindspeed.adapt([])
    megatron_tiny.init_parallel(seed=5)
    gpt = megatron_tiny.build_gpt(layers=1, add_bias_linear=True)
    model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [model])
    forward_backward = get_forward_backward_func()

    def forward_step(data_iterator, model):
        tokens, position_ids, labels = next(data_iterator)
        return model(tokens, position_ids, None, labels=labels), partial(_loss, None)

    rewrites, losses = [], []
    for step in range(steps):
        before = CudaToCpuMode.rewrites
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter([megatron_tiny.batch(step)]),
                               model=model, num_microbatches=1, seq_length=megatron_tiny.SEQ,
                               micro_batch_size=megatron_tiny.BATCH, forward_only=False)
        optimizer.step()
        rewrites.append(CudaToCpuMode.rewrites - before)
        losses.append(float(out[0]["lm loss"]))
    mindspeed.unadapt()
    return dict(rewrites=rewrites, losses=losses)


def folded_biases(rank, world_size):
    """A GPT with biases before and after fold_mlp_input_biases: how many MLPs changed, the largest
    output difference, the fc1 autograd node; and the count for a config whose activation is fused."""
    import mindspeed
    from mindspeed.training.model import fold_mlp_input_biases
    from tests_extend import megatron_tiny

    mindspeed.unadapt()
    mindspeed.adapt([])
    megatron_tiny.init_parallel(seed=3)
    gpt = megatron_tiny.build_gpt(layers=2, add_bias_linear=True)
    tokens, position_ids, labels = megatron_tiny.batch(1)
    with torch.no_grad():
        before = gpt(tokens, position_ids, None, labels=labels)
    folded = fold_mlp_input_biases(gpt)
    fc1 = gpt.decoder.layers[0].mlp.linear_fc1
    out, bias = fc1(torch.randn(4, 2, gpt.config.hidden_size, requires_grad=True))
    with torch.no_grad():
        after = gpt(tokens, position_ids, None, labels=labels)
    gpt.config.bias_activation_fusion = True
    fused_folded = fold_mlp_input_biases(megatron_tiny.build_gpt(layers=2, add_bias_linear=True,
                                                                 bias_activation_fusion=True))
    mindspeed.unadapt()
    return dict(folded=folded, diff=float((after - before).abs().max()), fc1_bias_returned=bias is not None,
                fc1_node=_node_names(out.grad_fn), fused_folded=fused_folded)


def _node_names(node, depth: int = 4) -> list[str]:
    names, frontier = [], [node]
    for _ in range(depth):
        frontier = [n for n in frontier if n is not None]
        names += [type(n).__name__ for n in frontier]
        frontier = [nxt for n in frontier for nxt, _ in n.next_functions]
    return names


def regions_over_two_ranks(rank, world_size):
    """A wrapped region function over the two-rank world: Megatron's own result (the reduce
    sums the ranks' tensors), not the input."""
    from megatron.core.tensor_parallel import mappings
    from mindspeed.backends.torch.one_rank_regions import _wrap_region
    group = torch.distributed.new_group([0, 1])
    x = torch.full((2, 3), float(rank + 1))
    reduced = _wrap_region(mappings.reduce_from_tensor_model_parallel_region)(x, group)
    return float(reduced[0, 0])


def cross_entropy_over_two_ranks(rank, world_size):
    """The wrapped cross entropy at TP=2, each rank holding half the vocabulary: Megatron's
    reductions over both halves, i.e. the loss over the whole vocabulary."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import cross_entropy
    from mindspeed.backends.torch.one_rank_cross_entropy import _wrap_cross_entropy
    parallel_state.initialize_model_parallel(2)
    g = torch.Generator().manual_seed(11)
    logits, target = torch.randn(5, 2, 16, generator=g) * 3, torch.randint(0, 16, (5, 2), generator=g)
    mine = logits[..., rank * 8:(rank + 1) * 8].clone()
    loss = _wrap_cross_entropy(cross_entropy.vocab_parallel_cross_entropy)(mine, target)
    whole = torch.nn.functional.cross_entropy(logits.view(-1, 16), target.view(-1), reduction="none")
    parallel_state.destroy_model_parallel()
    return float(loss.sum()), float(whole.sum())
