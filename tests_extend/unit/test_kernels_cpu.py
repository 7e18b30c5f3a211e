"""CPU fast paths (fused C++ rms_norm/swiglu/rope, flash attention, gmm, MoE permute/unpermute) against the
reference, forward and backward, fp32 and bf16, at docs/kernels.md tolerances."""
import logging

import pytest
import torch

from mindspeed.backends.torch.kernels import cpu as C
from mindspeed.backends.torch.kernels import csrc
from mindspeed.backends.torch.kernels import reference as R
from mindspeed.backends.torch.kernels import TorchKernels
from mindspeed.backends.torch.kernels.layouts import to_bnsd
from tests_extend.unit.kernel_checks import assert_close_fp32, assert_low_precision_ok, run

DTYPES = [torch.float32, torch.bfloat16]
# each kernel against its reference in fp32 and bf16, built for this CPU: CI runs them with torch (and
# the build) held to AVX2 too
pytestmark = pytest.mark.cpu_numerics


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def compare(fast, ref, inputs, dtype, n_out=1, floor=2e-2, atol=1e-5, rtol=1.3e-6):
    """fast vs reference: fp32 directly; bf16 by error against the reference run in fp64."""
    f_out, f_grad = run(fast, inputs, n_out=n_out)
    r_out, r_grad = run(ref, inputs, n_out=n_out)
    if dtype == torch.float32:
        assert_close_fp32(f_out[:n_out] + f_grad, r_out[:n_out] + r_grad, atol=atol, rtol=rtol)
    else:
        t_out, t_grad = run(ref, [t.double() if t.is_floating_point() else t for t in inputs], n_out=n_out)
        assert_low_precision_ok(f_out[:n_out] + f_grad, r_out[:n_out] + r_grad, t_out[:n_out] + t_grad, floor)


def test_fused_cpp_kernels_build_here_and_serve_the_cpu_backend():
    assert csrc.fused_ops() is not None, csrc.unavailable_reason()
    kernels = TorchKernels("cpu")
    assert kernels.implementation("rms_norm") is C.rms_norm
    assert kernels.implementation("attention") is C.attention
    assert kernels.implementation("gmm") is C.gmm
    assert kernels.implementation("moe_unpermute") is C.moe_unpermute
    assert kernels.implementation("ring_attention_update") is R.ring_attention_update   # no cpu fast path


def test_a_build_killed_earlier_does_not_stop_the_next_one():
    """torch's loader waits forever on the `lock` file a killed build leaves (seen: a CI run hung
    there); a fresh process finds it stale and loads the kernels."""
    import subprocess
    import sys
    build_dir = csrc.cache_dir()
    with csrc.build_lock(build_dir):
        (build_dir / "lock").touch()          # as a killed build leaves it
        planted = (build_dir / "lock").stat()
    code = ("from mindspeed.backends.torch.kernels import csrc\n"
            "assert csrc.fused_ops() is not None, csrc.unavailable_reason()\nprint('loaded')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "loaded" in result.stdout, result.stderr[-2000:]
    # the stale lock is gone (a process loading the kernels at this moment may hold a new one)
    lock = build_dir / "lock"
    now = lock.stat() if lock.exists() else None
    assert now is None or (now.st_ino, now.st_mtime_ns) != (planted.st_ino, planted.st_mtime_ns)


def test_native_builds_are_kept_per_cpu_and_follow_torchs_isa_cap(monkeypatch):
    """A -march=native library from another CPU is never loaded (illegal instructions): its cache
    directory names this CPU's flags; with torch's kernels held to AVX2, these are built without
    AVX-512 too, so a forced-AVX2 run tests what an AVX2-only machine runs."""
    from mindspeed.vec_isa_memo import cpu_flags_digest
    monkeypatch.setenv("MINDSPEED_CPP_NATIVE", "1")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert csrc.cache_dir().name.endswith("-cpu-" + cpu_flags_digest()[:12])
    assert csrc.machine_flags() == ["-march=native"]
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert csrc.machine_flags() == ["-march=native", "-mno-avx512f"]
    assert csrc.cache_dir().name.endswith("-cpu-" + cpu_flags_digest()[:12] + "-no-avx512")
    monkeypatch.setenv("MINDSPEED_CPP_NATIVE", "0")
    assert csrc.machine_flags() == [] and "-cpu-" not in csrc.cache_dir().name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 130)])
