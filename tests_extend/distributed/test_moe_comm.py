"""--moe-tp-extend-ep, --moe-alltoall-overlap-comm, --moe-allgather-overlap-comm,
--moe-permutation-async-comm on 2 gloo
processes (one spawn for every check, CI time):

* one Megatron-Core MoELayer (4 experts, top-2, SwiGLU) loaded from the same full weights in each
  layout, 20 SGD steps (STEPS; the issue's count): every step's loss, the last output, the input gradient and every full
  gradient (expert weights gathered from wherever they live) equal the plain path's within 1e-6
  (fp32). Each rank's tokens differ and the router spreads them unevenly, so a chunk sent to the
  wrong rank, written to the wrong rows or reduced in the wrong order shows;
* the layout really changed (extended: 2 experts per rank, expert-parallel group of 2 at TP 2) and
  the collectives really ran asynchronously with expert compute between start and wait (counters),
  in backward too under the overlap (expert backward while a gradient all-to-all is in flight),
  and nothing async ran without the flags;
* the overlap's gradient all-to-alls start in one order on both ranks, every step, and that order
  is held by graph edges (a different order on two ranks would pair wrong messages);
* unadapt() gives Megatron its own methods back;
* --moe-allgather-overlap-comm: the allgather dispatcher's path bit for bit (losses, output, input and
  every gradient, 20 steps), its gathers and reduce-scatters in flight while experts compute;
* --moe-zero-memory level0/level1 on the overlap: bitwise the overlap alone, every recompute under a
  gradient all-to-all, the activations it frees;
* the built-in trainer at EP 2 (2 layers) with the overlap flags, shared experts and --moe-zero-memory
  level0 in the first layer: 3 steps give the same losses as without.
"""
import json
import os
import time

import pytest

from tests_extend.distributed.harness import next_rendezvous, run_distributed

# name: (flags, tp, ep, dispatcher, layer options); each compared with REF[name]
STEPS = 20
CASES = {
    "extend/alltoall": (["--moe-tp-extend-ep"], 2, 1, "alltoall", dict(shared=True)),
    "extend/allgather": (["--moe-tp-extend-ep"], 2, 1, "allgather", {}),
    "overlap": (["--moe-alltoall-overlap-comm"], 1, 2, "alltoall", {}),
    "overlap/shared": (["--moe-alltoall-overlap-comm"], 1, 2, "alltoall", dict(shared=True, shared_overlap=True)),
    "async/allgather": (["--moe-permutation-async-comm"], 1, 2, "allgather", {}),
    "overlap/allgather": (["--moe-allgather-overlap-comm"], 1, 2, "allgather", {}),
    "async/alltoall": (["--moe-permutation-async-comm"], 1, 2, "alltoall", {}),
    "extend+overlap+async": (["--moe-tp-extend-ep", "--moe-alltoall-overlap-comm", "--moe-permutation-async-comm"],
                             2, 1, "alltoall", {}),
    "overlap/zero-memory-level0": (["--moe-alltoall-overlap-comm", "--moe-zero-memory", "level0"], 1, 2, "alltoall", {}),
    "overlap/zero-memory-level1": (["--moe-alltoall-overlap-comm", "--moe-zero-memory", "level1"], 1, 2, "alltoall", {}),
}
ZERO_MEMORY = ("overlap/zero-memory-level0", "overlap/zero-memory-level1")
BITWISE_PLAIN = ("overlap/allgather",)      # the same bits as its plain reference (allgather_overlap.py: top-2)
TRAIN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "3", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
         "--lr", "3e-3", "--mock-data", "--seed", "7", "--num-experts", "4", "--expert-model-parallel-size", "2",
         "--moe-shared-expert-intermediate-size", "32"]
TRAIN_ON = ["--moe-alltoall-overlap-comm", "--moe-permutation-async-comm", "--moe-shared-expert-overlap",
            "--moe-zero-memory", "level0", "--moe-zero-memory-num-layers", "1"]
PATCHED = (("moe_layer", "MoELayer", "dispatch"), ("moe_layer", "MoELayer", "routed_experts_compute"),
           ("moe_layer", "MoELayer", "combine"), ("token_dispatcher", "MoEAllGatherTokenDispatcher", "token_dispatch"),
           ("token_dispatcher", "MoEAllGatherTokenDispatcher", "dispatch_postprocess"),
           ("token_dispatcher", "MoEAlltoAllTokenDispatcher", "token_dispatch"), ("experts", "SequentialMLP", "forward"),
           ("experts", "GroupedMLP", "forward"))


