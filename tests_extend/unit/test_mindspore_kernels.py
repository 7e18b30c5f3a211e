"""Every docs/kernels.md kernel on the mindspore backend against the torch reference: the same numpy
inputs go through mindspeed.backends.torch.kernels.reference and through MindSporeBackend.kernels
(MindSpore reference on CPU), forward outputs and input gradients compared at docs/kernels.md fp32
tolerances."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
import torch  # noqa: E402

from mindspeed.backends.torch.kernels import reference as torch_ref  # noqa: E402

ATOL, RTOL = 1e-5, 1.3e-6


@pytest.fixture(scope="module")
def kernels():
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    return MindSporeBackend("cpu").kernels


def _rng(seed=0):
    return np.random.default_rng(seed)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _compare(torch_fn, ms_fn, inputs, grad_of, *, atol=ATOL, rtol=RTOL, n_outputs=1):
    """Run both on the same numpy inputs; compare the first n_outputs outputs and, for the inputs
    listed in grad_of, the gradients of sum(out0 * dy)."""
    t_in = [torch.tensor(a, requires_grad=(i in grad_of)) if isinstance(a, np.ndarray) else a
            for i, a in enumerate(inputs)]
    t_out = torch_fn(*t_in)
    t_outs = t_out if isinstance(t_out, (tuple, list)) else (t_out,)
    dy = _rng(99).standard_normal(t_outs[0].shape).astype(np.float32)
    if grad_of:
        (t_outs[0] * torch.tensor(dy)).sum().backward()

    m_in = [ms.Tensor(a) if isinstance(a, np.ndarray) else a for a in inputs]
    m_out = ms_fn(*m_in)
    m_outs = m_out if isinstance(m_out, (tuple, list)) else (m_out,)
    for t, m in zip(t_outs[:n_outputs], m_outs[:n_outputs]):
        np.testing.assert_allclose(m.asnumpy(), t.detach().numpy(), atol=atol, rtol=rtol)
    if grad_of:
        def loss(*diff):
            args = list(m_in)
            for i, d in zip(grad_of, diff):
                args[i] = d
            return (_first(ms_fn(*args)) * ms.Tensor(dy)).sum()
        grads = ms.grad(loss, grad_position=tuple(range(len(grad_of))))(*[m_in[i] for i in grad_of])
        grads = grads if isinstance(grads, tuple) else (grads,)
        for i, g in zip(grad_of, grads):
            np.testing.assert_allclose(g.asnumpy(), t_in[i].grad.numpy(), atol=atol, rtol=rtol,
                                       err_msg=f"gradient of input {i}")


def test_rms_norm(kernels):
    r = _rng()
    x, g = r.standard_normal((4, 3, 32)).astype(np.float32), r.standard_normal(32).astype(np.float32)
    _compare(lambda a, b: torch_ref.rms_norm(a, b, 1e-6), lambda a, b: kernels.rms_norm(a, b, 1e-6),
             [x, g], grad_of=(0, 1), atol=1e-4, rtol=1e-6, n_outputs=2)


@pytest.mark.parametrize("dim", [-1, 0])
def test_swiglu(kernels, dim):
    x = _rng(1).standard_normal((8, 6, 16)).astype(np.float32)
    _compare(lambda a: torch_ref.swiglu(a, dim), lambda a: kernels.swiglu(a, dim), [x], grad_of=(0,))


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("rot_dim", [16, 8], ids=["full", "partial"])
def test_rope(kernels, mode, rot_dim):
    r = _rng(2)
    x = r.standard_normal((6, 2, 3, 16)).astype(np.float32)                # SBND
    ang = r.standard_normal((6, 1, 1, rot_dim)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    _compare(lambda a, c, s: torch_ref.rope(a, c, s, mode), lambda a, c, s: kernels.rope(a, c, s, mode),
             [x, cos, sin], grad_of=(0,))


def _qkv(layout, b=2, n=4, nkv=4, s=8, d=8, seed=3):
    r = _rng(seed)
    shape = {"SBH": lambda h: (s, b, h * d), "BSH": lambda h: (b, s, h * d),
             "BSND": lambda h: (b, s, h, d), "BNSD": lambda h: (b, h, s, d)}[layout]
    return [r.standard_normal(shape(h)).astype(np.float32) for h in (n, nkv, nkv)]


@pytest.mark.parametrize("layout", ["SBH", "BSH", "BSND", "BNSD"])
def test_attention_causal_layouts(kernels, layout):
    q, k, v = _qkv(layout)
    kw = dict(layout=layout, head_num=4, causal=True)
    _compare(lambda a, b, c: torch_ref.attention(a, b, c, **kw), lambda a, b, c: kernels.attention(a, b, c, **kw),
             [q, k, v], grad_of=(0, 1, 2), n_outputs=3)


def test_attention_gqa_mask_band_alibi(kernels):
    q, k, v = _qkv("BNSD", nkv=2, seed=4)
    r = _rng(5)
    mask = r.random((1, 1, 8, 8)) < 0.3
    alibi = r.standard_normal((1, 4, 8, 8)).astype(np.float32)
    kw = dict(layout="BNSD", head_num=4, pre_tokens=3, next_tokens=1, scale=0.3)
    _compare(lambda a, b, c, m, al: torch_ref.attention(a, b, c, mask=torch.tensor(m), alibi=al, **kw),
             lambda a, b, c, m, al: kernels.attention(a, b, c, mask=m, alibi=al, **kw),
             [q, k, v, mask, alibi], grad_of=(0, 1, 2), n_outputs=3)


def test_attention_band_with_rows_that_see_no_key(kernels):
    """Row 0 sees no key (next_tokens -1): its output is 0, not the NaN a softmax over nothing gives;
    the other rows take the softmax-kernel path's numbers (causal layouts above)."""
    q, k, v = _qkv("BNSD", seed=7)
    kw = dict(layout="BNSD", head_num=4, pre_tokens=2, next_tokens=-1)
    _compare(lambda a, b, c: torch_ref.attention(a, b, c, **kw), lambda a, b, c: kernels.attention(a, b, c, **kw),
             [q, k, v], grad_of=(0, 1, 2), n_outputs=3)


