"""The torch backend on a CUDA GPU: the support matrix's torch/cuda column run, not only declared.

Skipped where torch sees no CUDA device (CI and the 2-core machine); run on a GPU machine with
`python -m pytest tests_extend/gpu -q` (docs/gpu.md: what ran where, and the figures).
- every kernel through `TorchKernels("cuda")` (its CUDA path where catalog.FAST_PATHS["cuda"] has
  one, else the reference) on CUDA tensors, forward and backward, against the reference run in fp64
  on the CPU (docs/kernels.md tolerances: fp32 as the torch defaults for a
  different device's rounding, bf16 at most 2x the CPU bf16 reference's error plus a floor);
- the built-in trainer on one GPU against the same run on the CPU, a checkpoint saved on the GPU
  resumed on the CPU, and bf16 on the GPU.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

from mindspeed.backends.torch.kernels import TorchKernels  # noqa: E402
from mindspeed.backends.torch.kernels import cuda as cuda_paths  # noqa: E402
from mindspeed.backends.torch.kernels import reference as R  # noqa: E402
from mindspeed.backends.torch.kernels.catalog import FAST_PATHS  # noqa: E402
from tests_extend.system.one_process_run import run_pretrain_gpt  # noqa: E402
from tests_extend.system.tiny_corpus import build_indexed_corpus  # noqa: E402
from tests_extend.unit.kernel_checks import assert_low_precision_ok, run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _routing(tokens: int, experts: int, seed: int = 0):
    scores = _rand(tokens, experts, seed=seed)
    top2 = scores.topk(2, dim=-1).indices
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top2, True)


def _lse(attend):
    """(out, logsumexp) of an attention call: the stats' convention differs by kernel, their
    logsumexp = max + log(sum) does not."""
    def call(*args):
        out, mx, sm = attend(*args)
        return out, mx + sm.log()
    return call


def _kernel_cases():
    """name -> (call(kernels, *inputs), cpu inputs, outputs with a backward)."""
    s, b, n, d = 16, 2, 4, 8
    qkv = [_rand(s, b, n * d, seed=i) for i in range(3)]
    stats = [_rand(b, n, s, seed=7), _rand(b, n, s, seed=8).abs() + 0.5]
    routing = _routing(10, 4)
    bnsd = [t.view(s, b, n, d).permute(1, 2, 0, 3).contiguous() for t in qkv]
    mask = _rand(b, 1, s, s, seed=9) > 0.5
    mask[0, 0, 3] = True
    rows = int(routing.sum())
    return {
        "rms_norm": (lambda k, x, g: k.rms_norm(x, g, 1e-6), [_rand(3, 5, 64), _rand(64, seed=1)], 1),
        "swiglu": (lambda k, x: k.swiglu(x, -1), [_rand(4, 6, 96)], 1),
        "rope": (lambda k, x, c, si: k.rope(x, c, si, 0), [_rand(6, 2, 3, 12), _rand(6, 1, 1, 8, seed=1).cos(),
                                                          _rand(6, 1, 1, 8, seed=1).sin()], 1),
        "attention causal SBH": (_lse(lambda k, q, kk, v: k.attention(q, kk, v, layout="SBH", head_num=n,
                                                                      causal=True)), qkv, 1),
        "attention band BNSD": (_lse(lambda k, q, kk, v: k.attention(q, kk, v, layout="BNSD", head_num=n, causal=True,
                                                                     pre_tokens=3, next_tokens=0)), bnsd, 1),
        "attention TND": (_lse(lambda k, q, kk, v: k.attention(q, kk, v, layout="TND", head_num=n, causal=True,
                                                               actual_seq_qlen=[5, 16], actual_seq_kvlen=[5, 16])),
                          [t[:, 0].reshape(s, n, d).contiguous() for t in qkv], 1),
        # the statistics' gradient (ring attention differentiates through them), GQA
        "attention stats grad GQA": (_lse(lambda k, q, kk, v: k.attention(q, kk, v, layout="BNSD", head_num=n,
                                                                          causal=True)),
                                     [bnsd[0], bnsd[1][:, :2].contiguous(), bnsd[2][:, :2].contiguous()], 2),
        # multi-latent attention: v's head size (16) is not q's and k's (8)
        "attention v head size SBH": (_lse(lambda k, q, kk, v: k.attention(q, kk, v, layout="SBH", head_num=n,
                                                                           causal=True)),
                                      qkv[:2] + [_rand(s, b, n * 16, seed=3)], 1),
        # a bool mask (True = masked) with one fully masked query row: output 0, logsumexp -inf
        "attention mask BNSD": (_lse(lambda k, q, kk, v: k.attention(q, kk, v, layout="BNSD", head_num=n,
                                                                     mask=mask.to(q.device))), bnsd, 1),
        "ring_attention_update": (lambda k, po, pm, ps, co, cm, cs: k.ring_attention_update(po, pm, ps, co, cm, cs),
                                  [qkv[0], *stats, qkv[1], stats[1] - 1.0, stats[0].abs() + 0.5], 1),
        "gmm": (lambda k, x, w: k.gmm(x, w, [3, 3, 7, 11], 0), [_rand(12, 16), _rand(4, 16, 8, seed=1)], 1),
        "matmul_add_fp32": (lambda k, x, dy, mg: k.matmul_add_fp32(x, dy, mg.float().clone()),
                            [_rand(3, 5, 16), _rand(3, 5, 8, seed=1), _rand(8, 16, seed=2)], 0),
        "grouped_matmul_add_fp32": (lambda k, x, dy, mg: k.grouped_matmul_add_fp32(x, dy, [3, 9, 12], mg.float().clone()),
                                    [_rand(12, 16), _rand(12, 8, seed=1), _rand(3 * 16 * 8, seed=2)], 0),
        "moe_permute + unpermute": (
            lambda k, t, p: k.moe_unpermute(k.moe_permute(t, routing.to(t.device))[0] * 1.5,
                                            k.moe_permute(t, routing.to(t.device))[1], p, t.shape),
            [_rand(10, 12), _rand(rows, seed=1).abs()], 1),
        "dropout_add_layer_norm": (lambda k, x, r, w, bi: k.dropout_add_layer_norm(x, r, w, bi, 0.0, 1e-5)[0],
                                   [_rand(4, 6, 32), _rand(4, 6, 32, seed=1), _rand(32, seed=2), _rand(32, seed=3)], 1),
    }


CASES = _kernel_cases()


def _float_inputs(inputs, dtype, device):
    """Floating inputs in `dtype` on `device`; fp32 main-grad buffers stay fp32 inside the case."""
    return [t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device) for t in inputs]


def _run(call, kernels, inputs, n_out):
    """Outputs and input gradients; the in-place accumulating kernels (no backward) run under no_grad."""
    if n_out == 0:
        with torch.no_grad():
            out = call(kernels, *inputs)
        return [out], []
    outs, grads = run(lambda *xs: call(kernels, *xs), inputs, n_out=n_out)
    return outs, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_each_kernel_on_cuda_matches_the_fp64_reference_forward_and_backward(name, dtype):
    call, inputs, n_out = CASES[name]
    cuda = TorchKernels("cuda")
    kernel = name.split()[0]
    expected = getattr(cuda_paths, kernel) if kernel in FAST_PATHS["cuda"] else getattr(R, kernel)
    assert cuda.implementation(kernel) is expected
    gpu_out, gpu_grad = _run(call, cuda, _float_inputs(inputs, dtype, "cuda"), n_out)
    assert gpu_out and all(t.device.type == "cuda" for t in gpu_out + gpu_grad), name
    truth_out, truth_grad = _run(call, R, _float_inputs(inputs, torch.float64, "cpu"), n_out)
    gpu = [t.cpu() for t in gpu_out + gpu_grad]
    truth = truth_out + truth_grad
    assert len(gpu) == len(truth), name
    if dtype == torch.float32:
        for g, t in zip(gpu, truth):
            torch.testing.assert_close(g.double(), t.double(), atol=1e-5, rtol=1e-4)
    else:   # bf16: no further from the truth than twice the CPU's bf16 reference, plus a floor
        ref_out, ref_grad = _run(call, R, _float_inputs(inputs, dtype, "cpu"), n_out)
        assert_low_precision_ok(gpu, ref_out + ref_grad, truth)


# -- the trainer ------------------------------------------------------------------------------------
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1",
         "--eval-iters", "0", "--split", "90,10,0", "--use-flash-attn"]   # attention: each device's fast path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    words = ["the king", "a fool", "my lord", "loves", "fears", "the crown", "the sea", "a ghost"]
    documents = [[" ".join(rng.choice(words) for _ in range(6)) + "." for _ in range(200)] for _ in range(10)]
    return build_indexed_corpus(tmp_path_factory.mktemp("gpu_data"), documents)


def _train(tmp_path, name, device, *extra, iters=12):
    losses = tmp_path / f"{name}.jsonl"
    result = run_pretrain_gpt("--device", device, *MODEL, "--train-iters", str(iters), "--data-path",
                              _train.corpus, "--log-loss-file", str(losses), *extra, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return {rec["iteration"]: rec["lm_loss"] for rec in map(json.loads, open(losses))}, result.stdout


@pytest.fixture(scope="module")
def gpu_run(corpus, tmp_path_factory):
    _train.corpus = corpus
    tmp = tmp_path_factory.mktemp("gpu_run")
    losses, log = _train(tmp, "cuda", "cuda", "--save", str(tmp / "ckpt"), "--save-interval", "6")
    return losses, log, tmp / "ckpt"


@pytest.fixture(scope="module")
def cpu_run(corpus, tmp_path_factory):
    _train.corpus = corpus
    tmp = tmp_path_factory.mktemp("cpu_run")
    losses, _ = _train(tmp, "cpu", "cpu", "--save", str(tmp / "ckpt"), "--save-interval", "2")
    return losses, tmp / "ckpt"


def _resume(ckpt, iteration, tmp_path, name, device):
    """Train on `device` from the save of `iteration` in `ckpt`, to the end (the tracker restored)."""
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "12"
    tracker.write_text(str(iteration))
    try:
        return _train(tmp_path, name, device, "--load", str(ckpt))
    finally:
        tracker.write_text("12")


def test_the_trainer_steps_on_one_gpu_as_on_the_cpu(cpu_run, gpu_run, tmp_path):
    """The same weights (the CPU run's save of iteration 2; a fresh start draws its initial weights
    from each device's own generator, as Megatron-Core does) trained on the GPU give the CPU run's
    losses; and the GPU run learns."""
    cpu, ckpt = cpu_run
    resumed, log = _resume(ckpt, 2, tmp_path, "gpu_from_cpu", "cuda")
    assert sorted(resumed) == list(range(3, 13)), log[-2000:]
    gap = max(abs(resumed[i] - cpu[i]) for i in resumed)
    print(f"largest |cuda - cpu| lm loss, iterations 3-12 from the same weights: {gap:.2e}")
    assert gap < 1e-3, (resumed, cpu)
    gpu, _, _ = gpu_run
    assert sum(gpu[i] for i in (10, 11, 12)) < sum(gpu[i] for i in (1, 2, 3)) - 0.9   # 0.3 a step on average


def test_a_checkpoint_saved_on_the_gpu_resumes_on_the_cpu(gpu_run, tmp_path):
    gpu, _, ckpt = gpu_run
    resumed, log = _resume(ckpt, 6, tmp_path, "resumed", "cpu")
    assert sorted(resumed) == list(range(7, 13)), log[-2000:]
    gap = max(abs(resumed[i] - gpu[i]) for i in resumed)
    print(f"largest |cpu resumed - cuda| lm loss, iterations 7-12: {gap:.2e}")
    assert gap < 1e-3, (resumed, gpu)


def test_bf16_on_the_gpu_learns_close_to_fp32(gpu_run, tmp_path):
    fp32, _, _ = gpu_run
    bf16, _ = _train(tmp_path, "bf16", "cuda", "--bf16")
    gap = max(abs(bf16[i] - fp32[i]) for i in fp32)
    print(f"largest |bf16 - fp32| lm loss on cuda: {gap:.3f}")
    assert gap < 0.1, (bf16, fp32)
    assert sum(bf16[i] for i in (10, 11, 12)) < sum(bf16[i] for i in (1, 2, 3)) - 0.9