def _originals():
    import importlib

    from megatron.core import parallel_state
    objs = [getattr(importlib.import_module(f"megatron.core.transformer.moe.{m}"), c).__dict__[a]
            for m, c, a in PATCHED]
    return objs + [parallel_state.initialize_model_parallel]


def _argv(flags, tp, ep, dispatcher, options):
    from tests_extend.distributed import moe_comm_cases as mc
    return (flags + ["--mock-data", "--num-experts", str(mc.E), "--tensor-model-parallel-size", str(tp),
                     "--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type", dispatcher]
            + (["--sequence-parallel"] if tp > 1 else [])
            # the overlap needs shared experts (the moe-shared-expert-overlap row); the cases build theirs of size FFN
            + (["--moe-shared-expert-intermediate-size", str(mc.FFN), "--moe-shared-expert-overlap"]
               if options.get("shared_overlap") else []))


def _groups(flags, tp, ep):
    """Megatron's process groups for this layout (built under the flags: --moe-tp-extend-ep folds them)."""
    import mindspeed
    from megatron.core import parallel_state as ps

    from mindspeed.flags.trainer_flags import parse_args
    mindspeed.adapt(parse_args(_argv(flags, tp, ep, "alltoall", {})))
    try:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    finally:
        mindspeed.unadapt()


def _layer_run(flags, tp, ep, dispatcher, options):
    """The layer on the current groups, with `flags` applied, run for STEPS SGD steps."""
    import mindspeed
    from megatron.core import parallel_state as ps

    from mindspeed.features.moe import async_comm, zero_memory_megatron
    from mindspeed.flags.trainer_flags import parse_args
    from tests_extend.distributed import moe_comm_cases as mc
    from tests_extend.memory_meter import saved_for_backward
    mindspeed.adapt(parse_args(_argv(flags, tp, ep, dispatcher, options)))
    try:
        layer = mc.build_layer(tp, ep, dispatcher, **options)
        with saved_for_backward() as meter:
            arrivals = mc.arrival_inputs(layer, ps)
        async_comm.reset_counts()
        zero_memory_megatron.reset_counts()
        losses, y, dx, grads = mc.run_layer(layer, ps, steps=STEPS)
        return dict(losses=losses, y=y, dx=dx, grads=grads, counts=dict(async_comm.COUNTS),
                    saved=meter.nbytes(exclude=list(layer.parameters())), freed=meter.freed(),
                    recomputes=dict(zero_memory_megatron.COUNTS),
                    backward_order=list(async_comm.BACKWARD_ORDER), arrivals=arrivals,
                    experts=list(layer.local_expert_indices), ep_group=ps.get_expert_model_parallel_world_size())
    finally:
        mindspeed.unadapt()


def _compare(got, ref):
    def rel(a, b):
        return float((a - b).abs().max() / (b.abs().max() + 1e-30))
    return dict(losses=max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])),
                y=rel(got["y"], ref["y"]), dx=rel(got["dx"], ref["dx"]),
                grads=max(rel(got["grads"][k], ref["grads"][k]) for k in ref["grads"]),
                same_keys=sorted(got["grads"]) == sorted(ref["grads"]))


