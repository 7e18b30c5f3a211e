"""Upstream's op modules (mindspeed.ops.<module>, as upstream's docs/ops pages import them): forward
and backward against plain torch written here, on torch tensors and, where noted, MindSpore tensors;
fp32 at docs/kernels.md tolerances (atol 1e-5, rtol 1.3e-6), fp64 at assert_close's defaults."""
import importlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

FP32 = dict(atol=1e-5, rtol=1.3e-6)


def _rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _grads(fn, inputs, dy_seed=99):
    """fn(*inputs) (first output) and the gradients of sum(out * dy) w.r.t. every input."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    (out * _rand(*out.shape, seed=dy_seed, dtype=out.dtype)).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _assert_same_grads(fn, reference, inputs, **tol):
    out, grads = _grads(fn, inputs)
    ref_out, ref_grads = _grads(reference, inputs)
    torch.testing.assert_close(out, ref_out, **tol)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        torch.testing.assert_close(g, r, **tol, msg=lambda m: f"gradient of input {i}: {m}")


@pytest.mark.parametrize("module,names", [
    ("gmm", ["npu_gmm", "npu_gmm_v2"]),
    ("npu_matmul_add", ["npu_matmul_add_fp32"]),
    ("npu_groupmatmul_add", ["npu_groupmatmul_add_fp32"]),
    ("npu_rotary_position_embedding", ["npu_rotary_position_embedding"]),
    ("npu_ring_attention_update", ["npu_ring_attention_update"]),
    ("fusion_attention_v2", ["npu_fusion_attention"]),
    ("npu_moe_token_permute", ["npu_moe_token_permute"]),
    ("npu_moe_token_unpermute", ["npu_moe_token_unpermute"]),
    ("npu_fused_moe_token_permute", ["npu_moe_token_permute"]),
    ("npu_fused_moe_token_unpermute", ["npu_moe_token_unpermute"]),
])
def test_each_module_imports_as_upstream_documents(module, names):
    mod = importlib.import_module(f"mindspeed.ops.{module}")
    assert mod.__doc__ and sorted(mod.__all__) == sorted(names)
    assert all(callable(getattr(mod, name)) for name in names)


def test_importing_a_module_keeps_the_flat_op_of_the_same_name():
    from mindspeed import ops
    from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute   # noqa: F401
    from mindspeed.ops.npu_ring_attention_update import npu_ring_attention_update  # noqa: F401
    tokens, routing = _rand(3, 2), torch.tensor([[1, 0], [1, 1], [0, 1]], dtype=torch.bool)
    permuted, idx = ops.npu_moe_token_permute(tokens, routing)                # the flat op: a routing map
    assert idx.tolist() == [0, 1, 1, 2] and torch.equal(permuted, tokens[[0, 1, 1, 2]])
    assert callable(ops.npu_ring_attention_update) and callable(ops.npu_moe_token_unpermute)


# -- gmm ----------------------------------------------------------------------------------------------
def _gmm_reference(x, w, sizes, bias=None):
    rows, start = [], 0
    for g, size in enumerate(sizes):
        rows.append(x[start:start + size] @ w[g] + (0 if bias is None else bias[g]))
        start += size
    rows.append(x[start:] @ w[0] * 0)                                          # rows past the last group
    return torch.cat(rows)


@pytest.mark.parametrize("version,group_list", [("npu_gmm", [2, 2, 6]), ("npu_gmm", torch.tensor([2, 2, 6])),
                                                ("npu_gmm_v2", torch.tensor([2, 0, 4]))],
                         ids=["v1_list", "v1_tensor", "v2_sizes"])
def test_gmm_forward_backward_with_bias(version, group_list):
    from mindspeed.ops import gmm
    op = getattr(gmm, version)
    x, w, bias = _rand(7, 3), _rand(3, 3, 4, seed=1), _rand(3, 4, seed=2)
    _assert_same_grads(lambda a, b, c: op(a, b, bias=c, group_list=group_list),
                       lambda a, b, c: _gmm_reference(a, b, [2, 0, 4], c), [x, w, bias])


def test_gmm_fp32_without_bias():
    from mindspeed.ops.gmm import npu_gmm
    x, w = _rand(8, 16, dtype=torch.float32), _rand(2, 16, 5, seed=1, dtype=torch.float32)
    _assert_same_grads(lambda a, b: npu_gmm(a, b, group_list=[3, 8]),
                       lambda a, b: _gmm_reference(a, b, [3, 5]), [x, w], **FP32)


def test_gmm_rejects_bad_arguments():
    from mindspeed.ops.gmm import npu_gmm, npu_gmm_v2
    x, w = _rand(4, 2), _rand(2, 2, 3)
    with pytest.raises(ValueError, match="npu_gmm_v2: group_list must be a 1-d integer tensor"):
        npu_gmm_v2(x, w, group_list=[2, 2])
    with pytest.raises(ValueError, match="1-d integer tensor"):
        npu_gmm(x, w, group_list=torch.tensor([2.0, 4.0]))
    with pytest.raises(ValueError, match="only group_type 0"):
        npu_gmm(x, w, group_list=[2, 4], group_type=2)
    with pytest.raises(ValueError, match="group_list is required"):
        npu_gmm(x, w)
    with pytest.raises(ValueError, match="gemm_fusion"):
        npu_gmm(x, w, group_list=[2, 4], gemm_fusion=True)
    with pytest.raises(ValueError, match="not a valid split"):
        npu_gmm(x, w, group_list=[3, 2])
    with pytest.raises(ValueError, match=r"bias must be \[G, N\]"):
        npu_gmm(x, w, group_list=[2, 4], bias=_rand(3, 3))


# -- matmul-add into main_grad ------------------------------------------------------------------------
def test_npu_matmul_add_fp32_accumulates_in_place():
    from mindspeed.ops.npu_matmul_add import npu_matmul_add_fp32
    x, dy = _rand(2, 5, 6, dtype=torch.float32), _rand(2, 5, 4, seed=1, dtype=torch.float32)
    grad = _rand(4, 6, seed=2, dtype=torch.float32)
    expected = grad + dy.reshape(-1, 4).t() @ x.reshape(-1, 6)
    assert npu_matmul_add_fp32(x, dy, grad) is grad
    torch.testing.assert_close(grad, expected, **FP32)


@pytest.mark.parametrize("grad_shape", [(3 * 6, 4), (3, 6, 4)], ids=["flat_main_grad", "grouped_main_grad"])
def test_npu_groupmatmul_add_fp32_adds_each_groups_weight_gradient(grad_shape):
    from mindspeed.ops.npu_groupmatmul_add import npu_groupmatmul_add_fp32
    x, dy = _rand(9, 6, dtype=torch.float32), _rand(9, 4, seed=1, dtype=torch.float32)
    grad = _rand(*grad_shape, seed=2, dtype=torch.float32)
    bounds = [(0, 3), (3, 3), (3, 8)]                                          # group 1 empty, row 8 in none
    expected = grad.reshape(3, 6, 4) + torch.stack([x[a:b].t() @ dy[a:b] for a, b in bounds])
    assert npu_groupmatmul_add_fp32(x, dy, torch.tensor([3, 3, 8]), grad) is grad
    torch.testing.assert_close(grad.reshape(3, 6, 4), expected, **FP32)


def test_npu_groupmatmul_add_fp32_is_gmms_weight_gradient():
    """What upstream's page checks: the fused add equals main_grad plus gmm's backward for weight."""
    from mindspeed.ops.gmm import npu_gmm
    from mindspeed.ops.npu_groupmatmul_add import npu_groupmatmul_add_fp32
    x, w, dy = (_rand(*s, seed=i, dtype=torch.float32) for i, s in enumerate([(8, 6), (2, 6, 4), (8, 4)]))
    w.requires_grad_(True)
    npu_gmm(x, w, group_list=[5, 8]).backward(dy)
    main_grad = torch.ones(2 * 6, 4)
    npu_groupmatmul_add_fp32(x, dy, torch.tensor([5, 8]), main_grad)
    torch.testing.assert_close(main_grad, 1 + w.grad.reshape(12, 4), **FP32)


def test_npu_groupmatmul_add_fp32_rejects_a_main_grad_of_the_wrong_size():
    from mindspeed.ops.npu_groupmatmul_add import npu_groupmatmul_add_fp32
    with pytest.raises(ValueError, match=r"does not hold \[2, 6, 4\]"):
        npu_groupmatmul_add_fp32(_rand(8, 6), _rand(8, 4), torch.tensor([5, 8]), torch.zeros(6, 4))
    with pytest.raises(ValueError, match="must be float32"):
        npu_groupmatmul_add_fp32(_rand(8, 6), _rand(8, 4), torch.tensor([5, 8]), torch.zeros(12, 4, dtype=torch.float64))


# -- rotary embedding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [0, 1])
def test_npu_rotary_position_embedding_forward_backward(mode):
    from mindspeed.ops.npu_rotary_position_embedding import npu_rotary_position_embedding

    def reference(x, cos, sin):
        if mode == 0:
            x1, x2 = x.chunk(2, -1)
            rotated = torch.cat((-x2, x1), -1)
        else:
            rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        return x * cos + rotated * sin
    x = _rand(2, 5, 3, 8)                                                      # BSND, cos/sin 1S1D
    angle = _rand(1, 5, 1, 8, seed=1)
    _assert_same_grads(lambda a, c, s: npu_rotary_position_embedding(a, c, s, mode), reference,
                       [x, angle.cos(), angle.sin()])


# -- ring attention update ----------------------------------------------------------------------------
def _block(q, k, v):
    """One key block's partial attention: out SBH [s, b, n*d], stats [b, n, s, 8] as Ascend keeps them."""
    scores = q @ k.transpose(-1, -2)
    mx = scores.amax(-1)
    p = torch.exp(scores - mx[..., None])
    out = (p / p.sum(-1, keepdim=True)) @ v
    b, n, s, d = out.shape
    repeat8 = lambda t: t[..., None].repeat(1, 1, 1, 8)
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d), repeat8(mx), repeat8(p.sum(-1))


