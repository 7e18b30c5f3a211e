"""Multi-latent attention (Megatron-Core's MLASelfAttention on its local spec, no Transformer Engine):
a tiny MLA GPT gives one process's loss and gradients at TP 2 and at TP 2 with sequence parallelism,
from the same weights, through Megatron's DDP and finalize_model_grads; --use-flash-attn gives the
plain path's; the trainer trains it on 2 processes. The core attention alone: tests_extend/unit/test_mla_standin.py."""
import json
import math
import os

import pytest

from tests_extend.distributed.harness import next_rendezvous, run_distributed

VOCAB, SEQ, BATCH = 128, 32, 2
# v's head size (16) differs from q's and k's (12 + 8); YaRN with mscale_all_dim scales the softmax
MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=16,
           rope_type="yarn", rotary_scaling_factor=40.0, original_max_position_embeddings=16, mscale=1.0,
           mscale_all_dim=1.0)
FP32 = dict(atol=1e-5, rtol=1.3e-6)   # docs/kernels.md's fp32 bound (torch's assert_close default)
# a gradient sums over the batch's 64 tokens (and the heads), in another order per layout: within 64
# fp32 ulps of the gradient's largest entry (seen: 6 ulps)
GRAD_REL = 64 * 2 ** -24


def build_mla_gpt(tp: int, sp: bool):
    """An MLA GPT (RMSNorm, q/k norms, SwiGLU, untied output); cpu initialisation: the same weights at any TP."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    config = MLATransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        tensor_model_parallel_size=tp, sequence_parallel=sp, hidden_dropout=0.0, attention_dropout=0.0,
        qk_layernorm=True, apply_rope_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False, **MLA)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True, multi_latent_attention=True)
    return config, GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                            share_embeddings_and_output_weights=False)


def _batch():
    import torch
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1), torch.roll(tokens, -1, 1)


def _full_grads(model):
    """Every parameter's main_grad as one process holds it: TP-sharded ones gathered along their
    partition dim; replicated ones with their largest difference across the TP ranks."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    out, spread = {}, {}
    for name, param in model.module.named_parameters():
        grad = param.main_grad.detach().float()
        parts = [torch.empty_like(grad) for _ in range(tp)]
        dist.all_gather(parts, grad.contiguous(), group=group)
        if name.endswith("linear_fc1.weight"):    # SwiGLU: each rank holds [its gate rows; its up rows]
            halves = [p.chunk(2, 0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
        elif getattr(param, "tensor_model_parallel", False):
            out[name] = torch.cat(parts, param.partition_dim)
        else:
            out[name] = parts[0]
            spread[name] = max(float((p - parts[0]).abs().max()) for p in parts)
    return out, spread


def _loss_and_grads(rank, world_size, tp, sp, flags):
    import torch

    import mindspeed
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from tests_extend import megatron_tiny
    mindspeed.adapt(list(flags))
    try:
        megatron_tiny.init_parallel(tp=tp)
        config, model = build_mla_gpt(tp, sp)
        attention = type(model.decoder.layers[0].self_attention.core_attention).__name__
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        tokens, positions, labels = _batch()
        per_token = ddp(tokens, positions, None, labels=labels).float()
        per_token.mean().backward()
        finalize_model_grads([ddp])
        grads, spread = _full_grads(ddp)
        return dict(loss=per_token.mean().item(), per_token=per_token.detach(), grads=grads, spread=spread,
                    attention=attention)
    finally:
        mindspeed.unadapt()


def _layouts(rank, world_size, runs, tmp):
    import torch.distributed as dist
    out = {}
    for name, (tp, sp, flags) in runs.items():
        next_rendezvous(rank, os.path.join(tmp, name + ".port"))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out[name] = _loss_and_grads(rank, world_size, tp, sp, flags)
    return out


SINGLE = {"tp1": (1, False, []), "tp1_flash": (1, False, ["--use-flash-attn"])}
PAIR = {"tp2": (2, False, []), "tp2_sp": (2, True, []), "tp2_sp_flash": (2, True, ["--use-flash-attn"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("mla"))
    out = run_distributed(_layouts, world_size=1, args=(SINGLE, tmp), timeout=300)[0]
    out.update(run_distributed(_layouts, world_size=2, args=(PAIR, tmp), timeout=300)[0])
    return out


def _assert_same_grads(got, want):
    import torch
    assert got.keys() == want.keys()
    for name, grad in want.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(got[name], grad, atol=GRAD_REL * scale + 1e-7, rtol=0, msg=lambda m: f"{name}: {m}")


def test_the_mla_gpt_builds_with_the_stand_in_and_learns_something(runs):
    run = runs["tp1"]
    assert run["attention"] == "MLADotProductAttention"
    assert runs["tp1_flash"]["attention"] == "MLAFlashDotProductAttention"
    assert 3.5 < run["loss"] < 6.0            # ~ln(128) at random initialisation
    assert all(bool(g.isfinite().all()) and float(g.abs().max()) > 0 for g in run["grads"].values())
    assert any("q_layernorm" in n for n in run["grads"]) and any("kv_layernorm" in n for n in run["grads"])


@pytest.mark.parametrize("layout", sorted(PAIR))
def test_tensor_parallel_mla_gives_one_process_loss_and_gradients(runs, layout):
    """The same weights at TP 1 and TP 2 (with and without sequence parallelism): per-token losses
    within fp32's bound, every parameter's gradient (MLA's q/kv norms, its down projections, the
    heads' up projections) within fp32 rounding of the batch's sums, replicated ones equal on both ranks."""
    import torch
    want, got = runs["tp1"], runs[layout]
    torch.testing.assert_close(got["per_token"], want["per_token"], **FP32)
    _assert_same_grads(got["grads"], want["grads"])
    assert max(got["spread"].values()) <= 1e-6, got["spread"]


def test_flash_attention_gives_the_plain_paths_mla(runs):
    """--use-flash-attn: the kernel takes v's head size as it is; loss and gradients within the
    kernels' fp32 bound of Megatron's own attention."""
    import torch
    plain, flash = runs["tp1"], runs["tp1_flash"]
    torch.testing.assert_close(flash["per_token"], plain["per_token"], **FP32)
    _assert_same_grads(flash["grads"], plain["grads"])


# -- the trainer ------------------------------------------------------------------------------------
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "3", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
        "--lr", "3e-3", "--mock-data", "--seed", "11", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
        "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--rope-scaling-type", "yarn",
        "--rope-scaling-factor", "40", "--rope-scaling-original-max-position-embeddings", "64"]
TRAINER = {"tp2_sp_flash": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-flash-attn"],
           "dp2": []}


def _train(rank, world_size, tmp):
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.pretrain import run
    losses = {}
    for name, layout in TRAINER.items():
        loss_file = os.path.join(tmp, f"{name}.jsonl")
        next_rendezvous(rank, loss_file + ".port")
        args = parse_args(TINY + layout + ["--log-loss-file", loss_file], world_size=world_size)
        session = mindspeed.adapt(args)
        try:
            run(args, session)
        finally:
            mindspeed.unadapt()
        if rank == 0:
            with open(loss_file) as f:
                losses[name] = [json.loads(line)["lm_loss"] for line in f]
    return losses


@pytest.mark.parametrize("layout", sorted(TRAINER))
def test_the_trainer_trains_mla_on_two_processes(layout, trained):
    losses = trained[layout]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_distributed(_train, world_size=2, args=(str(tmp_path_factory.mktemp("mla_train")),), timeout=300)[0]