@pytest.mark.parametrize("sparse_mode,pre,nxt", [(2, 65536, 0), (3, 65536, 0), (4, 2, 0), (4, 3, -1), (4, 1, 2)])
def test_attention_sparse_modes_as_the_trainer_asks(kernels, sparse_mode, pre, nxt):
    """--sparse-mode/--pre-tockens/--next-tockens through the torch feature's own mapping
    (band_arguments, a causal layer, SBH as the trainers call it): the MindSpore kernel gives the torch
    reference's output and gradients; modes 2 and 3 are the causal mask, mode 4 a band inside it."""
    from mindspeed.features.fused.flash_attention import band_arguments
    q, k, v = _qkv("SBH", nkv=2, seed=8)
    kw = dict(layout="SBH", head_num=4, **band_arguments(sparse_mode, True, 8, 8, pre, nxt))
    _compare(lambda a, b, c: torch_ref.attention(a, b, c, **kw), lambda a, b, c: kernels.attention(a, b, c, **kw),
             [q, k, v], grad_of=(0, 1, 2), n_outputs=3)


def test_attention_tnd(kernels):
    r = _rng(6)
    q, k, v = (r.standard_normal((10, 2, 8)).astype(np.float32) for _ in range(3))
    kw = dict(layout="TND", head_num=2, causal=True, actual_seq_qlen=[4, 10], actual_seq_kvlen=[4, 10])
    _compare(lambda a, b, c: torch_ref.attention(a, b, c, **kw), lambda a, b, c: kernels.attention(a, b, c, **kw),
             [q, k, v], grad_of=(0, 1, 2), n_outputs=3)


@pytest.mark.parametrize("layout", ["SBH", "BNSD"])
def test_attention_with_v_head_size_of_its_own(kernels, layout):
    """Multi-latent attention's v head size (6) unlike q's and k's (8): the output takes v's; a v whose
    hidden size is no whole number of heads is refused."""
    q, k, _ = _qkv(layout, seed=9)
    v = _rng(10).standard_normal(k.shape[:-1] + ((4 * 6,) if layout == "SBH" else (6,))).astype(np.float32)
    kw = dict(layout=layout, head_num=4, causal=True, scale=0.2)
    _compare(lambda a, b, c: torch_ref.attention(a, b, c, **kw), lambda a, b, c: kernels.attention(a, b, c, **kw),
             [q, k, v], grad_of=(0, 1, 2), n_outputs=3)
    if layout == "SBH":
        with pytest.raises(ValueError, match="not a multiple of the 4 key/value heads"):
            kernels.attention(ms.Tensor(q), ms.Tensor(k), ms.Tensor(v[..., :-1]), **kw)


