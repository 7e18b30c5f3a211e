"""The mindspore backend's declared capabilities, MSAdapter detection, the missing-MindSpore
message, and its autograd/memory/RNG parts on real MindSpore."""
import os
import subprocess
import sys

import numpy as np
import pytest

from mindspeed.backends.base import Cap, Level
from mindspeed.backends.mindspore import capabilities

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str, pythonpath: str = ROOT, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=pythonpath, GLOG_v="3")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# -- declared capabilities (framework-free) -------------------------------------------------------
def test_every_capability_is_declared_on_every_device():
    for device in capabilities.DEVICES:
        caps = capabilities.declared(device)
        assert set(caps) == set(Cap.all()), device
        assert all(isinstance(level, Level) for level in caps.values())


def test_cpu_declares_the_collectives_it_builds_as_emulated():
    cpu, ascend = capabilities.declared("cpu"), capabilities.declared("ascend")
    for cap in (Cap.REDUCE_SCATTER, Cap.ALL_TO_ALL, Cap.SEND_RECV, Cap.ALL_GATHER, Cap.BROADCAST):
        assert cpu[cap] is Level.EMULATED and ascend[cap] is Level.NATIVE, cap
    assert cpu[Cap.ALL_REDUCE] is Level.NATIVE
    assert cpu[Cap.RMS_NORM] is Level.EMULATED and ascend[Cap.RMS_NORM] is Level.NATIVE
    assert cpu[Cap.MEGATRON_CORE] is Level.ABSENT and cpu[Cap.NATIVE_TRAINER] is Level.NATIVE
    assert set(capabilities.NOTES["cpu"]) <= set(Cap.all())


def test_only_cpu_is_verified_here():
    assert capabilities.verified("cpu") and not capabilities.verified("ascend")
    with pytest.raises(ValueError, match="no device 'gpu'"):
        capabilities.declared("gpu")