def test_npu_ring_attention_update_merges_two_blocks_into_attention_over_both():
    from mindspeed.ops.npu_ring_attention_update import npu_ring_attention_update
    q = _rand(2, 3, 4, 5)
    k1, v1, k2, v2 = (_rand(2, 3, 6, 5, seed=i) for i in (1, 2, 3, 4))

    def merged(q, k1, v1, k2, v2):
        return npu_ring_attention_update(*_block(q, k1, v1), *_block(q, k2, v2))

    def whole(q, k1, v1, k2, v2):
        out = torch.softmax(q @ torch.cat([k1, k2], 2).transpose(-1, -2), -1) @ torch.cat([v1, v2], 2)
        return out.permute(2, 0, 1, 3).reshape(4, 2, 15)
    _assert_same_grads(merged, whole, [q, k1, v1, k2, v2])
    out, mx, sm = merged(q, k1, v1, k2, v2)
    scores = q @ torch.cat([k1, k2], 2).transpose(-1, -2)
    assert mx.shape == sm.shape == (2, 3, 4, 8)
    torch.testing.assert_close(mx, scores.amax(-1)[..., None].expand(2, 3, 4, 8))
    torch.testing.assert_close(sm, torch.exp(scores - scores.amax(-1, keepdim=True)).sum(-1)[..., None].expand(2, 3, 4, 8))


