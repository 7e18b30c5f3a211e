"""--gradient-accumulation-fusion on the MindSpore trainer (training/mindspore/main_grad.py): the
decoder and output linears' weight gradients (tied embeddings: the output layer's share of the word
embeddings' gradient) go into fp32 main grads through the backend's matmul_add_fp32
kernel, summed over the micro-batches; 3 steps of 2 micro-batches each give the plain trainer's
losses and gradient norms (fp32, the kernels' tolerance of docs/kernels.md), and the path is the
kernel's: MindSpore's own gradient of those weights is zero, their main grads are not.

--gemm-gradient-accumulation-fusion with --moe-grouped-gemm: the grouped experts' weight gradients
go into fp32 main grads through grouped_matmul_add_fp32; in fp32 the losses and norms are the
plain grouped trainer's bit for bit (the same GEMMs, and the mean over 2 micro-batches, (a + b) / 2
against a / 2 + b / 2, is exact in binary floating point), and in bf16 the main grad of 2
micro-batches is the fp32 sum of each one's, not a bf16 one."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from tests_extend.distributed import mindspore_parity as mp  # noqa: E402

STEPS, MICRO = 3, 2
LINEARS = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
           "mlp.linear_fc2.weight")


def _micro_batches(step):
    return [dict(zip(("tokens", "labels", "loss_mask"), mp.batch(MICRO * step + m))) for m in range(MICRO)]


def _train(features, extra=(), steps=STEPS):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    backend = MindSporeBackend("cpu")
    # tied embeddings (Megatron's default): the output layer's main grad adds to the lookup's gradient
    argv = [a for a in mp.trainer_argv(1) if a != "--untie-embeddings-and-output-weights"]
    args = parse_args(argv + ["--global-batch-size", str(MICRO * mp.MBS), *extra])
    trainer = Trainer(args, backend, build_parallel_state(backend.comm, 1), GPTConfig.from_args(args, mp.VOCAB, features))
    losses, norms = [], []
    for step in range(steps):
        loss, norm, _ = trainer.train_step(_micro_batches(step), step + 1)
        losses.append(loss)
        norms.append(norm)
    return trainer, losses, norms


def test_fused_weight_gradients_give_the_plain_steps():
    from mindspeed.checkpoint import neutral as nf
    plain, plain_losses, plain_norms = _train([])
    fused, losses, norms = _train(["gradient-accumulation-fusion"])
    np.testing.assert_allclose(losses, plain_losses, atol=1e-5, rtol=0)
    np.testing.assert_allclose(norms, plain_norms, rtol=1e-5)
    assert plain.ps.main_grads is None and plain.graph_mode
    assert not fused.graph_mode          # the kernel runs in a custom backward, which a trace skips
    linears = {nf.layer_name(i, s) for i in range(int(mp.LAYERS)) for s in LINEARS}
    embedding = "embedding.word_embeddings.weight"
    assert set(fused.ps.main_grads.buffers) == linears | {embedding}
    # the last step's sums are in the main grads; MindSpore's own gradient of the linears is zero,
    # of the tied embedding the lookup's alone
    inputs = fused._inputs(_micro_batches(0)[0])
    _, grads = fused._grad_fn(*inputs)
    by_name = dict(zip(fused.model.params, grads))
    for name in linears | {embedding}:
        assert float(np.abs(fused.ps.main_grads.buffers[name].asnumpy()).max()) > 0.0, name
        assert (float(np.abs(by_name[name].asnumpy()).max()) > 0.0) == (name == embedding), name


@pytest.mark.parametrize("argv, says", [
    (["--gradient-accumulation-fusion", "--use-ascend-coc", "--coc-parallel-num", "2",
      "--tensor-model-parallel-size", "2"], "not --use-ascend-coc's"),
])
def test_main_grad_paths_the_trainer_lacks_are_refused_in_one_line(argv, says):
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    with pytest.raises(MindSpeedConfigError) as err:
        plan(["--backend", "mindspore", *argv])
    assert says in str(err.value) and "\n" not in str(err.value)


MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-grouped-gemm")
EXPERT_WEIGHTS = ("linear_fc1.weight", "linear_fc2.weight")


def _expert_names():
    from mindspeed.checkpoint import neutral as nf
    return {nf.expert_name(i, e, s) for i in range(int(mp.LAYERS)) for e in range(4) for s in EXPERT_WEIGHTS}


def test_grouped_expert_main_grads_give_the_plain_grouped_steps_bit_for_bit():
    plain, plain_losses, plain_norms = _train(["moe-grouped-gemm"], MOE)
    fused, losses, norms = _train(["moe-grouped-gemm"], MOE + ("--gemm-gradient-accumulation-fusion",))
    assert losses == plain_losses and norms == plain_norms
    main_grads = fused.ps.main_grads
    assert plain.ps.main_grads is None and main_grads.experts and not main_grads.dense
    assert not main_grads.buffers       # the dense linears keep MindSpore's gradients
    assert {n for names in main_grads.grouped for n in names} == _expert_names()
    # MindSpore's own gradient of the expert weights is zero; their main grads are not
    _, grads = fused._grad_fn(*fused._inputs(_micro_batches(0)[0]))
    by_name = dict(zip(fused.model.params, grads))
    for name in _expert_names():
        assert float(np.abs(by_name[name].asnumpy()).max()) == 0.0, name
        assert float(np.abs(main_grads.of(name).asnumpy()).max()) > 0.0, name


def _main_grads_after(trainer, micro_batches) -> dict:
    main_grads = trainer.ps.main_grads
    main_grads.zero()
    for mb in micro_batches:
        trainer._grad_fn(*trainer._inputs(mb))
    return {name: main_grads.of(name).asnumpy().astype(np.float64) for name in _expert_names()}


def test_bf16_expert_main_grads_are_the_fp32_sum_over_micro_batches():
    fused, losses, _ = _train(["moe-grouped-gemm"], MOE + ("--gemm-gradient-accumulation-fusion", "--bf16"), 1)
    assert np.isfinite(losses).all()
    assert fused.model.params[next(iter(_expert_names()))].dtype == ms.bfloat16
    micro = _micro_batches(1)
    each = [_main_grads_after(fused, [mb]) for mb in micro]
    summed = _main_grads_after(fused, micro)
    bf16_rounded = 0
    for name, total in summed.items():
        assert fused.ps.main_grads.of(name).dtype == ms.float32
        # the fp32 sum of each micro-batch's fp32 main grad: one fp32 addition, as the kernel's
        np.testing.assert_array_equal(total, (each[0][name].astype(np.float32) + each[1][name].astype(np.float32)))
        as_bf16 = ms.Tensor(total.astype(np.float32)).astype(ms.bfloat16).astype(ms.float32).asnumpy()
        bf16_rounded += int((as_bf16 != total).sum())
    assert bf16_rounded > 0        # fp32 values a bf16 accumulation could not hold
