"""The MindSpore trainer's MoE layer (training/mindspore/moe.py) against small numpy references:
Megatron-Core 0.16's top-k routing (top-k by logit, softmax over the k), its switch load-balancing
loss and that loss's gradient (added where the probabilities enter, the forward unchanged), and
one layer's output (every token the probability-weighted sum of its k experts, none dropped), on
the plain path and on each MoE feature's path."""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspeed.training.mindspore import moe  # noqa: E402

T, E, K, COEFF = 12, 4, 2, 0.3


def _logits(seed=0):
    return np.random.RandomState(seed).randn(T, E).astype(np.float32)


def _softmax(x):
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _top(logits):
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :K]
    return idx, _softmax(np.take_along_axis(logits, idx, 1))


def _aux_reference(logits):
    """Switch Transformer's loss as Megatron's docstring writes it: E * coeff * sum_i f_i * P_i,
    f_i the fraction of the T*k routings that chose expert i, P_i its mean probability."""
    scores = _softmax(logits)
    counts = np.zeros(E)
    for row in np.argsort(-scores, axis=1)[:, :K]:
        counts[row] += 1
    return E * COEFF * np.sum(counts / (T * K) * scores.mean(0)), scores, counts


def test_routing_is_topk_by_logit_then_softmax_over_the_k():
    logits = _logits()
    probs, idx = moe.route(ms.Tensor(logits), K)
    ref_idx, ref_probs = _top(logits)
    np.testing.assert_array_equal(idx.asnumpy(), ref_idx)
    np.testing.assert_allclose(probs.asnumpy(), ref_probs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probs.asnumpy().sum(1), 1.0, rtol=1e-6)


def test_load_balancing_loss_and_its_gradient():
    logits = _logits(1)
    ref, scores, counts = _aux_reference(logits)
    assert float(moe.load_balancing_loss(ms.Tensor(logits), K, COEFF).asnumpy()) == pytest.approx(ref, rel=1e-5)
    # d/dlogits of C * sum_t sum_e s_te n_e = C * s_tj * (n_j - sum_e s_te n_e)
    c = E * COEFF / (K * T * T)
    ref_grad = c * scores * (counts[None] - (scores * counts[None]).sum(1, keepdims=True))
    grad = ms.grad(lambda x: moe.load_balancing_loss(x, K, COEFF))(ms.Tensor(logits))
    np.testing.assert_allclose(grad.asnumpy(), ref_grad, rtol=1e-4, atol=1e-9)


def test_aux_gradient_is_added_where_the_probabilities_enter():
    """Megatron's MoEAuxLossAutoScaler: the forward is the probabilities alone, the backward that
    of (probabilities used) + aux loss."""
    from mindspeed.backends.mindspore.autograd import MsAutograd
    logits, weights = ms.Tensor(_logits(2)), ms.Tensor(np.random.RandomState(3).randn(T, K).astype(np.float32))

    def attached(x):
        probs, _ = moe.route(x, K)
        return (moe.attach_aux_gradient(MsAutograd(), probs, moe.load_balancing_loss(x, K, COEFF)) * weights).sum()

    def summed(x):
        probs, _ = moe.route(x, K)
        return (probs * weights).sum() + moe.load_balancing_loss(x, K, COEFF)

    def plain(x):
        return (moe.route(x, K)[0] * weights).sum()
    assert float(attached(logits).asnumpy()) == pytest.approx(float(plain(logits).asnumpy()), abs=0)
    np.testing.assert_allclose(ms.grad(attached)(logits).asnumpy(), ms.grad(summed)(logits).asnumpy(),
                               rtol=1e-5, atol=1e-8)
    assert not np.allclose(ms.grad(attached)(logits).asnumpy(), ms.grad(plain)(logits).asnumpy(), atol=1e-6)


def _silu(x):
    return x / (1 + np.exp(-x))


# the MoE features' paths through the layer (GPTConfig fields the trainer sets from the enabled
# features) and the steps each must take (the layer's `schedule`)
PATHS = {
    "plain": ({}, ["permute:host", "dispatch", "experts:loop", "combine", "shared"]),
    "fused-moe-token-permute-and-unpermute": (dict(fused_kernels=frozenset({"moe_permute", "moe_unpermute"})),
                                              ["permute:kernel", "dispatch", "experts:loop", "combine", "shared"]),
    "moe-grouped-gemm": (dict(fused_kernels=frozenset({"gmm"})),
                         ["permute:host", "dispatch", "experts:gmm", "combine", "shared"]),
    "moe-alltoall-overlap-comm": (dict(moe_dispatch=frozenset({"moe-alltoall-overlap-comm"})),
                                  ["permute:host"] + ["dispatch", "experts:loop", "combine"] * 2 + ["shared"]),
    "moe-shared-expert-overlap": (dict(moe_dispatch=frozenset({"moe-shared-expert-overlap"})),
                                  ["shared", "permute:host", "dispatch", "experts:loop", "combine"]),
}


