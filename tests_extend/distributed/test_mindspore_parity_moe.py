"""Issue 15, MoE with expert parallelism: the MindSpore trainer's MoE layer (moe.py) against
Megatron-Core's MoE GPTModel on torch (CPU/gloo), fp32, the same initial weights and batches, the
load-balancing loss on: |lm loss difference| <= 1e-4 at every one of 20 steps, and the same
gradient norms, at EP=1 in one process (with shared experts) and at EP=2 on 2 processes (one msrun
launch; DP=2 with different batches per rank, tokens exchanged by the emulated all-to-all).
Checkpoints cross both ways: torch's trained EP=1 weights evaluate the same in MindSpore, and
MindSpore's EP=2 checkpoint (experts gathered from both ranks) loads into Megatron-Core at EP=2.
The MoE features on MindSpore (training/mindspore/moe.py) give the plain run's losses over 3 steps
and take their own steps: the kernels and shared-expert overlap at EP=1, the communication
features at EP=2 (in the same msrun launch). --moe-tp-extend-ep at TP=2 with sequence parallelism
(4 experts, 2 whole ones per TP rank) matches Megatron-Core with MindSpeed's torch hook the same
way, and its MindSpore checkpoint loads into Megatron-Core at that layout (in the same two launches:
one msrun, one gloo spawn running both torch layouts). --bf16 at EP=2 (the MoE layer computes in fp32
on its bf16 weights on CPU, backends/mindspore/precision.py) follows Megatron-Core's bf16 at EP=2 over
a few steps within test_mindspore_parity_bf16.py's bound, twice torch's own bf16 effect measured in
the same launch (EP=2 in bf16 and fp32 from the same bf16-representable weights), and bf16 moves its
losses beyond fp32's bound TOL. --use-distributed-optimizer at EP=2 (the dense state sharded over DP,
the experts' over expert-DP) gives Megatron-Core's losses and resumes from its checkpoint (same launch).
Megatron-Core's router options at EP=1 (noaux_tc's sigmoid scores with the per-step expert bias, group-limited
top-k, scaled weights, --seq-aux; in the EP=1 gloo spawn): its losses and grad norms over 20 steps, the same
biases, and each side's checkpoint evaluates the same on the other; with one MTP layer too (issue 55: an MoE
layer, as Megatron-Core's follows the decoder's), over 3 steps (20 with MINDSPEED_SLOW_TESTS=1)."""
import os

import numpy as np
import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed import mindspore_parity_fp16 as pf  # noqa: E402
from tests_extend.distributed import mindspore_parity_moe as pm  # noqa: E402
from tests_extend.distributed.harness import run_distributed  # noqa: E402
from tests_extend.distributed.msrun_helper import run_msrun  # noqa: E402

TOL = 1e-4
KERNEL_TOL = 1e-5           # docs/kernels.md: a kernel's path against the reference, fp32
COMM_TOL = 1e-6             # the MoE communication features reorder, they do not change the math
NORM_RTOL = 1e-4
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mindspore_parity_moe_worker.py")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_parity")
    paths = {k: str(root / k) for k in ("init_shared", "init", "init_bf16", "torch_final", "ms_final", "ms_final_tp",
                                        "ms_router", "torch_router", "ms_final_pp", "init_mtp", "torch_mtp")}
    pm.write_init(paths["init_shared"], shared=True)
    pm.write_init(paths["init_mtp"], shared=True, extra=pm.MTP_FLAGS)
    pm.write_init(paths["init"], shared=False)
    pm.write_init(paths["init_bf16"], shared=False, bf16=True)
    paths["root"] = root
    return paths


@pytest.fixture(scope="module")
def torch_ep1_runs(ckpts, ms_router):
    """One spawn: Megatron-Core at EP=1 with shared experts, with the router options (ROUTER_FIELDS), and with
    them and an MTP layer (MTP_FIELDS)."""
    return run_distributed(pm.torch_layouts, world_size=1, timeout=400, args=(
        [((1, True, ckpts["init_shared"], None, pm.mp.STEPS, ckpts["torch_final"]), {}),
         ((1, True, ckpts["init_shared"], ckpts["ms_router"], pm.mp.STEPS, ckpts["torch_router"]),
          {"router": pm.ROUTER_FIELDS}),
         ((1, True, ckpts["init_mtp"], None, MTP_STEPS, ckpts["torch_mtp"]),
          {"router": pm.ROUTER_FIELDS, "mtp": pm.MTP_FIELDS})],))[0]


