"""Model FLOPs of the trainers' GPT, counted the way Megatron-LM's --log-throughput counts them.

Only matrix multiplications count: a [m, n] x [n, k] product is 2mnk FLOPs, and training does
each one three times (forward, gradient w.r.t. the input, gradient w.r.t. the weight). Causal
attention scores and their product with the values cover half the s x s square. Norms,
activations and the loss are left out, as in Megatron, so numbers compare with its logs.
"""
from __future__ import annotations

from mindspeed.features.parallel.layers import noop_layer_set

TRAINING_PASSES = 3      # forward + two backward GEMMs per forward GEMM
FLOPS_PER_MAC = 2


def _attention_macs_per_token(args) -> float:
    q_width = args.kv_channels * args.num_attention_heads
    kv_width = args.kv_channels * args.num_query_groups
    projections = args.hidden_size * (q_width + 2 * kv_width) + q_width * args.hidden_size
    # Q.K^T and probs.V: each seq_length x q_width per token, halved by the causal mask
    scores_and_values = 2 * q_width * args.seq_length / 2
    return projections + scores_and_values


def _mlp_macs_per_token(args) -> float:
    matrices = 3 if args.swiglu else 2          # SwiGLU's fc1 is two matrices (gate and up)
    if args.num_experts:                        # every layer is MoE; each token visits top-k experts
        width = args.moe_ffn_hidden_size or args.ffn_hidden_size
        return matrices * args.hidden_size * width * args.moe_router_topk
    return matrices * args.hidden_size * args.ffn_hidden_size


def flops_per_token(args) -> float:
    """Training FLOPs per token of one iteration (needs args.padded_vocab_size)."""
    real_layers = args.num_layers - len(noop_layer_set(args))     # --noop-layers do no work
    layers = real_layers * (_attention_macs_per_token(args) + _mlp_macs_per_token(args))
    logits = args.hidden_size * args.padded_vocab_size
    return TRAINING_PASSES * FLOPS_PER_MAC * (layers + logits)


def flops_per_iteration(args, global_batch_size: int) -> float:
    return flops_per_token(args) * global_batch_size * args.seq_length


def throughput_requested(args) -> bool:
    """Megatron's --log-throughput or MindSpeed's --op-cal-tflops: TFLOP/s per device and MFU."""
    return bool(args.log_throughput or args.op_cal_tflops)


def tflops_per_device(args, tokens: float, seconds: float) -> float:
    """TFLOP/s that each of the world's devices delivered while `tokens` were trained in `seconds`."""
    return flops_per_token(args) * tokens / (seconds * 1e12 * max(args.world_size, 1))
