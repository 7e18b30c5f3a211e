"""Multi-latent attention's core attention without Transformer Engine (backends/torch/mla_standin.py):
Megatron's DotProductAttention and FlashDotProductAttention (--use-flash-attn) with MLA's q/k and v head
sizes, against softmax(scale * Q K^T + causal) V written out, forward and backward in fp32, on one
process and with the heads split over 2 tensor-parallel ranks. The MLA GPT: tests_extend/distributed/test_mla.py."""
import pytest

from tests_extend.distributed.harness import run_distributed

S, B, HEADS, QK, V = 10, 2, 4, 20, 12          # q/k head size 12 + 8 (RoPE part), v head size 12
FP32 = dict(atol=1e-5, rtol=1.3e-6)          # docs/kernels.md's fp32 bound


def _inputs():
    import torch
    g = torch.Generator().manual_seed(5)
    return (torch.randn(S, B, HEADS, QK, generator=g), torch.randn(S, B, HEADS, QK, generator=g),
            torch.randn(S, B, HEADS, V, generator=g), torch.randn(S, B, HEADS * V, generator=g))


DOCUMENTS = [[4, S], [S]]                    # --reset-attention-mask: sample 0 holds two documents


def _reference(q, k, v, scale, documents=None):
    """[s, b, n, d] -> [s, b, n * dv]: causal softmax attention (inside each document), written out."""
    import torch
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    masked = torch.ones(S, S, dtype=torch.bool).triu(1).expand(B, 1, S, S).clone()
    for sample, ends in enumerate(documents or []):
        for start, end in zip([0] + ends[:-1], ends):
            masked[sample, 0, start:end, :start] = True
    scores = scores.masked_fill(masked, float("-inf"))
    out = torch.einsum("bnst,tbnd->sbnd", torch.softmax(scores, -1), v)
    return out.reshape(S, B, -1)


def _config(tp: int, dropout: float = 0.0):
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    return MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=HEADS, tensor_model_parallel_size=tp,
                                q_lora_rank=16, kv_lora_rank=16, qk_head_dim=QK - 8, qk_pos_emb_head_dim=8,
                                v_head_dim=V, attention_dropout=dropout, masked_softmax_fusion=False)