@pytest.fixture(scope="module")
def torch_ep1(torch_ep1_runs):
    return torch_ep1_runs[0]


@pytest.fixture(scope="module")
def ms_router(ckpts):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    return pm.ms_train(MindSporeBackend("cpu"), 1, True, ckpts["init_shared"], save_dir=ckpts["ms_router"],
                       extra=pm.ROUTER_FLAGS)


def test_router_options_at_ep1_match_megatron(ckpts, ms_router, torch_ep1_runs):
    """noaux_tc (sigmoid scores with the expert bias, updated each step from the tokens per expert) in 2 groups
    (one per token), scaled by 2.5, with the sequence-level aux loss (--seq-aux): Megatron-Core's losses and grad
    norms over 20 fp32 steps; both checkpoints hold the same biases (Megatron's name) and each evaluates the same
    on the other side; the plain router's losses differ."""
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from mindspeed.checkpoint import neutral as nf
    plain, t = torch_ep1_runs[:2]
    np.testing.assert_allclose(ms_router["losses"], t["losses"], atol=TOL, rtol=0)
    np.testing.assert_allclose(ms_router["grad_norms"], t["grad_norms"], rtol=NORM_RTOL)
    assert t["eval_loss_of_other"] == pytest.approx(ms_router["eval_loss"], abs=TOL)
    assert np.abs(np.array(t["losses"]) - np.array(plain["losses"])).max() > 10 * TOL
    (theirs, _, _), (ours, _, _) = nf.load(ckpts["torch_router"]), nf.load(ckpts["ms_router"])
    biases = sorted(n for n in theirs if n.endswith("mlp.router.expert_bias"))
    assert biases == sorted(n for n in ours if n.endswith("mlp.router.expert_bias")) and len(biases) == pm.mp.LAYERS
    for name in biases:     # 20 sign steps of the rate from zero: equal, and moved
        np.testing.assert_allclose(ours[name], theirs[name], atol=1e-6, rtol=0)
        assert np.abs(ours[name]).max() > pm.BIAS_RATE / 2
    other = pm.ms_train(MindSporeBackend("cpu"), 1, True, ckpts["torch_router"], steps=0, extra=pm.ROUTER_FLAGS)
    assert other["eval_loss"] == pytest.approx(t["eval_loss"], abs=TOL)


# issue 55: MTP's MoE layer over a few steps; MINDSPEED_SLOW_TESTS=1: 20 (the router case's length)
MTP_STEPS = pm.mp.STEPS if os.environ.get("MINDSPEED_SLOW_TESTS") else 3


def test_mtp_layer_is_moe_as_megatron_core_makes_it(ckpts, torch_ep1_runs, tmp_path):
    """One MTP layer on the MoE model with the router options (noaux_tc's sigmoid scores and expert bias,
    --seq-aux, shared experts) at EP 1: Megatron-Core's MTP layer follows the decoder's last layer, so it is an
    MoE layer (mtp.layers.0.transformer_layer.mlp.router/experts/shared_experts); its aux loss's gradient and
    its routed tokens (the expert bias's counts) enter as Megatron-Core's do: the losses within TOL and the
    gradient norms over MTP_STEPS fp32 steps, the same three biases (the MTP layer's under Megatron's name),
    and torch's trained weights evaluate the same in MindSpore."""
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from mindspeed.checkpoint import neutral as nf
    t = torch_ep1_runs[2]
    flags = pm.ROUTER_FLAGS + pm.MTP_FLAGS
    ms = pm.ms_train(MindSporeBackend("cpu"), 1, True, ckpts["init_mtp"], save_dir=str(tmp_path / "ms_mtp"),
                     steps=MTP_STEPS, extra=flags)
    np.testing.assert_allclose(ms["losses"], t["losses"], atol=TOL, rtol=0)
    np.testing.assert_allclose(ms["grad_norms"], t["grad_norms"], rtol=NORM_RTOL)
    prefix = "mtp.layers.0.transformer_layer.mlp."
    assert {prefix + "router.weight", prefix + "shared_experts.linear_fc1.weight",
            prefix + "experts.local_experts.3.linear_fc2.weight"} <= set(ms["params"])
    (theirs, _, _), (ours, _, _) = nf.load(ckpts["torch_mtp"]), nf.load(str(tmp_path / "ms_mtp"))
    biases = sorted(n for n in theirs if n.endswith("mlp.router.expert_bias"))
    assert biases == sorted(n for n in ours if n.endswith("mlp.router.expert_bias"))
    assert prefix + "router.expert_bias" in biases and len(biases) == pm.mp.LAYERS + 1
    for name in biases:
        np.testing.assert_allclose(ours[name], theirs[name], atol=1e-6, rtol=0)
    other = pm.ms_train(MindSporeBackend("cpu"), 1, True, ckpts["torch_mtp"], steps=0, extra=flags)
    assert other["eval_loss"] == pytest.approx(t["eval_loss"], abs=TOL)