def test_attention_rejects_bad_heads(kernels):
    q, k, v = (ms.Tensor(a) for a in _qkv("BNSD", n=4, nkv=3))
    with pytest.raises(ValueError, match="head_num 4 does not match|not a multiple"):
        kernels.attention(q, k, v, layout="BNSD", head_num=4)


def test_ring_attention_update_matches_full_attention(kernels):
    layout = "SBH"
    outs = []
    for seed in (8, 9):
        q, k, v = _qkv(layout, seed=seed)
        outs.append(torch_ref.attention(torch.tensor(q), torch.tensor(k), torch.tensor(v), layout=layout, head_num=4))
    args = [t.numpy() for o in outs for t in o]
    args[1][0, 0, 0] = -np.inf           # a fully masked row in one block
    args[2][0, 0, 0] = 0.0
    _compare(lambda *a: torch_ref.ring_attention_update(*a, layout=layout),
             lambda *a: kernels.ring_attention_update(*a, layout=layout),
             args, grad_of=(0, 3), n_outputs=3)


@pytest.mark.parametrize("group_list_type,group_list", [(0, [3, 3, 7]), (1, [2, 0, 4])],
                         ids=["cumulative_with_empty_group", "sizes_with_empty_group"])
def test_gmm(kernels, group_list_type, group_list):
    r = _rng(10)
    x, w = r.standard_normal((8, 6)).astype(np.float32), r.standard_normal((3, 6, 5)).astype(np.float32)
    _compare(lambda a, b: torch_ref.gmm(a, b, group_list, group_list_type),
             lambda a, b: kernels.gmm(a, b, group_list, group_list_type), [x, w], grad_of=(0, 1))


def test_gmm_rejects_bad_group_list(kernels):
    x, w = ms.Tensor(np.zeros((4, 2), np.float32)), ms.Tensor(np.zeros((2, 2, 3), np.float32))
    with pytest.raises(ValueError, match="not a valid split"):
        kernels.gmm(x, w, [3, 2], 0)


def test_matmul_add_fp32_in_place(kernels):
    r = _rng(11)
    x, dy = r.standard_normal((2, 5, 6)).astype(np.float32), r.standard_normal((2, 5, 4)).astype(np.float32)
    base = r.standard_normal((4, 6)).astype(np.float32)
    expected = torch_ref.matmul_add_fp32(torch.tensor(x), torch.tensor(dy), torch.tensor(base.copy()))
    main_grad = ms.Tensor(base.copy())
    returned = kernels.matmul_add_fp32(ms.Tensor(x), ms.Tensor(dy), main_grad)
    np.testing.assert_allclose(main_grad.asnumpy(), expected.numpy(), atol=ATOL, rtol=RTOL)
    assert returned is main_grad


def test_moe_permute_unpermute(kernels):
    r = _rng(12)
    tokens = r.standard_normal((6, 4)).astype(np.float32)
    routing = r.random((6, 3)) < 0.5
    routing[0] = True
    probs = r.random((6, 3)).astype(np.float32)
    t_perm, t_idx = torch_ref.moe_permute(torch.tensor(tokens), torch.tensor(routing))
    m_perm, m_idx = kernels.moe_permute(ms.Tensor(tokens), ms.Tensor(routing))
    np.testing.assert_array_equal(m_idx.asnumpy(), t_idx.numpy())
    np.testing.assert_array_equal(m_perm.asnumpy(), t_perm.numpy())         # exact
    _compare(lambda p, pr: torch_ref.moe_unpermute(p, t_idx, pr, (6, 4), routing_map=torch.tensor(routing)),
             lambda p, pr: kernels.moe_unpermute(p, m_idx, pr, (6, 4), routing_map=ms.Tensor(routing)),
             [t_perm.numpy(), probs], grad_of=(0, 1))
    restored = kernels.moe_unpermute(m_perm, m_idx, None, (6, 4)).asnumpy()
    counts = routing.sum(1, keepdims=True)
    np.testing.assert_allclose(restored, tokens * counts, atol=ATOL)     # probs None: sum of copies