def test_npu_ring_attention_update_tnd_and_bad_statistics():
    from mindspeed.ops.npu_ring_attention_update import npu_ring_attention_update
    t, n, d = 5, 2, 3
    outs = [_rand(t, n, d, seed=i) for i in (0, 1)]
    maxes, sums = [_rand(t, n, 1, seed=i).expand(t, n, 8) for i in (2, 3)], [_rand(t, n, 1, seed=i).exp().expand(t, n, 8) for i in (4, 5)]
    out, mx, sm = npu_ring_attention_update(outs[0], maxes[0], sums[0], outs[1], maxes[1], sums[1],
                                            actual_seq_qlen=torch.tensor([2, 5]), layout="TND")
    m = torch.maximum(maxes[0], maxes[1])
    wp, wc = sums[0] * torch.exp(maxes[0] - m), sums[1] * torch.exp(maxes[1] - m)
    torch.testing.assert_close(out, (outs[0] * wp[..., :1] + outs[1] * wc[..., :1]) / (wp + wc)[..., :1])
    torch.testing.assert_close(sm, wp + wc)
    with pytest.raises(ValueError, match=r"\[b, n, s, 8\]"):
        npu_ring_attention_update(outs[0], maxes[0][..., 0], sums[0][..., 0], outs[1], maxes[1][..., 0],
                                  sums[1][..., 0], layout="TND")
    with pytest.raises(ValueError, match="only meaningful with layout TND"):
        npu_ring_attention_update(*_block(_rand(1, 1, 2, 2), _rand(1, 1, 2, 2), _rand(1, 1, 2, 2)),
                                  *_block(_rand(1, 1, 2, 2), _rand(1, 1, 2, 2), _rand(1, 1, 2, 2)),
                                  actual_seq_qlen=[2])