def _assert_steps_match(run, t, at_least: int):
    """A MindSpore run's losses and gradient norms against Megatron-Core's, over at least that many steps."""
    assert len(run["losses"]) == len(t["losses"]) >= at_least
    np.testing.assert_allclose(run["losses"], t["losses"], atol=TOL, rtol=0)
    np.testing.assert_allclose(run["grad_norms"], t["grad_norms"], rtol=NORM_RTOL)


def test_mtp_moe_layer_at_ep2_matches_megatron_core(two_processes):
    """The same MTP case at EP=2 on 2 processes (DP=2, each rank its batches; the MTP layer's tokens
    exchanged between the ranks' experts by the emulated all-to-all, its expert-bias counts summed over DP):
    Megatron-Core's losses and gradient norms over MTP_EP2_STEPS fp32 steps."""
    ms, torch_runs = two_processes
    for rank in range(2):
        run, t = ms[rank]["ep2_mtp"], torch_runs[rank][5]
        _assert_steps_match(run, t, 2)
        assert _held_experts(run) == {2 * rank, 2 * rank + 1}
        assert "mtp.layers.0.transformer_layer.mlp.experts.local_experts.%d.linear_fc1.weight" % (2 * rank) in run["params"]


def test_ep1_with_shared_experts_matches_megatron(ckpts, torch_ep1):
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    ms = pm.ms_train(MindSporeBackend("cpu"), 1, True, ckpts["init_shared"])
    t, m = np.array(torch_ep1["losses"]), np.array(ms["losses"])
    assert len(t) == len(m) == 20
    np.testing.assert_allclose(m, t, atol=TOL, rtol=0)
    np.testing.assert_allclose(ms["grad_norms"], torch_ep1["grad_norms"], rtol=NORM_RTOL)
    assert m[-4:].mean() < m[:4].mean() - 0.05          # it trains
    assert not ms["graph_mode"]                          # MoE runs PyNative (routing-dependent shapes)
    # full recompute reruns each MoE layer (routing, experts, the aux loss's gradient) in backward
    recomputed = pm.ms_train(MindSporeBackend("cpu"), 1, True, ckpts["init_shared"], steps=3, extra=(
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"))
    np.testing.assert_allclose(recomputed["losses"], m[:3], atol=1e-6, rtol=0)
    # the MoE kernels (emulated on CPU: the backend's reference kernels) and shared-expert overlap
    # (the shared experts before the dispatch): the plain run's losses within the kernels' fp32 tolerance
    kernels = pm.ms_train(MindSporeBackend("cpu"), 1, True, ckpts["init_shared"], steps=3, extra=pm.KERNEL_FLAGS)
    np.testing.assert_allclose(kernels["losses"], m[:3], atol=KERNEL_TOL, rtol=0)
    assert kernels["schedule"] == ["shared", "permute:kernel", "dispatch", "experts:gmm", "combine"]
    # torch's trained weights (neutral checkpoint, Megatron's names) evaluate the same in MindSpore
    other = pm.ms_train(MindSporeBackend("cpu"), 1, True, ckpts["torch_final"], steps=0)
    assert other["eval_loss"] == pytest.approx(torch_ep1["eval_loss"], abs=TOL)


@pytest.fixture(scope="module")
def two_processes(ckpts):
    """One msrun launch (EP=2, its communication features and the allgather dispatcher, TP=2 extended, TP=2 with
    every expert split over TP, EP=2 in bf16, PP=2) and one gloo spawn (Megatron-Core at EP=2, at TP=2 extended,
    at EP=2 in bf16 and fp32 from the bf16 weights, at TP=2 with expert_tensor_parallel_size 2)."""
    from tests_extend.distributed.mindspore_parity_moe_worker import (BF16_STEPS, MTP_EP2_STEPS, TP_SHARDED_CKPT,
                                                                      TP_SHARDED_STEPS)
    out = ckpts["root"] / "msrun"
    out.mkdir()
    ms = run_msrun(WORKER, [str(out), ckpts["init"], ckpts["ms_final"], ckpts["ms_final_tp"], ckpts["init_bf16"],
                            ckpts["init_shared"], ckpts["ms_final_pp"], ckpts["init_mtp"]], str(out), workers=2,
                 timeout=600)
    for rank in range(2):
        assert ms[rank]["ok"], ms[rank].get("error")
    torch_runs = run_distributed(pm.torch_layouts, world_size=2, args=(
        [((2, False, ckpts["init"], ckpts["ms_final"]), {}),
         ((1, False, ckpts["init"], ckpts["ms_final_tp"]), {"tp": 2}),
         ((2, False, ckpts["init_bf16"]), {"steps": BF16_STEPS, "bf16": True}),
         ((2, False, ckpts["init_bf16"]), {"steps": BF16_STEPS}),
         ((1, False, ckpts["init"], str(out / TP_SHARDED_CKPT), TP_SHARDED_STEPS), {"tp": 2, "expert_tp": True}),
         ((2, True, ckpts["init_mtp"], None, MTP_EP2_STEPS), {"router": pm.ROUTER_FIELDS, "mtp": pm.MTP_FIELDS})],),
        timeout=400)
    return ms, torch_runs


def _held_experts(run) -> set:
    """The global indices of the experts a rank's MindSpore run holds."""
    return {int(n.split("local_experts.")[1].split(".")[0]) for n in run["params"] if "local_experts." in n}


def _assert_matches_megatron(run, t):
    """Losses and grad norms of a MindSpore run against Megatron-Core's; MindSpore's checkpoint
    (TP shards and every rank's experts gathered) gives Megatron-Core its eval loss; the plain
    dispatch order."""
    np.testing.assert_allclose(run["losses"], t["losses"], atol=TOL, rtol=0)
    np.testing.assert_allclose(run["grad_norms"], t["grad_norms"], rtol=NORM_RTOL)
    assert t["eval_loss_of_other"] == pytest.approx(run["eval_loss"], abs=TOL)
    assert run["schedule"] == ["counts", "permute:host", "dispatch", "experts:loop", "combine"]


def _assert_chunked_comm(comm, run):
    """The MoE communication features, without overlap on MindSpore's CPU collectives: the counts'
    all-gather started, the tokens permuted (by the kernel) while it travels, then two chunks; the
    plain run's losses."""
    np.testing.assert_allclose(comm["losses"], run["losses"][:3], atol=COMM_TOL, rtol=0)
    assert comm["schedule"] == (["counts:start", "permute:kernel", "counts:wait"]
                                + ["dispatch", "experts:loop", "combine"] * 2)


def test_tp2_extend_ep_matches_megatron_and_checkpoint_crosses(two_processes):
    ms, torch_runs = two_processes
    for rank in range(2):
        run, t = ms[rank]["tp2_extend"], torch_runs[rank][1]
        _assert_matches_megatron(run, t)
        assert run["losses"][-1] < run["losses"][0]
        # whole experts spread over the TP ranks, the same ones on both sides (rank r: 2r, 2r + 1)
        assert _held_experts(run) == set(t["experts"]) == {2 * rank, 2 * rank + 1}
        # the chunks and the asynchronous counts over the TP x EP group
        _assert_chunked_comm(ms[rank]["tp2_extend_comm"], run)


def test_tp2_experts_split_over_tp_match_megatron_expert_tp_and_checkpoint_crosses(two_processes):
    """TP=2 with sequence parallelism, no --moe-tp-extend-ep, the mixtral recipe's MoE flags (MIXTRAL_FLAGS:
    grouped GEMMs, the permutation kernels): each rank holds its TP slice of all 4 experts, the sequence shards
    all-gathered over TP before the experts and their partial outputs reduce-scattered back; Megatron-Core at expert_tensor_parallel_size 2 (no hook): the losses and
    gradient norms over TP_SHARDED_STEPS fp32 steps, and the MindSpore checkpoint (the expert slices gathered)
    evaluates the same in Megatron-Core."""
    ms, torch_runs = two_processes
    for rank in range(2):
        run, t = ms[rank]["tp2_sharded"], torch_runs[rank][4]
        _assert_steps_match(run, t, 3)
        assert t["eval_loss_of_other"] == pytest.approx(run["eval_loss"], abs=TOL)
        assert _held_experts(run) == set(t["experts"]) == {0, 1, 2, 3}      # a slice of every expert on each rank
        assert run["schedule"] == ["allgather", "permute:kernel", "experts:gmm", "reduce-scatter"]


def test_ep2_matches_megatron_and_checkpoint_crosses(two_processes):
    ms, torch_runs = two_processes
    for rank in range(2):
        run, t = ms[rank]["ep2"], torch_runs[rank][0]
        _assert_matches_megatron(run, t)
        assert _held_experts(run) == {2 * rank, 2 * rank + 1}      # each EP rank its half (global indices)
        _assert_chunked_comm(ms[rank]["comm_features"], run)
        # the allgather dispatcher (every rank's tokens gathered, the outputs reduce-scattered back):
        # Megatron-Core's losses and gradient norms (the same sums as the alltoall dispatcher's)
        allgather = ms[rank]["ep2_allgather"]
        np.testing.assert_allclose(allgather["losses"], t["losses"][:3], atol=TOL, rtol=0)
        np.testing.assert_allclose(allgather["grad_norms"], t["grad_norms"][:3], rtol=NORM_RTOL)
        assert allgather["schedule"] == ["allgather", "experts:loop", "reduce-scatter"]


def test_ep2_distributed_optimizer_matches_megatron_shards_dense_state_and_resumes(two_processes):
    """--use-distributed-optimizer at EP=2 on 2 processes: the dense parameters' state sharded over
    DP=2, the experts' over expert-DP (one rank here: each rank keeps its own experts' whole state);
    Megatron-Core's losses (the torch side's plain AdamW: ZeRO-1 changes where the state lives, not the
    update) for ZERO_STEPS steps, and its checkpoint (the sharded state gathered) resumed gives the
    losses of the plain EP=2 run's next steps (the same update; 1e-6 leaves room for another
    reduction order) and Megatron-Core's. TP=2 with --moe-tp-extend-ep and the flag: Megatron-Core's
    losses and gradient norms at that layout."""
    from tests_extend.distributed.mindspore_parity_moe_worker import ZERO_STEPS
    ms, torch_runs = two_processes
    dense_state = []
    for rank in range(2):
        zero, resumed, t = ms[rank]["ep2_zero"], ms[rank]["ep2_zero_resumed"], torch_runs[rank][0]["losses"]
        np.testing.assert_allclose(zero["losses"] + resumed["losses"], t[:2 * ZERO_STEPS], atol=TOL, rtol=0)
        np.testing.assert_allclose(zero["grad_norms"], torch_runs[rank][0]["grad_norms"][:ZERO_STEPS], rtol=NORM_RTOL)
        plain = ms[rank]["ep2"]["losses"]
        np.testing.assert_allclose(resumed["losses"], plain[ZERO_STEPS:2 * ZERO_STEPS], atol=1e-6, rtol=0)
        # Adam's two moments: half the dense values here (up to the flat buffer's padding), all its experts'
        assert zero["state_experts"] == 2 * zero["expert_values"] > 0
        assert abs(zero["state_dense"] - zero["dense_values"]) <= 2
        dense_state.append(zero["state_dense"])
    assert sum(dense_state) == 2 * ms[0]["ep2_zero"]["dense_values"]     # the slices cover it once
    # TP=2 with --moe-tp-extend-ep: DP = expert-DP = 1, each rank its TP shards' and its two experts' whole
    # state; the norm counts each expert once over the TP x EP group
    for rank in range(2):
        run, t = ms[rank]["tp2_extend_zero"], torch_runs[rank][1]
        np.testing.assert_allclose(run["losses"], t["losses"][:ZERO_STEPS], atol=TOL, rtol=0)
        np.testing.assert_allclose(run["grad_norms"], t["grad_norms"][:ZERO_STEPS], rtol=NORM_RTOL)
        assert (run["state_dense"], run["state_experts"]) == (2 * run["dense_values"], 2 * run["expert_values"])


@pytest.mark.cpu_numerics
def test_ep2_bf16_matches_megatron_bf16_within_torchs_bf16_effect(two_processes):
    ms, torch_runs = two_processes
    for rank in range(2):
        run, t16, t32 = ms[rank]["ep2_bf16"], torch_runs[rank][2], torch_runs[rank][3]
        effect = pf.bf16_effect(t16, t32)
        m = np.array(run["losses"])
        assert len(m) == len(t16["losses"]) and effect > TOL      # bf16 moves torch's losses beyond fp32's bound
        np.testing.assert_allclose(m, t16["losses"], atol=pf.GAP_FACTOR * effect, rtol=0)
        np.testing.assert_allclose(run["grad_norms"], t16["grad_norms"],
                                   rtol=pf.GAP_FACTOR * pf.bf16_effect(t16, t32, "grad_norms", relative=True))
        # bf16 moves MindSpore's losses off the fp32 ones (torch's; MindSpore's fp32 EP=2 run is torch's
        # within TOL, test_ep2_matches_megatron_and_checkpoint_crosses) beyond fp32's bound, and no
        # further than twice torch's effect: it rounds at fewer points (the MoE layer in fp32); how far
        # torch's rounding moves its own losses depends on torch's CPU kernels (pf.GAP_FACTOR)
        own = np.abs(m - np.array(t32["losses"])).max()
        assert TOL < own < effect * pf.GAP_FACTOR, (own, effect)
        assert run["param_dtypes"] == ["BFloat16"] and not run["graph_mode"]
        assert run["schedule"] == ["counts", "permute:host", "dispatch", "experts:loop", "combine"]


def test_pp2_carries_moe_layers_and_their_aux_loss_as_megatron_at_pp1(ckpts, two_processes, torch_ep1):
    """MoE at PP=2, EP=1 (one MoE layer with shared experts per stage, one micro-batch per step): the
    two-stage 1F1B runs each stage's MoE layer and its load-balancing loss's gradient (stage 0's
    under its recomputed forward) and gives Megatron-Core's losses and gradient norms at PP=1, whose
    updates hold the aux loss's gradient; the PP=2 checkpoint (both stages' experts) evaluates the
    same at PP=1."""
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed.mindspore_parity_moe_worker import PP_STEPS
    ms, _ = two_processes
    for rank in range(2):
        run = ms[rank]["pp2"]
        np.testing.assert_allclose(run["losses"], torch_ep1["losses"][:PP_STEPS], atol=TOL, rtol=0)
        np.testing.assert_allclose(run["grad_norms"], torch_ep1["grad_norms"][:PP_STEPS], rtol=NORM_RTOL)
        # each stage holds its own layer's router and experts, and runs them
        layers = {int(n.split(".")[2]) for n in run["params"] if n.startswith("decoder.layers.")}
        assert layers == {rank} and _held_experts(run) == {0, 1, 2, 3}
        assert run["schedule"] == ["permute:host", "dispatch", "experts:loop", "combine", "shared"]
    whole = pm.ms_train(MindSporeBackend("cpu"), 1, True, ckpts["ms_final_pp"], steps=0)
    assert whole["eval_loss"] == pytest.approx(ms[0]["pp2"]["eval_loss"], abs=1e-5)


DENSE_FIRST_STEPS = 4


def test_first_k_dense_replace_matches_megatron_and_checkpoint_crosses(ckpts):
    """--first-k-dense-replace 1 on 2 layers (DeepSeek-V3's layout): layer 0 the plain MLP
    (--ffn-hidden-size, Megatron's dense names), layer 1 the MoE layer; Megatron-Core with
    moe_layer_freq [0, 1] (its decoder block spec) from the same weights: the losses within TOL and
    the gradient norms over DENSE_FIRST_STEPS fp32 steps; torch's trained weights evaluate the same
    in MindSpore."""
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    init, final = str(ckpts["root"] / "init_dense_first"), str(ckpts["root"] / "torch_dense_first")
    pm.write_init(init, shared=False, extra=pm.DENSE_FIRST)
    ((t,),) = run_distributed(pm.torch_layouts, world_size=1, args=(
        [((1, False, init, None, DENSE_FIRST_STEPS, final), {"layer_freq": pm.DENSE_FIRST_PATTERN})],), timeout=300)
    ms = pm.ms_train(MindSporeBackend("cpu"), 1, False, init, steps=DENSE_FIRST_STEPS, extra=pm.DENSE_FIRST)
    np.testing.assert_allclose(ms["losses"], t["losses"], atol=TOL, rtol=0)
    np.testing.assert_allclose(ms["grad_norms"], t["grad_norms"], rtol=NORM_RTOL)
    layer0 = {n for n in ms["params"] if n.startswith("decoder.layers.0.mlp.")}
    assert layer0 == {"decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"}
    assert "decoder.layers.1.mlp.router.weight" in ms["params"] and _held_experts(ms) == {0, 1, 2, 3}
    other = pm.ms_train(MindSporeBackend("cpu"), 1, False, final, steps=0, extra=pm.DENSE_FIRST)
    assert other["eval_loss"] == pytest.approx(t["eval_loss"], abs=TOL)
