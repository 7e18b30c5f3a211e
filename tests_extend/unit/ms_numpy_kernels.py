"""Independent numpy implementations of the four kernels the MindSpore GPT uses (rms_norm, swiglu,
rope, attention), written from the kernel contract in docs/kernels.md and not from either
reference module. Used by test_mindspore_backend as a distinct 'fast path': each call is recorded
in CALLS, and the results are MindSpore tensors so the model runs on them unchanged."""
import mindspore as ms
import numpy as np

CALLS: list = []


def _np(t):
    return t.asnumpy().astype(np.float64)


def rms_norm(x, gamma, eps=1e-6):
    CALLS.append("rms_norm")
    xf = _np(x)
    rstd = 1.0 / np.sqrt((xf ** 2).mean(-1, keepdims=True) + eps)
    return ms.Tensor((xf * rstd * _np(gamma)).astype(np.float32)), ms.Tensor(rstd.astype(np.float32))


def swiglu(x, dim=-1):
    CALLS.append("swiglu")
    a, b = np.split(_np(x), 2, axis=dim)
    return ms.Tensor((a / (1.0 + np.exp(-a)) * b).astype(np.float32))


def rope(x, cos, sin, mode=0):
    CALLS.append("rope")
    assert mode == 0, "the GPT uses rotate-half"
    xf, c, s = _np(x), _np(cos), _np(sin)
    r = c.shape[-1]
    head, tail = xf[..., :r], xf[..., r:]
    half = r // 2
    rotated = np.concatenate([-head[..., half:], head[..., :half]], -1)
    return ms.Tensor(np.concatenate([head * c + rotated * s, tail], -1).astype(np.float32))


# the options this plain attention leaves out, at the values that switch them off (the dispatcher
# passes every KernelsAPI.attention keyword)
_OFF = {"mask": None, "dropout_p": 0.0, "pre_tokens": 2**31 - 1, "next_tokens": 2**31 - 1,
        "actual_seq_qlen": None, "actual_seq_kvlen": None, "alibi": None}


def attention(q, k, v, *, layout="SBH", head_num, causal=False, scale=None, **unused):
    CALLS.append("attention")
    switched_off = all(name in _OFF and _OFF[name] == value for name, value in unused.items())
    assert layout == "SBH" and switched_off, (layout, unused)
    qf, kf, vf = _np(q), _np(k), _np(v)
    s, b, h = qf.shape
    d = h // head_num
    groups = kf.shape[-1] // d
    bnsd = lambda t, n: t.reshape(s, b, n, d).transpose(1, 2, 0, 3)
    qh = bnsd(qf, head_num)
    kh = np.repeat(bnsd(kf, groups), head_num // groups, axis=1)
    vh = np.repeat(bnsd(vf, groups), head_num // groups, axis=1)
    scores = qh @ kh.transpose(0, 1, 3, 2) * (d ** -0.5 if scale is None else scale)
    if causal:
        scores = np.where(np.triu(np.ones((s, s), bool), 1), -np.inf, scores)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    out = (scores / scores.sum(-1, keepdims=True)) @ vh          # [b, n, s, d]
    return ms.Tensor(out.transpose(2, 0, 1, 3).reshape(s, b, h).astype(np.float32)), None, None