def _core_attention_body(rank, world_size):
    import torch

    import mindspeed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from mindspeed.backends.torch.mla_standin import mla_variant
    from mindspeed.features.fused.flash_attention import flash_attention_class
    from tests_extend import megatron_tiny
    session = mindspeed.adapt([])
    megatron_tiny.init_parallel(tp=world_size)
    heads = slice(rank * HEADS // world_size, (rank + 1) * HEADS // world_size)     # this rank's heads
    q, k, v, cot = _inputs()
    q, k, v = (t[:, :, heads].contiguous() for t in (q, k, v))       # MLA hands them over contiguous
    cot = cot.view(S, B, HEADS, V)[:, :, heads].reshape(S, B, -1)
    out = {}
    for name, cls in (("plain", DotProductAttention), ("flash", flash_attention_class())):
        own = dict(kernels=session.backend.kernels) if name == "flash" else {}    # the run's, as its spec passes
        for scale in (0.37, None):         # MLA's scale (YaRN's mscale in it), or 1/sqrt(q/k head size)
            attention = mla_variant(cls)(config=_config(world_size), layer_number=1, attn_mask_type=AttnMaskType.causal,
                                         attention_type="self", softmax_scale=scale, k_channels=QK, v_channels=V,
                                         **own)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            got = attention(*leaves, None)
            got.backward(cot)
            refs = [t.clone().requires_grad_() for t in (q, k, v)]
            want = _reference(*refs, QK ** -0.5 if scale is None else scale)
            want.backward(cot)
            out[f"{name}/{scale}"] = [(got.detach(), want.detach())] + [(a.grad, b.grad) for a, b in zip(leaves, refs)]
        if name == "flash":    # packed documents: the ends travel as the attention mask (one TND kernel call)
            from mindspeed.features import documents
            ends = torch.tensor(documents.padded_rows(DOCUMENTS), dtype=torch.int32)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            got = attention(*leaves, ends)
            got.backward(cot)
            refs = [t.clone().requires_grad_() for t in (q, k, v)]
            want = _reference(*refs, QK ** -0.5, DOCUMENTS)
            want.backward(cot)
            out["flash/documents"] = [(got.detach(), want.detach())] + [(a.grad, b.grad) for a, b in zip(leaves, refs)]
        # attention dropout (Megatron's RNG tracker in both): drops, and the same seed drops the same
        attention = mla_variant(cls)(config=_config(world_size, dropout=0.5), layer_number=1,
                                     attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=0.37,
                                     k_channels=QK, v_channels=V, **own)
        dropped = []
        for _ in range(2):
            megatron_tiny.init_parallel(tp=world_size)      # reseeds the tracker
            dropped.append(attention(q, k, v, None))
        attention.eval()
        kept = attention(q, k, v, None)
        out[f"{name}/dropout"] = (bool(torch.equal(dropped[0], dropped[1])), float((dropped[0] - kept).abs().max()),
                                  float((kept - _reference(q, k, v, 0.37)).abs().max()))
    mindspeed.unadapt()
    return out


@pytest.fixture(scope="module")
def results():
    one = run_distributed(_core_attention_body, world_size=1, timeout=240)
    two = run_distributed(_core_attention_body, world_size=2, timeout=240)
    return {"tp1": one, "tp2": two}


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
@pytest.mark.parametrize("path", ["plain", "flash"])
@pytest.mark.parametrize("scale", [0.37, None], ids=["mla_scale", "default_scale"])
def test_core_attention_takes_mlas_head_sizes(results, tp, path, scale):
    import torch
    for rank_result in results[tp]:
        for got, want in rank_result[f"{path}/{scale}"]:          # output, then dq, dk, dv
            torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("tp", ["tp1", "tp2"])
def test_flash_attention_keeps_mla_inside_packed_documents(results, tp):
    import torch
    for rank_result in results[tp]:
        for got, want in rank_result["flash/documents"]:
            torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("path", ["plain", "flash"])
def test_attention_dropout_drops_reproducibly(results, path):
    for rank_result in results["tp2"]:
        same_seed_same_drops, dropped_vs_kept, kept_vs_reference = rank_result[f"{path}/dropout"]
        assert same_seed_same_drops and dropped_vs_kept > 1e-2 and kept_vs_reference < 1e-5


def test_only_megatrons_local_attention_is_swapped_and_unadapt_restores_mla():
    import dataclasses

    import mindspeed
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MultiLatentAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from mindspeed.backends.torch.mla_standin import mla_core_attention, mla_variant

    class TakesHeadSizes(DotProductAttention):      # as TE's attention: left as it is
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    spec = ModuleSpec(module=DotProductAttention, params={"sparse_mode": 2})
    swapped = mla_core_attention(spec)
    assert swapped.module is mla_variant(DotProductAttention) and swapped.params == {"sparse_mode": 2}
    assert spec.module is DotProductAttention                      # the shared spec is not changed
    assert mla_core_attention(DotProductAttention) is mla_variant(DotProductAttention)
    assert mla_core_attention(TakesHeadSizes) is TakesHeadSizes
    assert mla_core_attention(mla_variant(DotProductAttention)) is mla_variant(DotProductAttention)
    other = dataclasses.replace(spec, module=object)
    assert mla_core_attention(other) is other
    originals = (MultiLatentAttention.__init__, MLASelfAttention.__init__, MLASelfAttention.get_query_key_value_tensors)
    mindspeed.adapt([])
    try:
        assert MultiLatentAttention.__init__ is not originals[0] and MLASelfAttention.__init__ is not originals[1]
    finally:
        mindspeed.unadapt()
    assert (MultiLatentAttention.__init__, MLASelfAttention.__init__,
            MLASelfAttention.get_query_key_value_tensors) == originals
