"""The reference kernels against independent formulations (fp64), and their input checks."""
import math

import pytest
import torch
import torch.nn.functional as F

from mindspeed.backends.torch.kernels import reference as R
from tests_extend.unit.kernel_checks import run

D64 = torch.float64


def _rand(*shape, seed=0, dtype=D64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_rms_norm_matches_formula_and_returns_fp32_rstd():
    x, g = _rand(3, 4, 16), _rand(16, seed=1)
    y, rstd = R.rms_norm(x, g, 1e-6)
    expect = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    torch.testing.assert_close(y, expect)
    assert rstd.dtype == torch.float32 and rstd.shape == (3, 4, 1)
    with pytest.raises(ValueError, match="gamma has 8 channels"):
        R.rms_norm(x, _rand(8))


def test_swiglu_first_half_is_gated():
    x = _rand(5, 12)
    torch.testing.assert_close(R.swiglu(x), F.silu(x[:, :6]) * x[:, 6:])
    y = _rand(6, 5)
    torch.testing.assert_close(R.swiglu(y, 0), F.silu(y[:3]) * y[3:])
    with pytest.raises(ValueError, match="odd size"):
        R.swiglu(_rand(5, 7))


@pytest.mark.parametrize("mode", [0, 1])
def test_rope_matches_complex_rotation_with_partial_rotary(mode):
    s, d, rot = 6, 12, 8
    x = _rand(s, 2, 3, d)
    theta = _rand(s, 1, 1, rot // 2, seed=3)
    if mode == 0:   # rotate-half: pairs (j, j + rot/2)
        pairs = torch.complex(x[..., :rot // 2], x[..., rot // 2:rot])
        cos, sin = torch.cos(theta).repeat(1, 1, 1, 2), torch.sin(theta).repeat(1, 1, 1, 2)
    else:           # interleaved: pairs (2j, 2j+1)
        pairs = torch.complex(x[..., 0:rot:2], x[..., 1:rot:2])
        cos, sin = torch.cos(theta).repeat_interleave(2, -1), torch.sin(theta).repeat_interleave(2, -1)
    rotated = pairs * torch.exp(1j * theta)
    out = R.rope(x, cos, sin, mode)
    got = torch.complex(out[..., :rot // 2], out[..., rot // 2:rot]) if mode == 0 else \
        torch.complex(out[..., 0:rot:2], out[..., 1:rot:2])
    torch.testing.assert_close(got, rotated)
    assert torch.equal(out[..., rot:], x[..., rot:])          # pass-through channels
    with pytest.raises(ValueError, match="mode must be 0"):
        R.rope(x, cos, sin, 2)


def _sdpa_bnsd(q, k, v, keep=None, causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, is_causal=causal, enable_gqa=True)


@pytest.mark.parametrize("layout", ["SBH", "BSH", "BSND", "BNSD"])
def test_attention_layouts_gqa_and_causal_match_sdpa(layout):
    b, n, nkv, s, d = 2, 4, 2, 10, 8
    q, k, v = _rand(b, n, s, d), _rand(b, nkv, s, d, seed=1), _rand(b, nkv, s, d, seed=2)
    to = {"SBH": lambda t: t.permute(2, 0, 1, 3).flatten(2), "BSH": lambda t: t.permute(0, 2, 1, 3).flatten(2),
          "BSND": lambda t: t.permute(0, 2, 1, 3), "BNSD": lambda t: t}[layout]
    out, mx, sm = R.attention(to(q), to(k), to(v), layout=layout, head_num=n, causal=True)
    torch.testing.assert_close(out, to(_sdpa_bnsd(q, k, v, causal=True)))
    kf = k.repeat_interleave(2, 1)
    scores = (q @ kf.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(mx + sm.log(), torch.logsumexp(scores, -1))
    assert mx.shape == (b, n, s)


@pytest.mark.parametrize("layout", ["SBH", "BSH", "BSND", "BNSD", "TND"])
def test_attention_takes_a_value_head_size_of_its_own(layout):
    """Multi-latent attention: v's head size (6) differs from q's and k's (10); the output has v's."""
    b, n, nkv, s, d, dv = 2, 4, 2, 7, 10, 6
    if layout == "TND":
        b = 1
    q, k, v = _rand(b, n, s, d), _rand(b, nkv, s, d, seed=1), _rand(b, nkv, s, dv, seed=2)
    to = {"SBH": lambda t: t.permute(2, 0, 1, 3).flatten(2), "BSH": lambda t: t.permute(0, 2, 1, 3).flatten(2),
          "BSND": lambda t: t.permute(0, 2, 1, 3), "BNSD": lambda t: t, "TND": lambda t: t[0].transpose(0, 1)}[layout]
    seqs = dict(actual_seq_qlen=[s], actual_seq_kvlen=[s]) if layout == "TND" else {}
    out, _, _ = R.attention(to(q), to(k), to(v), layout=layout, head_num=n, causal=True, **seqs)
    torch.testing.assert_close(out, to(_sdpa_bnsd(q, k, v, causal=True)))
    with pytest.raises(ValueError, match="not a multiple of the 2 key/value heads"):
        R.attention(_rand(s, b, n * d), _rand(s, b, nkv * d), _rand(s, b, 7), layout="SBH", head_num=n)


def test_attention_mask_band_alibi_and_top_left_causal():
    b, n, sq, skv, d = 1, 2, 6, 9, 4
    q, k, v = _rand(b, n, sq, d), _rand(b, n, skv, d, seed=1), _rand(b, n, skv, d, seed=2)
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None]
    out, _, _ = R.attention(q, k, v, layout="BNSD", head_num=n, causal=True)     # top-left: j <= i
    torch.testing.assert_close(out, _sdpa_bnsd(q, k, v, keep=j <= i))
    out, _, _ = R.attention(q, k, v, layout="BNSD", head_num=n, pre_tokens=1, next_tokens=2)
    torch.testing.assert_close(out, _sdpa_bnsd(q, k, v, keep=(j >= i - 1) & (j <= i + 2)))
    mask = _rand(sq, skv, seed=5) > 0.5
    mask[:, 0] = False
    alibi = _rand(1, n, sq, skv, seed=6)
    out, _, _ = R.attention(q, k, v, layout="BNSD", head_num=n, mask=mask, alibi=alibi)
    bias = alibi.masked_fill(mask, float("-inf"))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


def test_attention_fully_masked_rows_give_zero_and_empty_stats():
    q = _rand(1, 1, 3, 4)
    mask = torch.zeros(3, 3, dtype=torch.bool)
    mask[1] = True
    out, mx, sm = R.attention(q, q, q, layout="BNSD", head_num=1, mask=mask)
    assert torch.all(out[0, 0, 1] == 0) and mx[0, 0, 1] == float("-inf") and sm[0, 0, 1] == 0


def test_attention_tnd_is_per_sequence():
    n, d = 2, 4
    t = _rand(7, n, d)
    out, mx, _ = R.attention(t, t, t, layout="TND", head_num=n, causal=True, actual_seq_qlen=[3, 7],
                             actual_seq_kvlen=[3, 7])
    for s, e in [(0, 3), (3, 7)]:
        seg = t[s:e].transpose(0, 1)[None]
        torch.testing.assert_close(out[s:e], _sdpa_bnsd(seg, seg, seg, causal=True)[0].transpose(0, 1))
    assert mx.shape == (7, n)
    with pytest.raises(ValueError, match="cumulative ends"):
        R.attention(t, t, t, layout="TND", head_num=n, actual_seq_qlen=[3, 8], actual_seq_kvlen=[3, 8])


def test_attention_rejects_bad_input_before_work():
    q = _rand(4, 2, 8)
    with pytest.raises(ValueError, match="unknown attention layout"):
        R.attention(q, q, q, layout="SBND", head_num=2)
    with pytest.raises(ValueError, match="head_num 3 must divide"):
        R.attention(q, q, q, layout="SBH", head_num=3)
    with pytest.raises(ValueError, match="not a multiple"):
        R.attention(_rand(4, 2, 12), _rand(4, 2, 8), _rand(4, 2, 8), layout="SBH", head_num=3)
    with pytest.raises(ValueError, match="dropout_p"):
        R.attention(q, q, q, layout="SBH", head_num=2, dropout_p=1.0)


def test_ring_update_of_two_key_blocks_equals_full_attention_forward_and_backward():
    s, b, n, d = 6, 2, 2, 4
    q, k, v = _rand(s, b, n * d), _rand(2 * s, b, n * d, seed=1), _rand(2 * s, b, n * d, seed=2)

    def merged(q, k, v):
        a = R.attention(q, k[:s], v[:s], layout="SBH", head_num=n)
        c = R.attention(q, k[s:], v[s:], layout="SBH", head_num=n)
        out, mx, sm = R.ring_attention_update(*a, *c)
        return out, mx + sm.log()

    def full(q, k, v):
        out, mx, sm = R.attention(q, k, v, layout="SBH", head_num=n)
        return out, mx + sm.log()

    (o1, l1), g1 = run(merged, [q, k, v], n_out=2)
    (o2, l2), g2 = run(full, [q, k, v], n_out=2)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)
    for a, c in zip(g1, g2):
        torch.testing.assert_close(a, c)


def test_ring_update_with_an_empty_block_keeps_the_other():
    out = _rand(3, 1, 4)
    mx, sm = _rand(1, 2, 3, seed=1), _rand(1, 2, 3, seed=2).abs()
    empty = (torch.zeros_like(out), torch.full_like(mx, float("-inf")), torch.zeros_like(sm))
    o, m, l = R.ring_attention_update(out, mx, sm, *empty)
    torch.testing.assert_close(o, out)
    o, m, l = R.ring_attention_update(*empty, *empty)
    assert torch.all(o == 0) and torch.all(l == 0)


@pytest.mark.parametrize("list_type", [0, 1])
def test_gmm_with_empty_groups_forward_and_backward(list_type):
    sizes = [3, 0, 4, 0]
    x, w = _rand(7, 5), _rand(4, 5, 6, seed=1)
    group_list = sizes if list_type == 1 else list(torch.tensor(sizes).cumsum(0).tolist())
    (out,), (dx, dw) = run(lambda x, w: R.gmm(x, w, group_list, list_type), [x, w])
    torch.testing.assert_close(out[:3], x[:3] @ w[0])
    torch.testing.assert_close(out[3:], x[3:] @ w[2])
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(D64)   # run()'s cotangent
    torch.testing.assert_close(dx[:3], dy[:3] @ w[0].t())
    torch.testing.assert_close(dw[2], x[3:].t() @ dy[3:])
    assert torch.all(dw[1] == 0) and torch.all(dw[3] == 0)
    with pytest.raises(ValueError, match="not a valid split"):
        R.gmm(x, w, [3, 2, 9, 9] if list_type == 0 else [3, 0, 9, 0], list_type)


def test_matmul_add_fp32_accumulates_in_place():
    x, dy = _rand(2, 3, 4, dtype=torch.float32), _rand(2, 3, 5, seed=1, dtype=torch.float32)
    main_grad = torch.ones(5, 4)
    out = R.matmul_add_fp32(x, dy, main_grad)
    assert out is main_grad
    torch.testing.assert_close(main_grad, 1 + dy.reshape(6, 5).t() @ x.reshape(6, 4))
    with pytest.raises(ValueError, match="must be float32"):
        R.matmul_add_fp32(x, dy, torch.zeros(5, 4, dtype=torch.bfloat16))


def test_moe_permute_unpermute_roundtrip_is_exact():
    tokens = _rand(6, 4, dtype=torch.bfloat16)
    top1 = torch.zeros(6, 3, dtype=torch.bool)
    top1[torch.arange(6), torch.tensor([2, 0, 1, 0, 2, 2])] = True
    permuted, idx = R.moe_permute(tokens, top1)
    assert idx.tolist() == [1, 3, 2, 0, 4, 5]                      # expert-major, token order within
    back = R.moe_unpermute(permuted, idx, torch.ones(6, 3), tokens.shape, routing_map=top1)
    assert torch.equal(back, tokens)
    top2 = top1.clone()
    top2[:, 1] = True
    permuted, idx = R.moe_permute(tokens, top2)
    copies = top2.sum(1, keepdim=True)                              # each routed copy adds back
    assert torch.equal(R.moe_unpermute(permuted, idx, None, tokens.shape), (tokens.float() * copies).to(tokens.dtype))
    with pytest.raises(ValueError, match="need the routing_map"):
        R.moe_unpermute(permuted, idx, torch.ones(6, 3), tokens.shape)


def test_dropout_add_layer_norm_without_dropout_is_layer_norm_of_sum():
    x0, res, w, bias = _rand(3, 8), _rand(3, 8, seed=1), _rand(8, seed=2), _rand(8, seed=3)
    out, z, mask = R.dropout_add_layer_norm(x0, res, w, bias, 0.0, 1e-5, prenorm=True)
    torch.testing.assert_close(z, x0 + res)
    torch.testing.assert_close(out, F.layer_norm(x0 + res, (8,), w, bias, 1e-5))
    assert mask is None


def test_npu_mapping_gives_an_unequal_value_head_size_one_size_for_the_kernel(monkeypatch):
    """kernels/npu.py on a stand-in torch_npu whose npu_fusion_attention takes one head size for q, k and v
    (the reference behind it): v (or q and k) padded with zero channels, the output cut back, results
    and gradients the reference's, in a packed, a named and the TND layout."""
    import sys
    import types
    seen = []

    def npu_fusion_attention(q, k, v, head_num, layout, pse=None, atten_mask=None, scale=1.0, keep_prob=1.0,
                             pre_tockens=0, next_tockens=0, sparse_mode=0, actual_seq_qlen=None, actual_seq_kvlen=None):
        seen.append(k.shape == v.shape)
        out, mx, sm = R.attention(q, k, v, layout=layout, head_num=head_num, scale=scale, causal=sparse_mode == 2,
                                  mask=None if sparse_mode == 2 else atten_mask, actual_seq_qlen=actual_seq_qlen,
                                  actual_seq_kvlen=actual_seq_kvlen)
        eight = lambda t: t.unsqueeze(-1).expand(*t.shape, 8)
        return out, eight(mx), eight(sm), None, 0, 0, 0

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=npu_fusion_attention))
    monkeypatch.delitem(sys.modules, "mindspeed.backends.torch.kernels.npu", raising=False)
    from mindspeed.backends.torch.kernels import npu as N
    monkeypatch.delitem(sys.modules, "mindspeed.backends.torch.kernels.npu")   # not left bound to the stand-in
    cases = {"SBH": ((6, 2, 4 * 20), (6, 2, 2 * 20), (6, 2, 2 * 12), {}),
             "BNSD": ((2, 4, 6, 12), (2, 2, 6, 12), (2, 2, 6, 20), {}),
             "TND": ((6, 4, 20), (6, 4, 20), (6, 4, 12), dict(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6]))}
    for layout, (qs, ks, vs, seqs) in cases.items():
        inputs = [_rand(*qs), _rand(*ks, seed=1), _rand(*vs, seed=2)]
        results = []
        for attention in (N.attention, R.attention):
            leaves = [t.clone().requires_grad_() for t in inputs]
            out, mx, sm = attention(*leaves, layout=layout, head_num=4, causal=True, scale=0.3, **seqs)
            (out * _rand(*out.shape, seed=3)).sum().backward()
            results.append([out, mx, sm] + [t.grad for t in leaves])
        for got, want in zip(*results):
            torch.testing.assert_close(got, want)
    assert seen == [True] * 3
