"""mindspeed.ops: the public op API dispatches to the active backend with npu-style arguments."""
import pytest
import torch
import torch.nn.functional as F

from mindspeed import ops
from mindspeed.backends.torch.kernels import reference as R


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_norm_activation_rope_match_the_reference():
    x, g = _rand(3, 16), _rand(16, seed=1)
    torch.testing.assert_close(ops.rms_norm(x, g, 1e-6)[0], R.rms_norm(x, g, 1e-6)[0])
    torch.testing.assert_close(ops.swiglu(x), R.swiglu(x))
    cos, sin = _rand(3, 8, seed=2).cos(), _rand(3, 8, seed=2).sin()
    torch.testing.assert_close(ops.npu_rotary_position_embedding(x, cos, sin, 1), R.rope(x, cos, sin, 1))


@pytest.mark.parametrize("sparse_mode,keep", [
    (2, lambda i, j, sq, skv: j <= i),                        # causal, top-left
    (3, lambda i, j, sq, skv: j <= i + skv - sq),             # causal, bottom-right
    (4, lambda i, j, sq, skv: (j >= i - 1) & (j <= i + 1)),   # band pre 1, next 1
])
def test_fusion_attention_sparse_modes(sparse_mode, keep):
    b, n, sq, skv, d = 1, 2, 4, 7, 8
    q, k, v = _rand(b, n, sq, d), _rand(b, n, skv, d, seed=1), _rand(b, n, skv, d, seed=2)
    out, _, _ = ops.fusion_attention(q, k, v, n, "BNSD", scale=d ** -0.5, sparse_mode=sparse_mode,
                                     pre_tokens=1, next_tokens=1)
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep(i, j, sq, skv)))


def test_fusion_attention_pse_follows_npu_convention_scale_times_pse_plus_scores():
    q, k, v = _rand(1, 2, 5, 4), _rand(1, 2, 5, 4, seed=1), _rand(1, 2, 5, 4, seed=2)
    pse, scale = _rand(1, 2, 5, 5, seed=3), 0.3
    out, _, _ = ops.fusion_attention(q, k, v, 2, "BNSD", pse=pse, scale=scale)
    expect = torch.softmax(scale * (pse + q @ k.transpose(-1, -2)), -1) @ v
    torch.testing.assert_close(out, expect)


def test_gmm_permute_ring_update_and_matmul_add():
    x, w = _rand(6, 3), _rand(2, 3, 4, seed=1)
    bias = _rand(2, 4, seed=2)
    out = ops.npu_gmm(x, w, bias=bias, group_list=[2, 6])
    torch.testing.assert_close(out[:2], x[:2] @ w[0] + bias[0])
    torch.testing.assert_close(out[2:], x[2:] @ w[1] + bias[1])
    # permutation: rows grouped by expert (expert-major), token order kept within an expert
    tokens = _rand(4, 3)
    routing = torch.tensor([[1, 0], [0, 1], [1, 1], [0, 1]], dtype=torch.bool)
    permuted, idx = ops.npu_moe_token_permute(tokens, routing)
    assert idx.tolist() == [0, 2, 1, 2, 3]
    assert torch.equal(permuted, tokens[[0, 2, 1, 2, 3]])
    # unpermute: each row weighted by its prob and added back to its token
    probs = torch.tensor([0.5, 0.25, 1.0, 0.75, 2.0], dtype=tokens.dtype)
    restored = ops.npu_moe_token_unpermute(permuted, idx, probs, restore_shape=tokens.shape)
    torch.testing.assert_close(restored, torch.stack([0.5 * tokens[0], 1.0 * tokens[1], (0.25 + 0.75) * tokens[2],
                                                      2.0 * tokens[3]]))
    # ring update: two blocks' partial softmax results merge into the softmax over both blocks
    # (SBH out [s, b, n*d]; stats [b, n, s]); checked against attention over the joined keys
    sq, n, d = 3, 2, 4
    q = _rand(1, n, sq, d)
    k1, v1, k2, v2 = (_rand(1, n, 5, d, seed=i) for i in (1, 2, 3, 4))

    def block(k, v):
        scores = q @ k.transpose(-1, -2)
        mx = scores.amax(-1)
        p = torch.exp(scores - mx[..., None])
        out = (p / p.sum(-1, keepdim=True)) @ v                       # [b, n, s, d]
        return out.permute(2, 0, 1, 3).reshape(sq, 1, n * d), mx, p.sum(-1)
    merged, _, _ = ops.npu_ring_attention_update(*block(k1, v1), *block(k2, v2))
    whole = torch.softmax(q @ torch.cat([k1, k2], 2).transpose(-1, -2), -1) @ torch.cat([v1, v2], 2)
    torch.testing.assert_close(merged, whole.permute(2, 0, 1, 3).reshape(sq, 1, n * d))
    # main_grad += dy^T @ x in fp32, accumulating into what is there
    xs, dy = x[:, :3].float(), _rand(6, 4).float()
    main_grad = torch.ones(4, 3)
    ops.npu_matmul_add_fp32(xs, dy, main_grad)
    torch.testing.assert_close(main_grad, 1 + dy.t() @ xs)


def test_dropout_add_layer_norm_and_bad_arguments():
    x, r = _rand(2, 8), _rand(2, 8, seed=1)
    out, mask = ops.npu_dropout_add_layer_norm(x, r, torch.ones(8, dtype=x.dtype), None, 0.0, 1e-5)
    torch.testing.assert_close(out, F.layer_norm(x + r, (8,), eps=1e-5))
    with pytest.raises(ValueError, match="dropout_p"):
        ops.npu_dropout_add_layer_norm(x, r, None, None, 1.5, 1e-5)
    with pytest.raises(ValueError, match="keep_prob"):
        ops.fusion_attention(x[None, None], x[None, None], x[None, None], 1, "BNSD", keep_prob=0.0)
    with pytest.raises(ValueError, match="group_type 0"):
        ops.npu_gmm(x, _rand(2, 8, 3), group_list=[1, 2], group_type=1)


def test_no_backend_is_built_behind_the_callers_back():
    from mindspeed.backends import BackendUnavailableError, get_backend, reset_backend
    reset_backend()
    with pytest.raises(BackendUnavailableError, match=r"mindspeed.adapt\(args\)"):
        get_backend()


def test_an_op_uses_the_backend_of_its_tensors_framework():
    import numpy as np
    from mindspeed import backends
    backends.reset_backend()
    x, g = _rand(3, 16), _rand(16, seed=1)
    torch.testing.assert_close(ops.rms_norm(x, g, 1e-6)[0], R.rms_norm(x, g, 1e-6)[0])
    assert backends.backend_for(x).name == "torch"
    with pytest.raises(backends.BackendUnavailableError):
        backends.get_backend()                 # the op's backend was not made the active one
    with pytest.raises(backends.BackendUnavailableError, match="ndarray is not a torch or MindSpore tensor"):
        ops.swiglu(np.zeros((2, 4)))
    active = backends.set_backend("torch", "cpu")
    try:
        assert backends.backend_for(x) is active
    finally:
        backends.reset_backend()
