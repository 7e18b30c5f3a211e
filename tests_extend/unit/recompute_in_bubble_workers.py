"""Bodies run in 2 processes (tests_extend.distributed.harness) for test_recompute_in_bubble: a tiny
Megatron-Core GPT over pipeline-parallel size 2, trained by Megatron-Core's own 1F1B schedule
(get_forward_backward_func) under each flag set; the losses, the most bytes a micro-batch's forward
holds for backward on each stage and the schedule's record come back."""
from __future__ import annotations

from functools import partial

import torch

STEPS, LAYERS, MICROBATCHES = 20, 4, 4
PP = ["--pipeline-model-parallel-size", "2", "--num-layers", str(LAYERS)]
FULL_BLOCK = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=LAYERS // 2)
CASES = {   # name: (flags, TransformerConfig overrides: what Megatron's args would set)
    "plain": (PP, {}),
    "bubble": (PP + ["--recompute-in-bubble"], {}),
    "full": (PP, FULL_BLOCK),
    "advance": (PP + ["--recompute-in-advance", "--recompute-granularity", "full", "--recompute-method", "block"],
                FULL_BLOCK),
}


def _loss(output):
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach()}


def _build(overrides):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests_extend import megatron_tiny
    config = TransformerConfig(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, **overrides)
    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=megatron_tiny.VOCAB,
                    max_sequence_length=megatron_tiny.SEQ, position_embedding_type="rope",
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def train(flags, overrides):
    import mindspeed
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from tests_extend import megatron_tiny
    from tests_extend.memory_meter import saved_for_backward
    mindspeed.unadapt()
    session = mindspeed.adapt(list(flags))
    megatron_tiny.init_parallel(pp=2)
    model = _build(overrides)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    forward_backward = get_forward_backward_func()

    saved = []          # bytes each micro-batch's forward holds for backward (sized when it returns)

    def forward_step(data_iterator, model):
        tokens, position_ids, labels = next(data_iterator)
        with saved_for_backward() as meter:
            output = model(tokens, position_ids, None, labels=labels)
        saved.append(meter.nbytes(exclude=list(model.parameters())))
        return output, _loss

    losses = []
    for step in range(STEPS):
        data = iter([megatron_tiny.batch(step * MICROBATCHES + m) for m in range(MICROBATCHES)])
        out = forward_backward(forward_step_func=forward_step, data_iterator=data, model=model,
                               num_microbatches=MICROBATCHES, seq_length=megatron_tiny.SEQ,
                               micro_batch_size=megatron_tiny.BATCH, forward_only=False)
        opt.step()
        opt.zero_grad()
        losses.append([float(o["lm loss"]) for o in out])
        if step == STEPS // 2:          # a validation in between, as the trainer runs one: no backward follows
            model.eval()
            with torch.no_grad():
                forward_backward(forward_step_func=forward_step, data_iterator=iter([megatron_tiny.batch(-1)] * 2),
                                 model=model, num_microbatches=2, seq_length=megatron_tiny.SEQ,
                                 micro_batch_size=megatron_tiny.BATCH, forward_only=True)
            model.train()
    controller = session.context.part("recompute_in_bubble")
    record = list(controller.record) if controller is not None else None
    mindspeed.unadapt()
    return dict(losses=losses, saved=max(saved), record=record)


def all_reports(rank, world_size):
    return {name: train(flags, overrides) for name, (flags, overrides) in CASES.items()}