def test_moe_permute_gradient(kernels):
    r = _rng(13)
    tokens = r.standard_normal((5, 3)).astype(np.float32)
    routing = r.random((5, 2)) < 0.6
    _compare(lambda t: torch_ref.moe_permute(t, torch.tensor(routing)),
             lambda t: kernels.moe_permute(t, ms.Tensor(routing)), [tokens], grad_of=(0,))


@pytest.mark.parametrize("prenorm", [False, True])
def test_dropout_add_layer_norm(kernels, prenorm):
    r = _rng(14)
    x0, res = r.standard_normal((4, 16)).astype(np.float32), r.standard_normal((4, 16)).astype(np.float32)
    w, b = r.standard_normal(16).astype(np.float32), r.standard_normal(16).astype(np.float32)
    rowscale = r.random(4).astype(np.float32)
    kw = dict(prenorm=prenorm)
    _compare(lambda a, c, d, e, rs: torch_ref.dropout_add_layer_norm(a, c, d, e, 0.0, 1e-5, rowscale=rs, **kw),
             lambda a, c, d, e, rs: kernels.dropout_add_layer_norm(a, c, d, e, 0.0, 1e-5, rowscale=rs, **kw),
             [x0, res, w, b, rowscale], grad_of=(0, 1, 2, 3), atol=1e-4, rtol=1e-5,
             n_outputs=2 if prenorm else 1)


def test_dropout_add_layer_norm_dropout_mask(kernels):
    x0 = ms.Tensor(np.ones((64, 32), np.float32))
    out, mask = kernels.dropout_add_layer_norm(x0, None, None, None, 0.5, 1e-5, return_dropout_mask=True)
    kept = float(mask.asnumpy().mean())
    assert 0.35 < kept < 0.65 and out.shape == (64, 32)


# -- bf16: both references compute in fp32 and round once, so they agree to bf16 rounding ---------
BF16 = dict(rtol=1.6e-2, atol=1e-2)


def _bf16_case(name, kernels):
    r = _rng(20)
    x = r.standard_normal((8, 2, 32)).astype(np.float32)
    if name == "rms_norm":
        g = r.standard_normal(32).astype(np.float32)
        return [x, g], (lambda a, b: torch_ref.rms_norm(a, b)[0]), (lambda a, b: kernels.rms_norm(a, b)[0])
    if name == "swiglu":
        return [x], torch_ref.swiglu, kernels.swiglu
    if name == "rope":
        ang = r.standard_normal((8, 1, 32)).astype(np.float32)
        return ([x, np.cos(ang), np.sin(ang)], lambda a, c, s: torch_ref.rope(a, c, s, 0),
                lambda a, c, s: kernels.rope(a, c, s, 0))
    q, k, v = _qkv("SBH", seed=21)
    kw = dict(layout="SBH", head_num=4, causal=True)
    return ([q, k, v], lambda a, b, c: torch_ref.attention(a, b, c, **kw)[0],
            lambda a, b, c: kernels.attention(a, b, c, **kw)[0])


@pytest.mark.parametrize("name", ["rms_norm", "swiglu", "rope", "attention"])
def test_bf16_forward_and_backward(kernels, name):
    inputs, t_fn, m_fn = _bf16_case(name, kernels)
    t_in = [torch.tensor(a).to(torch.bfloat16).requires_grad_(i == 0) for i, a in enumerate(inputs)]
    t_out = t_fn(*t_in)
    dy = _rng(22).standard_normal(tuple(t_out.shape)).astype(np.float32)
    (t_out.float() * torch.tensor(dy)).sum().backward()
    m_in = [ms.Tensor(a).astype(ms.bfloat16) for a in inputs]
    m_out = m_fn(*m_in)
    assert m_out.dtype == ms.bfloat16
    np.testing.assert_allclose(m_out.astype(ms.float32).asnumpy(), t_out.float().detach().numpy(), **BF16)
    grad = ms.grad(lambda a: (m_fn(a, *m_in[1:]).astype(ms.float32) * ms.Tensor(dy)).sum())(m_in[0])
    np.testing.assert_allclose(grad.astype(ms.float32).asnumpy(), t_in[0].grad.float().numpy(), **BF16)