# -- fusion attention v2 ------------------------------------------------------------------------------
@pytest.mark.parametrize("pse_type", [0, 1])
def test_fusion_attention_v2_forward_backward_and_seven_results(pse_type):
    from mindspeed.ops.fusion_attention_v2 import npu_fusion_attention
    b, n, s, d, scale = 1, 2, 5, 4, 0.3
    q, k, v, pse = _rand(b, n, s, d), _rand(b, n, s, d, seed=1), _rand(b, n, s, d, seed=2), _rand(1, n, s, s, seed=3)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)                         # True = masked out

    def fused(q, k, v, pse):
        return npu_fusion_attention(q, k, v, n, "BNSD", pse=pse, atten_mask=causal, scale=scale,
                                    sparse_mode=2, pse_type=pse_type)[0]

    def reference(q, k, v, pse):
        scores = scale * (pse + q @ k.transpose(-1, -2)) if pse_type == 1 else scale * q @ k.transpose(-1, -2) + pse
        return torch.softmax(scores.masked_fill(causal, float("-inf")), -1) @ v
    _assert_same_grads(fused, reference, [q, k, v, pse])
    result = npu_fusion_attention(q, k, v, n, "BNSD", scale=scale)
    assert len(result) == 7 and result[1].shape == result[2].shape == (b, n, s, 8) and result[3:] == (None, 0, 0, 0)
    scores = scale * q @ k.transpose(-1, -2)
    torch.testing.assert_close(result[1][..., 3], scores.amax(-1))


def test_fusion_attention_v2_refuses_what_it_does_not_compute():
    from mindspeed.ops.fusion_attention_v2 import npu_fusion_attention
    q = _rand(1, 1, 2, 2)
    with pytest.raises(ValueError, match="pse_type 2"):
        npu_fusion_attention(q, q, q, 1, "BNSD", pse_type=2)
    with pytest.raises(ValueError, match="padding_mask"):
        npu_fusion_attention(q, q, q, 1, "BNSD", padding_mask=q)
    with pytest.raises(ValueError, match="sparse_mode 7"):
        npu_fusion_attention(q, q, q, 1, "BNSD", sparse_mode=7)


# -- MoE permute / unpermute from top-k indices ---------------------------------------------------------
def _permute_reference(tokens, indices, num_out_tokens=None):
    """Upstream's page: a stable argsort of the flattened experts; sorted_indices = its inverse."""
    topk = indices.shape[1]
    order = torch.argsort(indices.reshape(-1), stable=True)
    kept = order if num_out_tokens is None else order[:num_out_tokens]
    return tokens.index_select(0, kept // topk), torch.argsort(order, stable=True)


def _unpermute_reference(permuted, sorted_indices, probs):
    rows = torch.cat([permuted, permuted.new_zeros(sorted_indices.numel() - permuted.shape[0], permuted.shape[1])])
    per_slot = rows[sorted_indices.long()].reshape(probs.shape[0], probs.shape[1], -1)
    return (per_slot * probs[..., None]).sum(1)


UPSTREAM_TOKENS = torch.tensor([[1., 1, 1], [2, 2, 2], [3, 3, 3], [0, 0, 0]], dtype=torch.float64)
UPSTREAM_INDICES = torch.tensor([[0, 4], [4, 3], [4, 2], [1, 1]])


def test_permute_on_upstreams_example():
    from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute
    permuted, sorted_indices = npu_moe_token_permute(UPSTREAM_TOKENS, UPSTREAM_INDICES, UPSTREAM_INDICES.numel())
    assert permuted[:, 0].tolist() == [1, 0, 0, 3, 2, 1, 2, 3]              # upstream test's permuted rows
    assert sorted_indices.dtype == torch.int32 and sorted_indices.tolist() == [0, 5, 6, 4, 7, 3, 1, 2]


@pytest.mark.parametrize("num_out_tokens", [None, 9, -4], ids=["all", "capacity", "drop_negative"])
def test_permute_unpermute_forward_backward(num_out_tokens):
    from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute
    g = torch.Generator().manual_seed(5)
    indices = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(6)])     # [T 6, topk 3], E 5
    tokens, probs = _rand(6, 4), _rand(6, 3, seed=1).softmax(-1)
    kept = {None: None, 9: 9, -4: 14}[num_out_tokens]
    _assert_same_grads(lambda t: npu_moe_token_permute(t, indices, num_out_tokens)[0],
                       lambda t: _permute_reference(t, indices, kept)[0], [tokens])
    permuted, sorted_indices = npu_moe_token_permute(tokens, indices, num_out_tokens)
    assert torch.equal(sorted_indices.long(), _permute_reference(tokens, indices)[1])
    _assert_same_grads(lambda p, pr: npu_moe_token_unpermute(p, sorted_indices, pr),
                       lambda p, pr: _unpermute_reference(p, sorted_indices, pr), [permuted, probs])