def test_framework_free_modules_do_not_import_mindspore():
    r = _python("import sys; import mindspeed.backends.mindspore.capabilities, "
                "mindspeed.backends.mindspore.msadapter, mindspeed.training.mindspore; "
                "print('mindspore' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


_BLOCK_TORCH = """
import runpy, sys
class Block:   # a MindSpore-only install: neither torch nor Megatron-Core can be imported
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "megatron"):
            raise ImportError("no module named " + name)
sys.meta_path.insert(0, Block())
sys.argv = ["pretrain_gpt.py"] + {argv!r}
runpy.run_path("tests_extend/example/pretrain_gpt.py", run_name="__main__")
"""


def test_mindspore_trainer_runs_without_torch_or_megatron():
    """The MindSpore trainer (parsing, gate, data, model, a step) needs neither torch nor Megatron-Core."""
    argv = ["--backend", "mindspore", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--eval-iters", "0", "--mock-data"]
    r = _python(_BLOCK_TORCH.format(argv=argv), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "iteration        1/       1" in r.stdout and "lm loss:" in r.stdout


_POOL_SIZED = (
    "from mindspeed.backends.mindspore.backend import MindSporeBackend\n"
    "from mindspore.device_context.cpu import op_tuning\n"
    "MindSporeBackend('cpu')\n"
    "try:\n    op_tuning.threads_num(2)\n    print('UNSET')\n"
    "except RuntimeError as e:\n    print('SET' if 'repeatedly' in str(e) else e)\n")


@pytest.mark.parametrize("omp, expected", [("1", "SET"), ("", "UNSET")])
def test_omp_num_threads_sizes_mindspores_cpu_kernel_pool(monkeypatch, omp, expected):
    """The launch scripts' OMP_NUM_THREADS=1 (one compute thread per process) sizes MindSpore's CPU
    kernel pool too, which does not read it: MindSpore allows one setting per process, so a second
    one is refused once the backend has made it. Without the variable MindSpore keeps its own."""
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    r = _python(_POOL_SIZED)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == expected


def test_the_kernel_pool_leaves_a_compute_thread_to_the_launching_thread():
    """With synchronous ops the thread that launches a kernel computes a share of it: N compute
    threads are the launching thread and a pool of N - 1 (a pool of 2 beside it was 1.4x slower
    for the trainer at two threads on two cores: docs/performance.md)."""
    from mindspeed.backends.mindspore.device import kernel_pool_size
    assert [kernel_pool_size(n) for n in ("1", "2", "4")] == [1, 1, 3]
    assert [kernel_pool_size(n) for n in ("", "0", "two")] == [None, None, None]


# -- MSAdapter detection ------------------------------------------------------------------------------
def _fake_msadapter(tmp_path):
    """An MSAdapter-style checkout: MSAdapter/mindtorch/torch/__init__.py built on MindSpore."""
    pkg = tmp_path / "MSAdapter" / "mindtorch" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import mindspore\nfrom mindtorch.torch import *\n")
    return str(tmp_path / "MSAdapter" / "mindtorch")


def test_msadapter_detected_when_torch_resolves_to_it(tmp_path):
    path = _fake_msadapter(tmp_path)
    code = ("from mindspeed.backends.mindspore import msadapter as m; "
            "print(m.msadapter_active()); print(m.describe())")
    active = _python(code, pythonpath=os.pathsep.join([path, ROOT]))
    assert active.returncode == 0, active.stderr
    flag, line = active.stdout.strip().splitlines()
    assert flag == "True" and "MSAdapter" in line and "mindspore backend serves" in line
    plain = _python(code)
    assert plain.stdout.strip().splitlines()[0] == "False"


def test_msadapter_makes_the_adaptor_choose_mindspore(tmp_path):
    path = _fake_msadapter(tmp_path)
    code = ("from mindspeed.adaptor_core import plan; p = plan([]); print(p.backend, p.msadapter)")
    r = _python(code, pythonpath=os.pathsep.join([path, ROOT]))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "mindspore True"


# -- without MindSpore ------------------------------------------------------------------------------
_HIDE_MINDSPORE = (
    "import sys, importlib.abc\n"
    "class Hide(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'mindspore' or name.startswith('mindspore.'):\n"
    "            raise ModuleNotFoundError(\"No module named 'mindspore'\")\n"
    "sys.meta_path.insert(0, Hide())\n")


def test_missing_mindspore_names_the_install_command():
    r = _python(_HIDE_MINDSPORE + (
        "from mindspeed.backends import BackendUnavailableError, set_backend\n"
        "try:\n    set_backend('mindspore')\nexcept BackendUnavailableError as e:\n    print('REFUSED', e)\n"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("REFUSED") and 'pip install mindspore==2.10.0 "numpy<2"' in r.stdout


def test_missing_mindspore_refuses_the_trainer_before_work():
    r = _python(_HIDE_MINDSPORE + (
        "from mindspeed.flags.trainer_flags import parse_args\n"
        "from mindspeed.training import mindspore as trainer\n"
        "try:\n    trainer.run(parse_args(['--backend', 'mindspore', '--mock-data']))\n"
        "except Exception as e:\n    print('REFUSED', type(e).__name__, e)\n"))
    assert r.returncode == 0, r.stderr
    assert "REFUSED BackendUnavailableError" in r.stdout and "pip install mindspore==2.10.0" in r.stdout


# -- autograd, memory, RNG on real MindSpore ---------------------------------------------------------
ms = pytest.importorskip("mindspore")


@pytest.fixture(scope="module")
def backend():
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    return MindSporeBackend("cpu")


def test_registry_builds_the_backend(backend):
    from mindspeed.backends import backend_class
    assert backend_class("mindspore") is type(backend)
    assert backend.name == "mindspore" and backend.device.name == "cpu"
    assert backend.capabilities() == capabilities.declared("cpu")
    assert backend.comm.world_size() == 1 and backend.comm.rank() == 0


def test_custom_op_uses_the_given_backward(backend):
    def forward(ctx, x, y):
        ctx.save(x, y)
        return x * y

    def backward(ctx, dz):
        x, y = ctx.saved
        return dz * y * 10.0, None          # deliberately not the true gradient of x

    op = backend.autograd.custom_op(forward, backward)
    x, y = ms.Tensor(np.array([1.0, 2.0], np.float32)), ms.Tensor(np.array([3.0, 4.0], np.float32))
    gx, gy = ms.grad(lambda a, b: op(a, b).sum(), grad_position=(0, 1))(x, y)
    np.testing.assert_allclose(gx.asnumpy(), [30.0, 40.0])
    np.testing.assert_allclose(gy.asnumpy(), [0.0, 0.0])


def test_custom_op_takes_non_tensor_inputs_in_their_places(backend):
    """Constants between tensors (as coc.py passes group, flags and chunk counts) reach forward
    where they were given; each tensor gets backward's gradient at its own position."""
    def forward(ctx, x, scale, y, name):
        assert (scale, name) == (3, "g")
        ctx.save(y)
        return x * y * scale

    def backward(ctx, dz):
        (y,) = ctx.saved
        return dz * y * 10.0, None, dz * 100.0, None      # deliberately not the true gradients

    op = backend.autograd.custom_op(forward, backward)
    x, y = ms.Tensor(np.array([1.0, 2.0], np.float32)), ms.Tensor(np.array([3.0, 4.0], np.float32))
    np.testing.assert_allclose(op(x, 3, y, "g").asnumpy(), [9.0, 24.0])
    gx, gy = ms.grad(lambda a, b: op(a, 3, b, "g").sum(), grad_position=(0, 1))(x, y)
    np.testing.assert_allclose(gx.asnumpy(), [30.0, 40.0])
    np.testing.assert_allclose(gy.asnumpy(), [100.0, 100.0])


def test_recompute_gives_the_same_gradients_including_closed_over_parameters(backend):
    w = ms.Parameter(ms.Tensor(np.array([0.5, -1.5, 2.0], np.float32)), name="w")
    x = ms.Tensor(np.array([1.0, 2.0, 3.0], np.float32))
    fn = lambda t: ms.ops.tanh(t * w) * t
    plain = ms.grad(lambda t: fn(t).sum(), grad_position=0, weights=[w])(x)
    recomputed = ms.grad(lambda t: backend.memory.recompute(fn, t).sum(), grad_position=0, weights=[w])(x)
    np.testing.assert_allclose(recomputed[0].asnumpy(), plain[0].asnumpy(), rtol=1e-6)
    np.testing.assert_allclose(recomputed[1][0].asnumpy(), plain[1][0].asnumpy(), rtol=1e-6)


def test_rng_state_replays_random_ops(backend):
    backend.device.manual_seed(7)
    state = backend.device.get_rng_state()
    first = ms.ops.dropout(ms.Tensor(np.ones(64, np.float32)), p=0.5).asnumpy()
    backend.device.set_rng_state(state)
    again = ms.ops.dropout(ms.Tensor(np.ones(64, np.float32)), p=0.5).asnumpy()
    np.testing.assert_array_equal(first, again)
    assert 0 < (first == 0).sum() < 64


def test_offload_round_trip_and_peak_memory(backend):
    t = ms.Tensor(np.arange(6, dtype=np.float32))
    back = backend.memory.reload_to_device(backend.memory.offload_to_host(t))
    np.testing.assert_array_equal(back.asnumpy(), t.asnumpy())
    assert backend.memory.peak_memory_bytes() > 0


def test_single_process_collectives_are_identity(backend):
    x = ms.Tensor(np.arange(4, dtype=np.float32))
    for out in (backend.comm.all_reduce(x, "max"), backend.comm.all_gather(x), backend.comm.reduce_scatter(x),
                backend.comm.all_to_all(x, 0, 0), backend.comm.broadcast(x)):
        np.testing.assert_array_equal(out.asnumpy(), x.asnumpy())
    with pytest.raises(ValueError, match="unknown op"):
        backend.comm.all_reduce(x, "prod")


def test_fused_flags_route_the_trainer_model_through_the_fast_kernels(backend, monkeypatch):
    """On CPU the fast path *is* the reference (one bound method), so comparing the two proves
    nothing. Here the fast path is an independent numpy implementation of the kernel contract
    (ms_numpy_kernels) that records its calls: the fused model must call exactly the fast kernels
    its features name and the plain model none, and both must give the same logits, i.e. the
    MindSpore reference kernels agree with the independent ones inside the real model."""
    from mindspeed.backends.base import DispatchKernels
    from mindspeed.backends.mindspore.kernels import reference
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore.model import GPTConfig, GPTModel, init_full_weights
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from tests_extend.unit import ms_numpy_kernels as fast

    monkeypatch.setattr(backend, "kernels",
                        DispatchKernels(reference, fast, {"rms_norm", "swiglu", "rope", "attention"}))
    assert backend.kernels.rms_norm != backend.kernels.reference.rms_norm
    args = parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--group-query-attention", "--num-query-groups", "2", "--seq-length", "8",
                       "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                       "--disable-bias-linear"])
    ps = build_parallel_state(backend.comm, 1)
    tokens = ms.Tensor(np.random.RandomState(0).randint(0, 128, (2, 8)).astype(np.int32))

    def run(features):
        cfg = GPTConfig.from_args(args, 128, features)
        model = GPTModel(cfg, backend, ps)
        model.load_full(init_full_weights(cfg, 3))
        fast.CALLS.clear()
        logits = model.logits(tokens).asnumpy()
        return logits, set(fast.CALLS)

    plain, plain_calls = run([])
    everything, all_calls = run(["fused-rmsnorm", "fused-swiglu", "fused-rotary-pos-emb", "flash-attn", "profile"])
    some, some_calls = run(["fused-rmsnorm", "flash-attn"])
    assert plain_calls == set()
    assert all_calls == {"rms_norm", "swiglu", "rope", "attention"}
    assert some_calls == {"rms_norm", "attention"}
    assert np.abs(plain).max() > 0.1            # logits of some size, so the comparison means something
    np.testing.assert_allclose(everything, plain, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(some, plain, rtol=1e-4, atol=1e-5)


def test_noop_layers_pass_through_in_the_mindspore_gpt(backend):
    """--noop-layers 0,2 of 3 layers: no weights for layers 0 and 2, and the logits are those of a
    one-layer model whose layer holds layer 1's weights (the noop layers return their input)."""
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.checkpoint import neutral as nf
    from mindspeed.training.mindspore.model import GPTConfig, GPTModel, init_full_weights
    from mindspeed.training.mindspore.parallel import build_parallel_state

    def model(*flags):
        args = parse_args(["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8", *flags])
        return GPTConfig.from_args(args, 128)
    one, noop = model("--num-layers", "1"), model("--num-layers", "3", "--noop-layers", "0,2")
    weights = init_full_weights(one, 5)
    moved = {name.replace(nf.layer_name(0, ""), nf.layer_name(1, "")): w for name, w in weights.items()}
    assert set(noop.full_shapes()) == set(moved) and noop.real_layers() == [1]
    ps = build_parallel_state(backend.comm, 1)
    tokens = ms.Tensor(np.random.RandomState(0).randint(0, 128, (2, 8)).astype(np.int32))
    logits = []
    for cfg, full in ((one, weights), (noop, moved)):
        gpt = GPTModel(cfg, backend, ps)
        gpt.load_full(full)
        logits.append(gpt.logits(tokens).asnumpy())
    assert np.abs(logits[0]).max() > 0.1
    np.testing.assert_array_equal(logits[1], logits[0])
