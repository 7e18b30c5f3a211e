"""--num-layer-list and --noop-layers on the torch trainer, 2 processes, one spawn for all runs (CI time);
every run has --noop-layers 0,3 of 4 layers.

* uneven stages: PP=2 with --num-layer-list 1,3 builds 1 and 3 layers on the two stages and trains
  with the losses of PP=1 (DP=2) from the same weights. The pipeline seeds each stage differently
  (seed + 100 x stage, as Megatron does), so both runs start from one checkpoint (--finetune: same
  weights, fresh optimizer). Not bitwise: PP=1 with DP=2 sums the two halves of the batch's
  gradients in an all-reduce, PP=2 with DP=1 accumulates them micro-batch by micro-batch.
* noop layers: layers 0 and 3 are NoopTransformerLayer modules without parameters whose output
  equals their input (seen during the PP=2 training), the others are real; a checkpoint of the
  PP=2 model loads back (its keys are per layer) and resumes with the same losses.
* unaligned pipeline: upstream's matrix [[0,2],[1,1]] (PP=2, two virtual stages, the first holding
  only the embedding) builds Megatron-Core's layout E|t|tt|tL and trains 20 fp32 steps with the losses
  of the plain PP=2 run from one checkpoint (within 1e-5 relative);
  its checkpoint resumes under the layout flag bit for bit and loads into the plain layout.
* virtual pipeline with Megatron's overlap: PP=2 with --num-layers-per-virtual-pipeline-stage 1 (two
  chunks per stage, interleaved 1F1B) and the distributed optimizer, without and with
  --overlap-grad-reduce --overlap-param-gather: the overlap changes when the collectives run, not what
  they sum, so the losses are the same bit for bit; and it is really on: gradient reductions start
  before Megatron's finish_grad_sync (from the schedule, per chunk) and forward pre-hooks wait for the
  parameter all-gathers. (DP=1 here: 2 processes keep CI time down, so the reductions themselves are
  over one rank; the per-chunk wiring and Megatron's overlapped code paths are what run.)
"""
import json
import os

import pytest

from tests_extend.distributed.harness import next_rendezvous, run_distributed

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1", "--lr", "3e-3",
        "--mock-data", "--seed", "7", "--npu-deterministic"]