def test_rms_norm(dtype, shape):
    x, g = _rand(*shape, dtype=dtype), _rand(shape[-1], seed=1, dtype=dtype)
    compare(lambda x, g: C.rms_norm(x, g, 1e-6), lambda x, g: R.rms_norm(x, g, 1e-6), [x, g], dtype,
            atol=1e-4, rtol=1e-6)
    assert C.rms_norm(x, g)[1].dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((4, 6, 96), -1), ((3, 130), -1), ((8, 5), 0)])
def test_swiglu(dtype, shape, dim):
    compare(lambda x: C.swiglu(x, dim), lambda x: R.swiglu(x, dim), [_rand(*shape, dtype=dtype)], dtype)


ROPE_CASES = {   # layout: (x shape, cos shape) with partial rotary (rot 8 of 12)
    "SBND": ((6, 2, 3, 12), (6, 1, 1, 8)),
    "BSND": ((2, 6, 3, 12), (1, 6, 1, 8)),
    "BNSD": ((2, 3, 6, 12), (1, 1, 6, 8)),
    "full": ((6, 2, 3, 8), (6, 2, 1, 8)),
    # the C++ row loop has three widths (rot < 32, < 64, larger): head dims 32, 64 and 128
    "SBND_d32": ((5, 2, 3, 32), (5, 1, 1, 32)),
    "BNSD_d64": ((2, 3, 5, 64), (1, 1, 5, 64)),
    "BSND_d136_rot128": ((2, 5, 2, 136), (1, 5, 1, 128)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope(dtype, mode, case):
    x_shape, cos_shape = ROPE_CASES[case]
    theta = _rand(*cos_shape, seed=2)
    cos, sin = torch.cos(theta), torch.sin(theta)
    compare(lambda x: C.rope(x, cos, sin, mode), lambda x: R.rope(x, cos, sin, mode),
            [_rand(*x_shape, dtype=dtype)], dtype)


def _qkv(layout, b, n, nkv, sq, skv, d, dtype):
    shapes = {"SBH": lambda s, h: (s, b, h * d), "BSH": lambda s, h: (b, s, h * d),
              "BSND": lambda s, h: (b, s, h, d), "BNSD": lambda s, h: (b, h, s, d)}[layout]
    return [_rand(*shapes(sq, n), dtype=dtype), _rand(*shapes(skv, nkv), seed=1, dtype=dtype),
            _rand(*shapes(skv, nkv), seed=2, dtype=dtype)]


def _attention_pair(**kw):
    """fast and reference returning (out, logsumexp): the fast path's stats are (lse, 1)."""
    def wrap(fn):
        def call(q, k, v):
            out, mx, sm = fn(q, k, v, **kw)
            return out, mx + torch.log(sm)
        return call
    return wrap(C.attention), wrap(R.attention)


ATTN_CASES = {
    "causal": dict(causal=True),
    "full": dict(),
    "band": dict(pre_tokens=3, next_tokens=1),
    "causal_band": dict(causal=True, pre_tokens=2),
    "mask": "mask",
    "alibi": "alibi",
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["SBH", "BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("case", sorted(ATTN_CASES))
def test_attention(dtype, layout, case):
    b, n, nkv, s, d = 2, 4, 2, 12, 8                      # GQA 4:2
    kw = ATTN_CASES[case]
    if kw == "mask":
        mask = _rand(b, 1, s, s, seed=7) > 0.6
        mask[..., 3, :] = True                            # a fully masked row
        kw = dict(mask=mask)
    elif kw == "alibi":
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]).view(1, n, 1, 1)
        kw = dict(alibi=slopes * (torch.arange(s)[None] - torch.arange(s)[:, None]).float(), causal=True)
    fast, ref = _attention_pair(layout=layout, head_num=n, **kw)
    compare(fast, ref, _qkv(layout, b, n, nkv, s, s, d, dtype), dtype, n_out=2, floor=3e-2)


@pytest.mark.parametrize("cpp", [True, False], ids=["cpp_softmax", "torch_softmax"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,b,n,nkv,s", [("SBH", 2, 2, 2, 128), ("BSND", 1, 4, 2, 130), ("BNSD", 1, 2, 1, 200)])
def test_block_causal_gemm_attention(dtype, layout, b, n, nkv, s, cpp, monkeypatch, one_thread):
    """The GEMM path (whole blocks, a short last block, GQA): output, logsumexp and its gradient,
    with the C++ causal softmax and with its torch-ops fallback."""
    if not cpp:
        monkeypatch.setenv("MINDSPEED_DISABLE_CPP_KERNELS", "1")
        monkeypatch.setattr(csrc, "_state", {})
    assert (csrc.fused_ops() is not None) == cpp
    d = 64
    inputs = _qkv(layout, b, n, nkv, s, s, d, dtype)
    q, k = (to_bnsd(t, layout, d) for t in inputs[:2])
    assert C.gemm_attention_pays(q, k, plain_causal=True)
    fast, ref = _attention_pair(layout=layout, head_num=n, causal=True)
    compare(fast, ref, inputs, dtype, n_out=2, floor=3e-2)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_gemm_attention_only_where_it_pays(one_thread):
    q = torch.empty(1, 2, 512, 16)
    assert C.gemm_attention_pays(q, q, True)
    torch.set_num_threads(2)
    assert not C.gemm_attention_pays(q, q, True)                          # flash uses a second thread better
    torch.set_num_threads(1)
    assert not C.gemm_attention_pays(q, q, False)                         # masks, bands: flash
    assert not C.gemm_attention_pays(q.half(), q.half(), True)            # fp16 GEMMs are slow here
    assert not C.gemm_attention_pays(q[:, :, :256], q[:, :, :256], True)  # s * d too small
    assert not C.gemm_attention_pays(q, q[:, :, :256], True)              # cross lengths
    long = torch.empty(1, 1, C.GEMM_MAX_SEQ + 64, 16)
    assert not C.gemm_attention_pays(long, long, True)
    wide = torch.empty(64, 32, 1024, 16)                                  # 1.1 GB of probabilities
    assert not C.gemm_attention_pays(wide, wide, True)


def test_attention_tnd_and_cross_lengths():
    n, d = 2, 8
    t = [_rand(11, n, d, seed=i) for i in range(3)]
    fast, ref = _attention_pair(layout="TND", head_num=n, causal=True, actual_seq_qlen=[4, 11],
                                actual_seq_kvlen=[4, 11])
    compare(fast, ref, t, torch.float32, n_out=2)
    fast, ref = _attention_pair(layout="BNSD", head_num=4, causal=True)   # sq < skv, top-left
    compare(fast, ref, _qkv("BNSD", 1, 4, 4, 5, 9, d, torch.float32), torch.float32, n_out=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,d,dv", [("SBH", 24, 16), ("BSND", 16, 24), ("BNSD", 24, 16)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_with_a_value_head_size_of_its_own(dtype, layout, d, dv, causal):
    """Multi-latent attention's v head size (smaller or larger than q's and k's): torch's CPU flash
    kernel takes one head size, so the fast path pads; output [.., n*dv] and gradients as the reference's."""
    b, n, nkv, s = 2, 4, 2, 12
    q, k, _ = _qkv(layout, b, n, nkv, s, s, d, dtype)
    v = _qkv(layout, b, n, nkv, s, s, dv, dtype)[2]
    fast, ref = _attention_pair(layout=layout, head_num=n, causal=causal, scale=0.3)
    assert fast(q, k, v)[0].shape == q.shape[:-1] + (n * dv if layout == "SBH" else dv,)
    compare(fast, ref, [q, k, v], dtype, n_out=2, floor=3e-2)


@pytest.mark.parametrize("d,dv", [(64, 48), (48, 64)])
def test_block_causal_gemm_attention_with_a_value_head_size_of_its_own(d, dv, one_thread):
    q, k, _ = _qkv("BNSD", 1, 2, 2, 200, 200, d, torch.float32)
    v = _qkv("BNSD", 1, 2, 2, 200, 200, dv, torch.float32)[2]
    assert C.gemm_attention_pays(q, k, plain_causal=True)
    fast, ref = _attention_pair(layout="BNSD", head_num=2, causal=True)
    compare(fast, ref, [q, k, v], torch.float32, n_out=2)


def test_attention_dropout_uses_the_reference_path():
    q = _rand(4, 1, 16)
    torch.manual_seed(0)
    a = C.attention(q, q, q, layout="SBH", head_num=2, dropout_p=0.5)[0]
    torch.manual_seed(0)
    b = R.attention(q, q, q, layout="SBH", head_num=2, dropout_p=0.5)[0]
    assert torch.equal(a, b)


def test_missing_build_falls_back_to_pytorch_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setenv("MINDSPEED_DISABLE_CPP_KERNELS", "1")
    monkeypatch.setattr(csrc, "_state", {})
    x, g = _rand(4, 8), _rand(8, seed=1)
    with caplog.at_level(logging.WARNING, logger="mindspeed.kernels"):
        y1, _ = C.rms_norm(x, g)
        y2 = C.swiglu(x)
    assert [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()] == [
        "mindspeed: fused C++ CPU kernels unavailable (disabled by MINDSPEED_DISABLE_CPP_KERNELS=1); "
        "using the pure-PyTorch rms_norm/swiglu/rope and attention softmax"]
    torch.testing.assert_close(y1, R.rms_norm(x, g)[0])
    torch.testing.assert_close(y2, R.swiglu(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_list,kind", [([3, 0, 5, 2], 1), ([3, 3, 8, 9], 0)])   # empty group, 2 spare rows
def test_gmm(dtype, group_list, kind):
    x, w = _rand(12, 16, dtype=dtype), _rand(4, 16, 24, seed=1, dtype=dtype)
    compare(lambda x, w: C.gmm(x, w, group_list, kind), lambda x, w: R.gmm(x, w, group_list, kind), [x, w], dtype)


def _routing(tokens=10, experts=4, seed=3):
    r = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(seed)) < 0.45
    r[0] = False                                # a token no expert takes (its row comes back zero)
    r[1] = True                                 # and one every expert takes
    return r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_moe_permute_unpermute(dtype, weighted):
    routing = _routing()
    tokens = _rand(10, 12, dtype=dtype)
    p_fast, idx_fast = C.moe_permute(tokens, routing)
    p_ref, idx_ref = R.moe_permute(tokens, routing)
    assert torch.equal(idx_fast, idx_ref) and torch.equal(p_fast, p_ref)
    probs = _rand(int(routing.sum()), seed=2, dtype=dtype).abs()

    def roundtrip(M):
        def fn(t, *w):
            perm, idx = M.moe_permute(t, routing)
            return M.moe_unpermute(perm * 1.5, idx, w[0] if w else None, t.shape)
        return fn
    compare(roundtrip(C), roundtrip(R), [tokens, probs] if weighted else [tokens], dtype)


def test_moe_unpermute_with_expert_probs_matches_reference():
    """[T, E] probs with the routing map (Megatron's call) go through the reference's selection."""
    routing, tokens = _routing(), _rand(10, 12)
    probs = _rand(10, 4, seed=4)
    perm, idx = R.moe_permute(tokens, routing)
    compare(lambda p, pr: C.moe_unpermute(p, idx, pr, (10, 12), routing_map=routing),
            lambda p, pr: R.moe_unpermute(p, idx, pr, (10, 12), routing_map=routing), [perm, probs], torch.float32)
