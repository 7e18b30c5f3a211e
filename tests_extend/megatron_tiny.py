"""A tiny Megatron-Core GPTModel (local spec) and deterministic batches for tests."""
from __future__ import annotations

import torch

VOCAB, SEQ, BATCH = 128, 32, 2


def init_parallel(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 123) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp)
    model_parallel_cuda_manual_seed(seed)


def build_gpt(tp: int = 1, sp: bool = False, layers: int = 2, hidden: int = 64, heads: int = 4, **overrides):
    """GPT with RMSNorm, SwiGLU and RoPE; cpu initialisation makes weights independent of TP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, use_cpu_initialization=True,
               normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
               add_bias_linear=False, tensor_model_parallel_size=tp, sequence_parallel=sp,
               hidden_dropout=0.0, attention_dropout=0.0)
    cfg.update(overrides)
    config = TransformerConfig(**cfg)
    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope")


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.roll(tokens, -1, 1)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    return tokens, position_ids, labels


def loss_and_grad_norm(model, seed: int = 0) -> tuple[float, float]:
    tokens, position_ids, labels = batch(seed)
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    sq = sum(float(p.grad.float().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    return loss.item(), sq