def _bitwise(a, b) -> bool:
    import torch
    if isinstance(a, dict):
        return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def _body(rank, world_size, tmp):
    import torch

    import mindspeed
    from mindspeed.features.moe import async_comm, zero_memory_megatron
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.pretrain import run
    torch.set_num_threads(1)        # tiny tensors: two ranks' thread pools would only spin against each other
    out, t0 = {}, time.monotonic()
    out["cpu-start"] = time.process_time()
    originals = _originals()
    # process groups are built once per layout (TP 2, TP 2 extended, EP 2; a build costs a few gloo
    # rendezvous, the layer runs are small); a case runs in its layout, its reference in the plain one
    got, refs = {}, {}
    for tp, ep, extended in ((2, 1, False), (2, 1, True), (1, 2, False)):
        _groups(["--moe-tp-extend-ep"] if extended else [], tp, ep)
        for name, (flags, ctp, cep, dispatcher, options) in CASES.items():
            if (ctp, cep) != (tp, ep):
                continue
            plain = dict(options, shared_overlap=False)
            key = (tp, ep, dispatcher, tuple(sorted(plain.items())))
            if not extended and key not in refs:
                refs[key] = _layer_run([], tp, ep, dispatcher, plain)
                out[f"plain/{key}/counts"] = refs[key]["counts"]
            if extended == ("--moe-tp-extend-ep" in flags):
                got[name] = (key, _layer_run(flags, tp, ep, dispatcher, options))
    for name, (key, g) in got.items():
        ref = refs[key]
        out[name] = dict(_compare(g, ref), counts=g["counts"], backward_order=g["backward_order"],
                         arrivals=g["arrivals"], experts=g["experts"], ep_group=g["ep_group"],
                         plain_experts=ref["experts"], plain_ep_group=ref["ep_group"],
                         restored=_originals() == originals, saved=g["saved"], freed=g["freed"],
                         recomputes=g["recomputes"])
        if name in ZERO_MEMORY:          # against the overlap alone: the recompute must not change a bit
            overlap = got["overlap"][1]
            out[name]["bitwise"] = {k: _bitwise(g[k], overlap[k]) for k in ("losses", "y", "dx", "grads")}
        if name in BITWISE_PLAIN:
            out[name]["bitwise"] = {k: _bitwise(g[k], ref[k]) for k in ("losses", "y", "dx", "grads")}
    out["layer-seconds"] = time.monotonic() - t0
    out["cpu-layers"] = time.process_time()
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()         # the trainer builds its own groups
    for name, flags in (("off", []), ("on", TRAIN_ON)):
        loss_file = os.path.join(tmp, f"{name}.jsonl")
        next_rendezvous(rank, loss_file + ".port")
        args = parse_args(TRAIN + flags + ["--log-loss-file", loss_file])
        async_comm.reset_counts()
        zero_memory_megatron.reset_counts()
        session = mindspeed.adapt(args)
        try:
            run(args, session)
        finally:
            mindspeed.unadapt()
        out[f"train-{name}/counts"] = dict(async_comm.COUNTS, **zero_memory_megatron.COUNTS)
        if rank == 0:
            with open(loss_file) as f:
                out[f"train-{name}"] = [json.loads(line)["lm_loss"] for line in f]
    out["total-seconds"] = time.monotonic() - t0
    out["cpu-end"] = time.process_time()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_body, world_size=2, args=(str(tmp_path_factory.mktemp("moe")),), timeout=400)


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_and_gradients_equal_the_plain_path(runs, case):
    for rank in (0, 1):
        r = runs[rank][case]
        assert r["same_keys"]
        diffs = {k: r[k] for k in ("losses", "y", "dx", "grads")}
        assert max(diffs.values()) <= 1e-6, f"rank {rank}: relative max diffs {diffs}"


@pytest.mark.parametrize("case", [c for c in sorted(CASES) if "extend" in c])
def test_extended_layout_has_whole_experts_over_tp(runs, case):
    for rank in (0, 1):
        r = runs[rank][case]
        assert r["plain_ep_group"] == 1 and r["plain_experts"] == [0, 1, 2, 3]
        assert r["ep_group"] == 2 and r["experts"] == [2 * rank, 2 * rank + 1]


# per step: collectives started asynchronously (each waited for), and expert computations
# (or the shared experts' fc1) run while one was in flight. Overlap: 2 chunks x (tokens, probs,
# combine) started, chunk 0's experts under chunk 1's dispatch and chunk 1's under chunk 0's combine
# (+ the shared fc1); allgather async: 3 gathers, the bookkeeping under the hidden states' gather;
# alltoall async: tokens' and probs' all-to-alls in flight together (nothing computed between).
# Backward of the overlap: 2 chunks x (reverse combine, reverse dispatch of tokens and of probs)
# started; chunk 1's expert backward under chunk 0's reverse combine, chunk 0's under chunk 1's
# reverse dispatch.
PER_STEP = {"extend/alltoall": (0, 0, 0, 0), "extend/allgather": (0, 0, 0, 0), "overlap": (6, 2, 6, 2),
            "overlap/shared": (6, 3, 6, 2), "async/allgather": (3, 1, 0, 0), "async/alltoall": (2, 0, 0, 0),
            "extend+overlap+async": (6, 2, 6, 2), "overlap/zero-memory-level0": (6, 2, 6, 2),
            "overlap/zero-memory-level1": (6, 2, 6, 2),
            # per local expert (2): its tokens' and probs' gathers and its outputs' reduce-scatter; expert 0
            # under expert 1's gathers, expert 1 under expert 0's reduce-scatter; backward synchronous
            "overlap/allgather": (6, 2, 0, 0)}