def _layer_model(**path):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from mindspeed.training.mindspore.model import GPTConfig, GPTModel, init_full_weights
    from mindspeed.training.mindspore.parallel import build_parallel_state
    backend = MindSporeBackend("cpu")
    cfg = GPTConfig(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=2,
                    kv_channels=4, vocab_size=32, seq_length=6, num_experts=E, moe_router_topk=K,
                    moe_ffn_hidden_size=5, moe_shared_expert_size=3, init_method_std=0.5, moe_aux_loss_coeff=COEFF,
                    **path)
    model = GPTModel(cfg, backend, build_parallel_state(backend.comm, 1))
    w = init_full_weights(cfg, 4)
    model.load_full(w)
    return model, w


def _gradients(model, x, dy):
    names = sorted(model.params)
    fn = ms.value_and_grad(lambda t: (model._mlp(0, t) * dy).sum(), 0, weights=[model.params[n] for n in names])
    _, (dx, dw) = fn(x)
    return dx.asnumpy(), {n: g.asnumpy() for n, g in zip(names, dw)}


@pytest.fixture(scope="module")
def plain_gradients():
    x, dy = (ms.Tensor(np.random.RandomState(s).randn(6, 2, 8).astype(np.float32)) for s in (5, 6))
    return x, dy, _gradients(_layer_model()[0], x, dy)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_layer_output_is_each_tokens_weighted_experts(path, plain_gradients):
    """Every path gives numpy's output (each token its shared experts plus the probability-weighted
    sum of its k experts), the plain path's input and weight gradients (the kernels' fp32 tolerance,
    docs/kernels.md), and takes its own steps."""
    from mindspeed.checkpoint import neutral as nf
    config, steps = PATHS[path]
    model, w = _layer_model(**config)
    x, dy, (plain_dx, plain_dw) = plain_gradients
    out = model._mlp(0, x).asnumpy().reshape(-1, 8)
    assert model.moe_layers[0].schedule == steps
    flat = x.asnumpy().reshape(-1, 8)
    idx, probs = _top(flat @ w[nf.layer_name(0, "mlp.router.weight")].T)

    def mlp(prefix, rows):
        gate, up = np.split(rows @ w[nf.layer_name(0, prefix + "linear_fc1.weight")].T, 2, -1)
        return (_silu(gate) * up) @ w[nf.layer_name(0, prefix + "linear_fc2.weight")].T
    ref = mlp("mlp.shared_experts.", flat)
    for t in range(flat.shape[0]):
        for j in range(K):
            ref[t] += probs[t, j] * mlp(f"mlp.experts.local_experts.{idx[t, j]}.", flat[t:t + 1])[0]
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    dx, dw = _gradients(model, x, dy)
    np.testing.assert_allclose(dx, plain_dx, rtol=1.3e-6, atol=1e-5)
    assert sorted(dw) == sorted(plain_dw)
    for name, g in dw.items():
        np.testing.assert_allclose(g, plain_dw[name], rtol=1.3e-6, atol=1e-5, err_msg=name)
    assert any(np.abs(g).max() > 0 for n, g in dw.items() if "local_experts" in n)


@pytest.mark.parametrize("extra, says", [
    (("--context-parallel-size", "2"), "context parallel size 1"),
    (("--moe-token-dispatcher-type", "allgather", "--moe-permutation-async-comm", "--expert-model-parallel-size", "2"),
     "on the host, synchronously"),
    (("--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"), "ranks of a pipeline stage"),
    (("--add-bias-linear",), "no linear biases"),
    (("--recompute-activation-function",), "experts' activation"),
])
def test_what_the_layer_does_not_do_is_refused_in_one_line(extra, says):
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    with pytest.raises(MindSpeedConfigError) as err:
        plan(["--backend", "mindspore", "--num-experts", "4", *extra])
    assert says in str(err.value) and "\n" not in str(err.value)
    plan(["--backend", "torch", "--num-experts", "4", *extra])        # Megatron-Core runs each of them


@pytest.mark.parametrize("extra", [("--pipeline-model-parallel-size", "2"), ("--moe-token-dispatcher-type", "allgather"),
                                   ("--moe-token-dispatcher-type", "allgather", "--expert-model-parallel-size", "2"),
                                   ("--tensor-model-parallel-size", "2", "--sequence-parallel")])
def test_the_layouts_the_layer_runs_are_accepted(extra):
    """MoE at PP 2 (EP 1), the allgather dispatcher and experts split over TP 2 with SP
    (test_mindspore_parity_moe.py runs them)."""
    from mindspeed.adaptor_core import plan
    assert "moe" in {f.id for f in plan(["--backend", "mindspore", "--num-experts", "4", *extra]).features}


