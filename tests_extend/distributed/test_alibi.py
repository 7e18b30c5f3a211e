"""--position-embedding-type alibi (features/fused/alibi.py) on the built-in torch trainer: the slopes
(a power-of-two head count and the interpolated ones), MindSpeed's attention modules (unfused and
--use-flash-attn) against an fp64 softmax(QK^T/sqrt(d) + bias + causal mask) V, forward and backward,
at TP=2 with a non-power-of-two head count (each rank's heads keep their global slopes), and the
trainer's fp32 losses at TP=2 against TP=1, and that the layers share one bias cache. One 2-process launch."""
import math

import pytest

from mindspeed.features.fused.alibi import local_slopes, slopes
from tests_extend.distributed.harness import run_distributed

HEADS, HEAD_DIM, SEQ, BATCH = 6, 4, 10, 2


def test_slopes_power_of_two_and_interpolated():
    assert slopes(8) == [2.0 ** -k for k in range(1, 9)]
    assert slopes(4) == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    # 6 heads: the 4-head slopes, then every other one of the 8-head slopes (2^-1, 2^-3)
    assert slopes(6) == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    assert local_slopes(6, 2, 1) == [2.0 ** -8, 2.0 ** -1, 2.0 ** -3]


def _reference(q, k, v, m):
    """fp64 softmax(q k^T / sqrt(d) - m_h |i - j|, causal) v; q/k/v [s, b, n, d] -> [s, b, n*d]."""
    import torch
    s = q.shape[0]
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(q.shape[-1])
    pos = torch.arange(s, dtype=torch.float64)
    scores = scores - torch.tensor(m, dtype=torch.float64)[:, None, None] * (pos[:, None] - pos[None]).abs()
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bnst,tbnd->sbnd", torch.softmax(scores, -1), v)
    return out.reshape(s, q.shape[1], -1)


def _attention_modules(tp):
    """This rank's unfused and flash alibi attention of a HEADS-head layer at TP `tp`."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from mindspeed.backends import get_backend
    from mindspeed.features.fused.flash_attention import alibi_attention_class, flash_attention_class
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               tensor_model_parallel_size=tp, attention_dropout=0.0,
                               params_dtype=__import__("torch").float32)
    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    settings = dict(diagonal_opposite=False, fill_neg_inf=False)
    return (alibi_attention_class()(kernels=get_backend().kernels, alibi=settings, **kw),
            flash_attention_class()(kernels=get_backend().kernels, alibi=settings, **kw))


def _check_modules(rank, tp):
    import torch
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(3)]
    grad = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=gen, dtype=torch.float64)
    per = HEADS // tp
    heads = slice(rank * per, (rank + 1) * per)
    local = [t[:, :, heads] for t in full]
    ref_in = [t.clone().requires_grad_() for t in local]
    ref = _reference(*ref_in, slopes(HEADS)[heads])
    ref.backward(grad.reshape(SEQ, BATCH, HEADS, HEAD_DIM)[:, :, heads].reshape(SEQ, BATCH, -1))
    worst = {}
    for name, module in zip(("unfused", "flash"), _attention_modules(tp)):
        ins = [t.float().clone().requires_grad_() for t in local]
        out = module(*ins, attention_mask=None)
        out.backward(grad.reshape(SEQ, BATCH, HEADS, HEAD_DIM)[:, :, heads].reshape(SEQ, BATCH, -1).float())
        worst[name] = max([(out.double() - ref).abs().max().item()]
                          + [(a.grad.double() - b.grad).abs().max().item() for a, b in zip(ins, ref_in)])
    return worst


def _shared_bias(model) -> dict:
    """Whether the model's two attention layers share one bias cache, and one bias tensor in it."""
    first, second = (layer.self_attention.core_attention.alibi for layer in model.decoder.layers)
    device = next(model.parameters()).device
    return dict(one_cache=first.cache is second.cache, entries=len(first.cache),
                one_tensor=first(5, 5, device) is second(5, 5, device))


def _gpt_losses(tp):
    """Megatron-Core's tiny GPT (cpu init: weights independent of TP, fp32, no position embedding) with
    MindSpeed's alibi attention in its spec, unfused and flash: loss after one step's forward, and
    whether its layers share their bias."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from mindspeed.backends import get_backend
    from mindspeed.features.fused import flash_attention as fa
    from mindspeed.training.layer_spec import SpecModules, with_modules
    from tests_extend import megatron_tiny
    megatron_tiny.init_parallel(tp=tp)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=10, kv_channels=8,
                               use_cpu_initialization=True, normalization="RMSNorm", add_bias_linear=False,
                               tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0)
    kernels = get_backend().kernels
    losses, sharing = {}, {}
    for name, spec in (("unfused", fa.core_attention_spec(dict(alibi=_alibi_settings(), kernels=kernels),
                                                          fa.alibi_attention_class())),
                       ("flash", fa.core_attention_spec(dict(alibi=_alibi_settings(), kernels=kernels)))):
        layer = with_modules(get_gpt_layer_local_spec(normalization="RMSNorm"), SpecModules(core_attention=spec))
        __import__("torch").manual_seed(0)
        model = GPTModel(config, layer, vocab_size=megatron_tiny.VOCAB, max_sequence_length=megatron_tiny.SEQ,
                         position_embedding_type="none")
        losses[name] = megatron_tiny.loss_and_grad_norm(model)
        sharing[name] = _shared_bias(model)
    return losses, sharing


def _alibi_settings() -> dict:
    """The run's alibi settings as --position-embedding-type alibi makes them (with their bias cache)."""
    from argparse import Namespace
    from mindspeed.features.fused.flash_attention import alibi_settings
    return alibi_settings(Namespace(position_embedding_type="alibi", alibi_diagonal_opposite=False,
                                    fill_neg_inf=False))


def _body(rank, world_size):
    import mindspeed
    mindspeed.adapt([])
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        worst = _check_modules(rank, 2)
    finally:
        parallel_state.destroy_model_parallel()
    return worst, {"tp1": _gpt_losses(1), "tp2": _gpt_losses(2)}


@pytest.fixture(scope="module")
def launch():
    return run_distributed(_body, world_size=2, timeout=300)


def test_attention_modules_match_fp64_reference_at_tp2(launch):
    """Each rank's 3 of 6 heads (slopes of global heads 0-2, 3-5): fp32 outputs and q/k/v gradients."""
    for worst, _ in launch:
        assert worst["unfused"] < 1e-5 and worst["flash"] < 1e-5, worst


def test_layers_share_one_bias_cache(launch):
    """Both layers of each model hold one cache object; after the forward at one length it holds one
    bias, and both layers get the same tensor for a new length (one copy per run, not per layer)."""
    for _, runs in launch:
        for tp in ("tp1", "tp2"):
            for name, shared in runs[tp][1].items():
                assert shared == dict(one_cache=True, entries=1, one_tensor=True), (tp, name, shared)


def test_tp2_loss_matches_tp1(launch):
    """10 heads (not a power of two), 5 per TP rank: the loss, unfused and flash."""
    for _, runs in launch:
        losses = {tp: runs[tp][0] for tp in runs}
        print(f"\nalibi (loss, grad norm^2): {losses}")
        ref = losses["tp1"]["unfused"]
        for tp in ("tp1", "tp2"):
            for name in ("unfused", "flash"):
                assert abs(losses[tp][name][0] - ref[0]) < 1e-5, (tp, name, losses)