EXPECTED = {case: tuple(n * STEPS for n in per_step) for case, per_step in PER_STEP.items()}
# the gradient all-to-alls' start order (chunked_alltoall.py): the same on every rank, every step
BACKWARD_ORDER = ["combine 0", "combine 1", "dispatch 1 tokens", "dispatch 1 probs", "dispatch 0 tokens",
                  "dispatch 0 probs"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_collectives_ran_async_with_compute_in_between(runs, case):
    for rank in (0, 1):
        counts = runs[rank][case]["counts"]
        assert tuple(counts[k] for k in ("started", "overlapped_compute", "bwd_started", "bwd_overlapped_compute")) \
            == EXPECTED[case], counts
        assert counts["waited"] == counts["started"] and counts["bwd_waited"] == counts["bwd_started"]
    for key, plain in runs[0].items():
        if key.startswith("plain/"):
            assert not any(plain.values()), (key, plain)


def test_allgather_overlap_is_bitwise_the_plain_allgather_dispatcher(runs):
    for rank in (0, 1):
        r = runs[rank]["overlap/allgather"]
        assert r["bitwise"] == dict.fromkeys(("losses", "y", "dx", "grads"), True), r["bitwise"]


@pytest.mark.parametrize("case", [c for c in sorted(CASES) if "overlap" in c and "allgather" not in c])
def test_backward_all_to_alls_start_in_one_order_on_every_rank(runs, case):
    orders = [runs[rank][case]["backward_order"] for rank in (0, 1)]
    assert orders[0] == orders[1] and orders[0][-6:] == BACKWARD_ORDER, orders
    assert all(orders[0][i] == orders[0][i - 6] for i in range(6, len(orders[0]))), orders[0]
    # the order is fixed by edges, not by autograd's choice among ready nodes: chunk 1's arrival
    # takes chunk 0's combine as an input (on CPU autograd happens to pick this order anyway)
    for rank in (0, 1):
        assert runs[rank][case]["arrivals"] == [["_CombineSendBackward", "_DispatchJoinBackward"],
                                                ["_DispatchJoinBackward"]]


# recomputes per step: level0 one per expert MLP call (2 chunks x 2 local experts), level1 one per
# experts call (2 chunks); each inside a chunk's expert backward, another chunk's gradient all-to-all in flight
RECOMPUTES = {"overlap/zero-memory-level0": 4 * STEPS, "overlap/zero-memory-level1": 2 * STEPS}


@pytest.mark.parametrize("case", ZERO_MEMORY)
def test_zero_memory_is_bitwise_the_overlap_and_recomputes_under_its_all_to_alls(runs, case):
    for rank in (0, 1):
        r, overlap = runs[rank][case], runs[rank]["overlap"]
        assert all(r["bitwise"].values()), r["bitwise"]
        assert r["recomputes"] == {"recomputed": RECOMPUTES[case], "under_comm": RECOMPUTES[case]}, r["recomputes"]
        assert overlap["recomputes"] == {"recomputed": 0, "under_comm": 0}
    # level0: each expert call's fc2 input (activation x probs) freed once fc2 saved it (2 chunks x 2 experts)
    assert [runs[0][c]["freed"] for c in ("overlap",) + ZERO_MEMORY] == [0, 4, 0]
    saved = {c: runs[0][c]["saved"] for c in ("overlap",) + ZERO_MEMORY}
    # level0 frees fc2's input (activation x probs); level1 keeps only the experts' inputs
    assert saved["overlap"] > saved["overlap/zero-memory-level0"] > saved["overlap/zero-memory-level1"], saved


def test_unadapt_restores_megatrons_methods(runs):
    assert all(runs[0][c]["restored"] for c in CASES)


def test_training_losses_equal_without_overlap(runs):
    off, on = runs[0]["train-off"], runs[0]["train-on"]
    assert len(off) == 3 and len(on) == 3
    assert runs[0]["train-off/counts"]["started"] == 0
    assert runs[0]["train-on/counts"]["overlapped_compute"] > 0
    assert runs[0]["train-on/counts"]["bwd_overlapped_compute"] > 0
    assert runs[0]["train-off/counts"]["recomputed"] == 0       # --moe-zero-memory level0 in the trainer
    # level0 in the first of the 2 layers only: 3 steps x 1 micro-batch x 2 chunks x 2 local experts
    assert runs[0]["train-on/counts"]["under_comm"] == runs[0]["train-on/counts"]["recomputed"] == 12
    for a, b in zip(off, on):
        assert abs(a - b) <= 1e-6 * abs(a), (off, on)
    print(f"\nMoE comm spawn: layers {runs[0]['layer-seconds']:.1f} s, total {runs[0]['total-seconds']:.1f} s",
          {k: runs[0][k] for k in ("cpu-start", "cpu-layers", "cpu-end")})