PP2 = ["--pipeline-model-parallel-size", "2"]
NOOP = ["--noop-layers", "0,3"]      # every run: the first stage of 1,3 then holds only a noop layer
STEPS = 3
VPP = PP2 + ["--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer", "--train-iters", str(STEPS)]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
LONG = 20           # the unaligned pipeline's runs
UNALIGNED = ["--pipeline-num-transformer-layers", "[[0,2],[1,1]]"]  # upstream's matrix: stage 0 starts empty
TOLERANCE = 1e-5   # fp32; only the order of the gradient sums differs (module docstring)
INSTRUCTIONS = "INSTRUCTIONS"      # the fixture's instruction dataset (samples of 3..19 tokens)
VARIABLE = ["--variable-seq-lengths", "--is-instruction-dataset", "--data-path", INSTRUCTIONS,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--split", "100,0,0"]


def _instructions(tmp) -> str:
    """An instruction dataset of 40 samples, 3..19 tokens (cut at 17), the first third of each the
    prompt (label -100), written as the instruction handlers write theirs (int32)."""
    import numpy as np
    from mindspeed.data.indexed import DatasetGroup
    from mindspeed.data.instruction_samples import COMPONENTS, SEGMENTS, component_prefix
    prefix = os.path.join(tmp, "instructions")
    keys = COMPONENTS + (SEGMENTS,)
    group = DatasetGroup({k: component_prefix(prefix, k) for k in keys}, dict.fromkeys(keys, np.int32), 65,
                         checked=["input_ids"])
    rng = np.random.default_rng(4)
    for _ in range(40):
        ids = np.append(rng.integers(0, 64, rng.integers(2, 19)), 64).astype(np.int32)
        labels = np.where(np.arange(len(ids)) < len(ids) // 3, -100, ids).astype(np.int32)
        group.add({"input_ids": ids, "labels": labels, SEGMENTS: np.ones_like(ids)})
    group.commit()
    return prefix


def _losses(path):
    with open(path) as f:
        return [json.loads(line)["lm_loss"] for line in f]


def _train(rank, tmp, name, flags, inspect=None):
    import mindspeed
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    loss_file = os.path.join(tmp, name + ".jsonl")
    next_rendezvous(rank, loss_file + ".port")
    if INSTRUCTIONS in flags:
        flags = [os.path.join(tmp, "instructions") if f == INSTRUCTIONS else f for f in flags]
    base = [f for f in TINY if f != "--mock-data"] if "--data-path" in flags else TINY
    args = parse_args(base + flags + ["--log-loss-file", loss_file])
    session = mindspeed.adapt(args)
    seen = {}
    original = pretrain.Trainer._build_model
    if inspect is not None:     # look at the model the trainer builds, before it trains
        pretrain.Trainer._build_model = lambda self: inspect(original(self), seen)
    try:
        pretrain.run(args, session)
    finally:
        pretrain.Trainer._build_model = original
        mindspeed.unadapt()
    return (_losses(loss_file) if rank == 0 else None), seen


_ORIGINALS = {}


def _count_overlapped_collectives(model, seen):
    """Counts grad syncs started outside finish_grad_sync and param syncs awaited by forward hooks."""
    from megatron.core.distributed import param_and_grad_buffer as buffers
    group = buffers._ParamAndGradBucketGroup
    seen.update(early_grad_sync=0, param_sync_in_forward=0, finishing=False)
    originals = _ORIGINALS.setdefault("group", (group.start_grad_sync, group.finish_param_sync,
                                                group.finish_grad_sync))
    start, finish, finish_grads = originals     # never a wrapper of the previous run's wrappers

    def start_grad_sync(self, *args, **kwargs):
        seen["early_grad_sync"] += not seen["finishing"]
        return start(self, *args, **kwargs)

    def finish_grad_sync(self, *args, **kwargs):
        seen["finishing"] = True
        try:
            return finish_grads(self, *args, **kwargs)
        finally:
            seen["finishing"] = False

    def finish_param_sync(self, *args, **kwargs):
        seen["param_sync_in_forward"] += 1
        return finish(self, *args, **kwargs)
    group.start_grad_sync, group.finish_grad_sync, group.finish_param_sync = (
        start_grad_sync, finish_grad_sync, finish_param_sync)
    return model


def _noop_probe(model, seen):
    """Layer kinds, their parameter counts, and each noop layer's |output - input| during training."""
    layers = model[0].module.decoder.layers
    seen["layers"] = [type(layer).__name__ for layer in layers]
    seen["params"] = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    seen["numbers"] = [layer.layer_number for layer in layers]
    seen["identity"] = []

    def record(module, inputs, kwargs, output):
        given = kwargs.get("hidden_states", inputs[0] if inputs else None)
        seen["identity"].append((float((output[0] - given).abs().max()), output[0] is given))
    for layer in layers:
        if type(layer).__name__ == "NoopTransformerLayer":
            layer.register_forward_hook(record, with_kwargs=True)
    return model


def _length_probe(model, seen):
    """The sequence length of every micro-batch entering this stage's first layer (on stage 1: the
    activations received from stage 0)."""
    seen["lengths"] = []
    model[0].module.decoder.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen["lengths"].append(
            int(kwargs.get("hidden_states", args[0] if args else None).shape[0])), with_kwargs=True)
    return model


def _chunk_probe(model, seen):
    """Per model chunk: its decoder layers' global numbers, whether it holds the embedding and the output layer."""
    seen["chunks"] = [([layer.layer_number for layer in chunk.module.decoder.layers],
                       chunk.module.pre_process, chunk.module.post_process) for chunk in model]
    seen["mtp"] = [chunk.module.mtp_process for chunk in model]
    return model


def _unaligned_runs(rank, tmp):
    """The unaligned pipeline against the aligned virtual pipeline, its resume under the layout flag
    and its checkpoint loaded into the plain (even, no virtual stage) layout; from one checkpoint."""
    out = {}
    ckpt, saved = os.path.join(tmp, "uinit"), os.path.join(tmp, "unaligned")
    _train(rank, tmp, "uinit", ["--train-iters", "1", "--save", ckpt])
    start = PP2 + ["--train-iters", str(LONG), "--load", ckpt, "--finetune"]
    out["plain"], _ = _train(rank, tmp, "plain", start)
    out["unaligned"], out["unaligned/seen"] = _train(
        rank, tmp, "unaligned", start + UNALIGNED + ["--save", saved, "--save-interval", str(LONG // 2)], _chunk_probe)
    resume = PP2 + ["--train-iters", str(LONG), "--load", saved, "--ckpt-step", str(LONG // 2)]
    out["unaligned-resumed"], _ = _train(rank, tmp, "unaligned-resumed", resume + [
        "--pipeline-model-parallel-layout", "E|t|tt|tL"])       # the same layout, as Megatron writes it
    out["unaligned-to-plain"], out["plain/seen"] = _train(rank, tmp, "unaligned-to-plain", resume, _chunk_probe)
    # with an MTP layer: the matrix's layout places it with the loss (E|t|tt|tmL)
    out["unaligned-mtp"], out["mtp/seen"] = _train(rank, tmp, "unaligned-mtp", PP2 + UNALIGNED + [
        "--mtp-num-layers", "1", "--train-iters", "2"], _chunk_probe)
    return out


def _all_runs(rank, world_size, tmp):
    out = {}
    ckpt, saved = os.path.join(tmp, "init"), os.path.join(tmp, "pp2")
    _train(rank, tmp, "init", NOOP + ["--train-iters", "1", "--save", ckpt])
    start = NOOP + ["--train-iters", str(STEPS), "--load", ckpt, "--finetune"]
    out["pp1"], _ = _train(rank, tmp, "pp1", start)
    uneven = PP2 + ["--num-layer-list", "1,3"]
    out["pp2"], out["pp2/seen"] = _train(rank, tmp, "pp2", start + uneven + ["--save", saved, "--save-interval", "1"],
                                         _noop_probe)
    out["pp2-resumed"], _ = _train(rank, tmp, "pp2-resumed", NOOP + uneven + [
        "--train-iters", str(STEPS), "--load", saved, "--ckpt-step", "1"])
    out["var-pp1"], out["var-pp1/seen"] = _train(rank, tmp, "var-pp1", start + VARIABLE, _length_probe)
    out["var-pp2"], out["var-pp2/seen"] = _train(rank, tmp, "var-pp2", start + PP2 + VARIABLE, _length_probe)
    out.update(_unaligned_runs(rank, tmp))
    out["vpp"], out["vpp/seen"] = _train(rank, tmp, "vpp", VPP, _count_overlapped_collectives)
    out["vpp-overlap"], out["vpp-overlap/seen"] = _train(rank, tmp, "vpp-overlap", VPP + OVERLAP,
                                                         _count_overlapped_collectives)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("pplayers"))
    _instructions(tmp)
    return run_distributed(_all_runs, world_size=2, args=(tmp,),
                           timeout=400, daemon=False)    # checkpoint saves start a helper process


def test_num_layer_list_builds_the_given_layers_per_stage(runs):
    assert [len(runs[rank]["pp2/seen"]["layers"]) for rank in (0, 1)] == [1, 3]
    assert runs[0]["pp2/seen"]["numbers"] == [1] and runs[1]["pp2/seen"]["numbers"] == [2, 3, 4]   # global, 1-based


def test_uneven_stages_train_with_the_single_stage_losses(runs):
    pp1, pp2 = runs[0]["pp1"], runs[0]["pp2"]
    assert len(pp1) == len(pp2) == STEPS
    assert max(abs(a - b) for a, b in zip(pp1, pp2)) <= TOLERANCE, (pp1, pp2)
    assert pp1[0] != pp1[-1]          # it trained (losses move), so equal losses say something


def test_noop_layers_pass_through_without_parameters(runs):
    stage0, stage1 = runs[0]["pp2/seen"], runs[1]["pp2/seen"]
    assert stage0["layers"] == ["NoopTransformerLayer"]
    assert stage1["layers"] == ["TransformerLayer", "TransformerLayer", "NoopTransformerLayer"]
    assert stage0["params"] == [0] and stage1["params"][2] == 0 and min(stage1["params"][:2]) > 0
    for seen in (stage0, stage1):      # every micro-batch of every step: output == input, a new tensor
        assert len(seen["identity"]) == STEPS * 4
        assert all(diff == 0.0 and not same for diff, same in seen["identity"])


def test_noop_model_checkpoint_resumes_with_the_same_losses(runs):
    full, resumed = runs[0]["pp2"], runs[0]["pp2-resumed"]
    assert len(resumed) == STEPS - 1 and resumed == full[1:]


def _relative(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_unaligned_matrix_builds_megatron_s_layout(runs):
    """[[0,2],[1,1]]: virtual stage v of rank r is Megatron's stage 2v + r -> E|t|tt|tL; the
    embedding on rank 0's first chunk (which holds no layer), the output layer on rank 1's last."""
    assert runs[0]["unaligned/seen"]["chunks"] == [([], True, False), ([2, 3], False, False)]
    assert runs[1]["unaligned/seen"]["chunks"] == [([1], False, False), ([4], False, True)]
    assert runs[0]["plain/seen"]["chunks"] == [([1, 2], True, False)]
    assert runs[1]["plain/seen"]["chunks"] == [([3, 4], False, True)]


def test_unaligned_matrix_places_mtp_with_the_loss(runs):
    assert runs[0]["mtp/seen"]["mtp"] == [False, False] and runs[1]["mtp/seen"]["mtp"] == [False, True]
    losses = runs[0]["unaligned-mtp"]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses), losses


def test_unaligned_pipeline_trains_with_the_aligned_losses(runs):
    """From one checkpoint, fp32, no dropout: the unaligned virtual pipeline against the plain PP=2
    run (the grad norm's partial sums are grouped by stage, so not asserted bitwise). Also fails where
    the interleaved schedule's p2p pairs a gradient with an activation (batched p2p at PP 2)."""
    unaligned, plain = runs[0]["unaligned"], runs[0]["plain"]
    assert len(unaligned) == len(plain) == LONG
    assert _relative(unaligned, plain) <= TOLERANCE, (unaligned, plain)
    assert plain[0] != plain[-1]


def test_unaligned_checkpoint_resumes_bitwise_and_loads_into_the_plain_layout(runs):
    full = runs[0]["unaligned"][LONG // 2:]
    assert runs[0]["unaligned-resumed"] == full                 # under the layout flag: the same split
    moved = runs[0]["unaligned-to-plain"]                       # torch_dist resharding to the even split
    assert len(moved) == len(full) and _relative(moved, full) <= TOLERANCE, (moved, full)


def test_vpp_overlap_gives_the_same_losses_bit_for_bit(runs):
    plain, overlap = runs[0]["vpp"], runs[0]["vpp-overlap"]
    assert len(plain) == STEPS and overlap == plain
    assert plain[0] != plain[-1]


def test_vpp_overlap_is_really_on(runs):
    for rank in (0, 1):
        plain, overlap = runs[rank]["vpp/seen"], runs[rank]["vpp-overlap/seen"]
        assert plain["early_grad_sync"] == 0 and plain["param_sync_in_forward"] == 0, plain
        assert overlap["early_grad_sync"] > 0 and overlap["param_sync_in_forward"] > 0, overlap


def test_variable_seq_lengths_exchange_each_micro_batchs_shape(runs):
    """--variable-seq-lengths on instruction data: each micro-batch is as long as its longest
    sample, stage 1 receives those differing shapes from stage 0, and PP=2 loses what PP=1 does."""
    stage0, stage1 = runs[0]["var-pp2/seen"]["lengths"], runs[1]["var-pp2/seen"]["lengths"]
    assert len(stage1) == STEPS * 4 and stage1 == stage0           # what was sent arrived
    assert len(set(stage1)) > 2 and max(stage1) <= 16 and min(stage1) < 16, stage1
    pp1, pp2 = runs[0]["var-pp1"], runs[0]["var-pp2"]
    assert len(pp1) == len(pp2) == STEPS
    assert max(abs(a - b) for a, b in zip(pp1, pp2)) <= TOLERANCE, (pp1, pp2)
    assert pp1[0] != pp1[-1]