def test_permute_then_unpermute_with_probs_summing_to_one_restores_the_tokens():
    from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute
    permuted, sorted_indices = npu_moe_token_permute(UPSTREAM_TOKENS, UPSTREAM_INDICES)
    restored = npu_moe_token_unpermute(permuted, sorted_indices, torch.full((4, 2), 0.5, dtype=torch.float64))
    torch.testing.assert_close(restored, UPSTREAM_TOKENS)
    top1, idx1 = npu_moe_token_permute(UPSTREAM_TOKENS, UPSTREAM_INDICES[:, 0])              # indices [T]
    assert torch.equal(npu_moe_token_unpermute(top1, idx1), UPSTREAM_TOKENS)


def test_permute_unpermute_reject_bad_arguments():
    from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute
    with pytest.raises(ValueError, match="padded_mode is not supported"):
        npu_moe_token_permute(UPSTREAM_TOKENS, UPSTREAM_INDICES, padded_mode=True)
    with pytest.raises(ValueError, match=r"indices \[T\] or \[T, topk\]"):
        npu_moe_token_permute(UPSTREAM_TOKENS, UPSTREAM_INDICES[:3])
    with pytest.raises(ValueError, match="drops more than"):
        npu_moe_token_permute(UPSTREAM_TOKENS, UPSTREAM_INDICES, -9)
    permuted, sorted_indices = npu_moe_token_permute(UPSTREAM_TOKENS, UPSTREAM_INDICES)
    with pytest.raises(ValueError, match=r"probs must be \[T, topk\]"):
        npu_moe_token_unpermute(permuted, sorted_indices, torch.ones(4, 3))
    with pytest.raises(ValueError, match="padded_mode is not supported"):
        npu_moe_token_unpermute(permuted, sorted_indices, padded_mode=True)


# -- the same modules on MindSpore tensors ---------------------------------------------------------------
def _ms():
    return pytest.importorskip("mindspore")


def _ms_grads(fn, arrays, dy_seed=99):
    """fn on MindSpore tensors: first output and gradients of sum(out * dy), as numpy."""
    ms = _ms()
    inputs = [ms.Tensor(a) for a in arrays]
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    dy = ms.Tensor(_rand(*out.shape, seed=dy_seed, dtype=torch.float32).numpy())
    grads = ms.grad(lambda *a: ((fn(*a)[0] if isinstance(fn(*a), tuple) else fn(*a)) * dy).sum(),
                    grad_position=tuple(range(len(inputs))))(*inputs)
    grads = grads if isinstance(grads, tuple) else (grads,)
    return out.asnumpy(), [g.asnumpy() for g in grads]


def _assert_ms_matches_torch(ms_fn, torch_fn, arrays):
    out, grads = _ms_grads(ms_fn, arrays)
    ref_out, ref_grads = _grads(torch_fn, [torch.tensor(a) for a in arrays])
    np.testing.assert_allclose(out, ref_out.numpy(), **FP32)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        np.testing.assert_allclose(g, r.numpy(), **FP32, err_msg=f"gradient of input {i}")


def _f32(*shape, seed=0):
    return _rand(*shape, seed=seed, dtype=torch.float32).numpy()


def test_mindspore_gmm_v2_with_bias():
    ms = _ms()
    from mindspeed.ops.gmm import npu_gmm_v2
    sizes = ms.Tensor(np.array([2, 0, 4], np.int64))
    _assert_ms_matches_torch(lambda a, b, c: npu_gmm_v2(a, b, bias=c, group_list=sizes),
                             lambda a, b, c: _gmm_reference(a, b, [2, 0, 4], c), [_f32(7, 3), _f32(3, 3, 4, seed=1),
                                                                               _f32(3, 4, seed=2)])