# --- the router's options against Megatron-Core's own functions (torch, in process) -------------------
ROUTERS = {   # name -> (RouterSettings fields, top-k); 8 experts
    "sigmoid": (dict(score_function="sigmoid"), 2),
    "sigmoid-groups-scaled": (dict(score_function="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5), 4),
    "softmax-pre-softmax": (dict(pre_softmax=True), 2),
    "softmax-groups": (dict(num_groups=2, group_topk=1), 2),
    "sigmoid-top1": (dict(score_function="sigmoid"), 1),
    # noaux_tc: the bias (expert_bias.py) chooses the experts, the unbiased scores weight them
    "sigmoid-groups-expert-bias": (dict(score_function="sigmoid", num_groups=4, group_topk=2, expert_bias=True), 4),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_options_route_and_differentiate_as_megatron_core(name):
    import torch
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from mindspore import ops
    from mindspeed.training.mindspore.router_settings import RouterSettings
    fields, k = ROUTERS[name]
    router = RouterSettings(**fields)
    logits = np.random.RandomState(3).randn(T, 8).astype(np.float32)
    weights = np.random.RandomState(4).randn(T, 8).astype(np.float32)     # d(loss)/d(routing probs)
    bias = (np.random.RandomState(5).randn(8) * 0.3).astype(np.float32) if router.expert_bias else None
    theirs = torch.tensor(logits, requires_grad=True)
    probs_t, routing_map = topk_routing_with_score_function(
        theirs, k, use_pre_softmax=router.pre_softmax, num_groups=router.num_groups, group_topk=router.group_topk,
        scaling_factor=router.scaling_factor, score_function=router.score_function,
        expert_bias=None if bias is None else torch.tensor(bias))
    (probs_t * torch.tensor(weights)).sum().backward()
    if bias is not None:     # the bias changes which experts are chosen
        assert routing_map.tolist() != topk_routing_with_score_function(
            theirs.detach(), k, num_groups=router.num_groups, group_topk=router.group_topk,
            score_function="sigmoid")[1].tolist()

    def dense(x):     # [T, k] probabilities and indices -> [T, E], as Megatron-Core's routing_probs
        probs, idx = moe.route(x, k, router, None if bias is None else ms.Tensor(bias))
        one_hot = ops.one_hot(idx, 8, ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32))     # [T, k, E]
        return (one_hot * probs.expand_dims(-1)).sum(1), idx
    ours, idx = dense(ms.Tensor(logits))
    assert (moe._one_hot_sum(idx, 8).asnumpy() > 0).tolist() == routing_map.numpy().tolist()
    np.testing.assert_allclose(ours.asnumpy(), probs_t.detach().numpy(), rtol=1e-5, atol=1e-6)
    grad = ms.grad(lambda x: (dense(x)[0] * ms.Tensor(weights)).sum())(ms.Tensor(logits))
    np.testing.assert_allclose(grad.asnumpy(), theirs.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("sequences", [0, 3])
def test_aux_and_sequence_aux_losses_are_megatron_cores(score_function, sequences):
    """--seq-aux (seq_aux_loss): T = s x b tokens laid out [s, b], as Megatron-Core's router reshapes them;
    loss and gradient equal Megatron-Core's router arithmetic (compute_routing_scores_for_aux_loss, then
    switch_load_balancing_loss_func over [s, b x E], divided by b)."""
    import torch
    from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                         switch_load_balancing_loss_func)
    logits = np.random.RandomState(5).randn(T, 8).astype(np.float32)
    theirs = torch.tensor(logits, requires_grad=True)
    routing_map, scores = compute_routing_scores_for_aux_loss(theirs, K, score_function)
    b = sequences or 1
    loss_t = switch_load_balancing_loss_func(scores.reshape(T // b, -1), routing_map.reshape(T // b, -1).sum(0),
                                             T // b, K, 8, COEFF) / b
    loss_t.backward()
    loss = lambda x: moe.load_balancing_loss(x, K, COEFF, score_function=score_function, sequences=sequences)
    assert float(loss(ms.Tensor(logits)).asnumpy()) == pytest.approx(float(loss_t), rel=1e-6)
    np.testing.assert_allclose(ms.grad(loss)(ms.Tensor(logits)).asnumpy(), theirs.grad.numpy(), rtol=1e-5, atol=1e-7)
    if sequences:    # the per-sequence counts change the loss
        assert float(loss(ms.Tensor(logits)).asnumpy()) != pytest.approx(
            float(moe.load_balancing_loss(ms.Tensor(logits), K, COEFF, score_function=score_function).asnumpy()))


@pytest.mark.parametrize("extra, says", [
    (("--moe-router-load-balancing-type", "noaux_tc", "--norm-topk-prob", "--pipeline-model-parallel-size", "2",
      "--num-layers", "2"), "an expert bias"),
    (("--moe-router-load-balancing-type", "global_aux_loss"), "--moe-router-load-balancing-type global_aux_loss"),
    (("--moe-router-dtype", "fp64"), "--moe-router-dtype fp64"),
])
def test_router_options_the_mindspore_router_lacks_are_refused_in_one_line(extra, says):
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    with pytest.raises(MindSpeedConfigError) as err:
        plan(["--backend", "mindspore", "--num-experts", "4", *extra])
    assert says in str(err.value) and "\n" not in str(err.value)
    plan(["--backend", "torch", "--num-experts", "4", *extra])        # Megatron-Core's router runs each
    plan(["--backend", "mindspore", "--num-experts", "4", "--moe-router-score-function", "sigmoid", "--norm-topk-prob",
          "--seq-aux", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-dtype", "fp32",
          "--moe-router-enable-expert-bias"])