def test_mindspore_groupmatmul_add_and_matmul_add_in_place():
    ms = _ms()
    from mindspeed.ops.npu_groupmatmul_add import npu_groupmatmul_add_fp32
    from mindspeed.ops.npu_matmul_add import npu_matmul_add_fp32
    x, dy, base = _f32(9, 6), _f32(9, 4, seed=1), _f32(18, 4, seed=2)
    grad = ms.Tensor(base.copy())
    assert npu_groupmatmul_add_fp32(ms.Tensor(x), ms.Tensor(dy), ms.Tensor(np.array([3, 3, 8])), grad) is grad
    expected = base.reshape(3, 6, 4) + np.stack([x[a:b].T @ dy[a:b] for a, b in [(0, 3), (3, 3), (3, 8)]])
    np.testing.assert_allclose(grad.asnumpy().reshape(3, 6, 4), expected, **FP32)
    main_grad = ms.Tensor(_f32(4, 6, seed=3))
    npu_matmul_add_fp32(ms.Tensor(x), ms.Tensor(dy), main_grad)
    np.testing.assert_allclose(main_grad.asnumpy(), _f32(4, 6, seed=3) + dy.T @ x, **FP32)


def test_mindspore_rope_and_ring_update():
    _ms()
    from mindspeed.ops.npu_ring_attention_update import npu_ring_attention_update
    from mindspeed.ops.npu_rotary_position_embedding import npu_rotary_position_embedding
    angle = _f32(1, 5, 1, 8, seed=1)
    cos, sin = np.cos(angle), np.sin(angle)
    torch_rope = lambda x, c, s: x * c + torch.cat((-x[..., 4:], x[..., :4]), -1) * s
    _assert_ms_matches_torch(npu_rotary_position_embedding, torch_rope, [_f32(2, 5, 3, 8), cos, sin])
    blocks = [t.float().numpy() for seed in (1, 3) for t in _block(_rand(2, 3, 4, 5), _rand(2, 3, 6, 5, seed=seed),
                                                                     _rand(2, 3, 6, 5, seed=seed + 1))]

    def torch_merge(po, pm, ps, co, cm, cs):
        m = torch.maximum(pm, cm)
        wp, wc = ps * torch.exp(pm - m), cs * torch.exp(cm - m)
        per_row = lambda w: w[..., 0].permute(2, 0, 1).repeat_interleave(5, -1)        # [b, n, s] -> [s, b, n*d]
        return (po * per_row(wp) + co * per_row(wc)) / per_row(wp + wc)
    _assert_ms_matches_torch(npu_ring_attention_update, torch_merge, blocks)


def test_mindspore_fusion_attention_v2():
    _ms()
    from mindspeed.ops.fusion_attention_v2 import npu_fusion_attention
    scale = 0.4
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    _assert_ms_matches_torch(
        lambda q, k, v: npu_fusion_attention(q, k, v, 2, "BNSD", scale=scale, sparse_mode=2)[0],
        lambda q, k, v: torch.softmax((scale * q @ k.transpose(-1, -2)).masked_fill(causal, float("-inf")), -1) @ v,
        [_f32(1, 2, 5, 4), _f32(1, 2, 5, 4, seed=1), _f32(1, 2, 5, 4, seed=2)])


def test_mindspore_permute_unpermute():
    ms = _ms()
    from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute
    from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute
    indices = ms.Tensor(UPSTREAM_INDICES.numpy())
    _assert_ms_matches_torch(lambda t: npu_moe_token_permute(t, indices, 6)[0],
                             lambda t: _permute_reference(t, UPSTREAM_INDICES, 6)[0], [_f32(4, 3)])
    _, sorted_indices = npu_moe_token_permute(ms.Tensor(_f32(4, 3)), indices, 6)
    ref_sorted = _permute_reference(torch.zeros(4, 3), UPSTREAM_INDICES)[1]
    assert sorted_indices.asnumpy().tolist() == ref_sorted.tolist()
    torch_sorted = torch.tensor(sorted_indices.asnumpy())
    _assert_ms_matches_torch(lambda p, pr: npu_moe_token_unpermute(p, sorted_indices, pr),
                             lambda p, pr: _unpermute_reference(p, torch_sorted, pr), [_f32(6, 3), _f32(4, 2, seed=1)])
