"""Pipeline parallelism on the MindSpore trainer. PP=2 under msrun (the
two-stage 1F1B of training/mindspore/pipeline.py over a global batch of 4 micro-batches, so its
warmup, steady state and cooldown all run) gives the losses of Megatron-Core's GPTModel (torch,
CPU) trained at PP=1 on the same global batch with gradients accumulated over the micro-batches
(what 1F1B computes), fp32, within 1e-4 per step over 20 steps; and the PP=2 checkpoint (one
whole model, gathered from both stages) loads into the MindSpore trainer at PP=1. The same with
tied embeddings (Megatron's default) against a tied Megatron-Core GPTModel; with a virtual pipeline
(--num-layers-per-virtual-pipeline-stage 1 on 4 layers: Megatron's interleaved 1F1B over 2 model chunks per
stage, training/mindspore/interleaved.py) against Megatron-Core at PP=1 on the 4 layers, the unaligned
pipeline's matrix [[0,2],[1,1]] on the same layers (6 steps); with
--variable-seq-lengths, micro-batches of their own lengths against Megatron-Core on padded ones; and with
--reset-attention-mask, packed documents against Megatron-Core given Megatron's own document masks."""
import os

import numpy as np
import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed import mindspore_parity as mp  # noqa: E402
from tests_extend.distributed import mindspore_parity_pp as mpp  # noqa: E402
from tests_extend.distributed.harness import run_distributed  # noqa: E402
from tests_extend.distributed.msrun_helper import run_msrun  # noqa: E402

TOL = 1e-4
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mindspore_parity_pp_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity_pp")
    init, saved, out = str(root / "init"), str(root / "ms_pp2"), root / "msrun"
    (torch_pp1,) = run_distributed(mpp.torch_references, world_size=1, args=(init,), timeout=300)
    out.mkdir()
    # (the virtual pipeline case takes about as long as the others together: 720 s, not 480, under load)
    ms_pp2 = run_msrun(WORKER, [str(out), init, saved], str(out), workers=2, timeout=720)
    for rank in range(2):
        assert ms_pp2[rank]["ok"], ms_pp2[rank].get("error")
    return {"torch": torch_pp1["untied"], "torch_tied": torch_pp1["tied"], "torch_variable": torch_pp1["variable"],
            "torch_vpp": torch_pp1["vpp"], "torch_eod": torch_pp1["eod"],
            "ms": [r["pp2"] for r in ms_pp2],
            "saved": saved, "saved_sgd": saved + "_sgd", "all": ms_pp2}


def test_pp2_losses_match_torch(runs):
    t = np.array(runs["torch"]["losses"])
    assert len(t) == mp.STEPS
    for rank, ms in enumerate(runs["ms"]):
        # the loss, computed on the last stage, is what every stage reports
        np.testing.assert_allclose(ms["losses"], t, atol=TOL, rtol=0, err_msg=f"rank {rank}")
        # the clipping norm sums both stages' gradients, each parameter once
        np.testing.assert_allclose(ms["grad_norms"], runs["torch"]["grad_norms"], rtol=1e-4, err_msg=f"rank {rank}")
        assert not ms["graph_mode"]
    assert t[-4:].mean() < t[:4].mean() - 0.05          # it trains
    # the stages split the model as Megatron does: embedding + layer 0 | layer 1 + norm + output layer
    first, last = runs["ms"]
    assert first["layers"] == [0] and last["layers"] == [1]
    assert "embedding.word_embeddings.weight" in first["params"] and "output_layer.weight" not in first["params"]
    assert "output_layer.weight" in last["params"] and "embedding.word_embeddings.weight" not in last["params"]


def test_pp2_with_tied_embeddings_matches_torch(runs):
    """Megatron's default: the output layer is the word embeddings. The last stage holds a copy; the
    stages' gradients of it are summed, so the copies stay equal and the losses are torch's (whose
    one weight gets both gradients); the norm counts it once; the checkpoint holds it once."""
    t = runs["torch_tied"]
    tied = [runs["all"][rank]["pp2_tied"] for rank in range(2)]
    for rank, ms in enumerate(tied):
        np.testing.assert_allclose(ms["losses"], t["losses"], atol=TOL, rtol=0, err_msg=f"rank {rank}")
        np.testing.assert_allclose(ms["grad_norms"], t["grad_norms"], rtol=1e-4, err_msg=f"rank {rank}")
    first, last = tied
    assert "embedding.word_embeddings.weight" in first["params"] and "embedding.word_embeddings.weight" in last["params"]
    assert "output_layer.weight" not in first["params"] + last["params"]
    assert "embedding.position_embeddings.weight" not in last["params"]
    from mindspeed.checkpoint import neutral as nf
    params, state, _ = nf.load(runs["saved"] + "_tied")
    assert "output_layer.weight" not in params and "embedding.word_embeddings.weight" in params
    assert sorted(state) == sorted(f"{kind}/{name}" for kind in ("exp_avg", "exp_avg_sq") for name in params)


def test_pp2_with_virtual_pipeline_matches_torch(runs):
    """--num-layers-per-virtual-pipeline-stage 1 on 4 layers: each stage holds 2 model chunks, laid out
    as Megatron-Core lays them out (chunk c of stage r is virtual stage 2c + r), and trains them in the
    interleaved 1F1B order, tied embeddings on the first stage's first chunk and the last stage's last
    chunk; the losses are Megatron-Core's at PP=1 on the same 4 layers and global batch."""
    t = runs["torch_vpp"]
    vpp = [runs["all"][rank]["pp2_vpp"] for rank in range(2)]
    for rank, ms in enumerate(vpp):
        assert ms["pipeline"] == "InterleavedPipeline"
        np.testing.assert_allclose(ms["losses"], t["losses"], atol=TOL, rtol=0, err_msg=f"rank {rank}")
        np.testing.assert_allclose(ms["grad_norms"], t["grad_norms"], rtol=1e-4, err_msg=f"rank {rank}")
    first, last = vpp
    assert first["layers"] == [0, 2] and last["layers"] == [1, 3]
    assert "embedding.word_embeddings.weight" in first["params"] and "embedding.word_embeddings.weight" in last["params"]
    assert "decoder.final_layernorm.weight" in last["params"] and "decoder.final_layernorm.weight" not in first["params"]


def test_pp2_with_the_unaligned_pipeline_matches_torch(runs):
    """--pipeline-num-transformer-layers [[0,2],[1,1]] on the same 4 layers: stage 0's first chunk holds
    only the embedding, its second layers 1-2; stage 1 holds layer 0 and layer 3 with the loss. The
    interleaved schedule runs them with Megatron-Core's PP=1 losses (the first UNALIGNED_STEPS)."""
    t = runs["torch_vpp"]
    unaligned = [runs["all"][rank]["pp2_unaligned"] for rank in range(2)]
    for rank, ms in enumerate(unaligned):
        assert ms["pipeline"] == "InterleavedPipeline" and len(ms["losses"]) == mpp.UNALIGNED_STEPS
        np.testing.assert_allclose(ms["losses"], t["losses"][:mpp.UNALIGNED_STEPS], atol=TOL, rtol=0,
                                   err_msg=f"rank {rank}")
        np.testing.assert_allclose(ms["grad_norms"], t["grad_norms"][:mpp.UNALIGNED_STEPS], rtol=1e-4,
                                   err_msg=f"rank {rank}")
    assert unaligned[0]["layers"] == [1, 2] and unaligned[1]["layers"] == [0, 3]


@pytest.mark.parametrize("case", ["untied", "tied", "vpp", "unaligned"])
def test_pp2_checkpoint_loads_at_pp1(runs, case):
    """The PP=2 checkpoint (with a virtual pipeline, and with the unaligned pipeline's empty first
    chunk, too) holds the whole model (both stages' parameters and Adam moments): the trainer at PP=1
    loads it and evaluates the held-out batch to PP=2's loss."""
    import mindspeed
    from mindspeed.backends import get_backend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore import checkpoint
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    tied = case != "untied"
    args = parse_args(mpp.ms_argv(1, tied, layers=mp.LAYERS if case in ("untied", "tied") else mpp.VPP_LAYERS),
                      world_size=1)
    args.backend = "mindspore"
    mindspeed.adapt(args)
    try:
        backend = get_backend()
        trainer = Trainer(args, backend, build_parallel_state(backend.comm, 1), GPTConfig.from_args(args, mp.VOCAB))
        meta = checkpoint.load(runs["saved"] + {"untied": "", "tied": "_tied", "vpp": "_vpp",
                                                "unaligned": "_unaligned"}[case], trainer.model, trainer.optimizer)
        steps = mpp.UNALIGNED_STEPS if case == "unaligned" else mp.STEPS
        assert trainer.optimizer.step_count == steps and meta["iteration"] == steps
        pp2 = runs["all"][0]["pp2" if case == "untied" else f"pp2_{case}"]
        assert trainer.evaluate(mpp.eval_batches()) == pytest.approx(pp2["eval_loss"], abs=1e-5)
    finally:
        mindspeed.unadapt()


def test_pp2_checkpoint_holds_every_stages_optimizer_state(runs):
    """Whatever the optimizer's state is called (Adam's moments, SGD's momentum), the PP=2 checkpoint
    holds it for the parameters of both stages."""
    from mindspeed.checkpoint import neutral as nf
    for saved, kinds in ((runs["saved"], ("exp_avg", "exp_avg_sq")), (runs["saved_sgd"], ("momentum_buffer",))):
        params, state, _ = nf.load(saved)
        assert sorted(state) == sorted(f"{kind}/{name}" for kind in kinds for name in params), saved


def test_pp2_with_recompute_gives_the_pp2_losses(runs):
    """Selective recompute and block recompute (each stage's first layer) under the two-stage 1F1B."""
    for rank in range(2):
        plain = runs["ms"][rank]["losses"]
        for name in ("pp2_selective", "pp2_block1"):
            run = runs["all"][rank][name]["losses"]
            np.testing.assert_allclose(run, plain[:len(run)], atol=1e-6, rtol=0, err_msg=f"{name} rank {rank}")
        # each stage holds one of the 2 layers: selective wraps its attention, block its first layer, in
        # every micro-batch's forward (stage 0 runs its forward again when the gradient comes back)
        calls = {name: len(runs["all"][rank][name]["recompute_calls"]) for name in ("pp2_selective", "pp2_block1")}
        assert calls["pp2_selective"] == calls["pp2_block1"] > 0, calls


def test_pp2_with_variable_seq_lengths_gives_the_pp1_losses(runs):
    """--variable-seq-lengths: micro-batches of 16, 11, 6 and 13 tokens (each cut to its longest
    sample); the stages exchange each activation's length first. The losses are Megatron-Core's at PP=1
    on the same micro-batches at the full --seq-length with the cut tokens as padding (no loss)."""
    t = runs["torch_variable"]
    for rank in range(2):
        run = runs["all"][rank]["pp2_variable"]
        assert len(run["losses"]) == mpp.VARIABLE_STEPS
        np.testing.assert_allclose(run["losses"], t["losses"][:mpp.VARIABLE_STEPS], atol=TOL, rtol=0,
                                   err_msg=f"rank {rank}")
        np.testing.assert_allclose(run["grad_norms"], t["grad_norms"][:mpp.VARIABLE_STEPS], rtol=1e-4,
                                   err_msg=f"rank {rank}")


def test_pp2_with_reset_attention_mask_gives_the_pp1_losses(runs):
    """--eod-mask-loss --reset-attention-mask over 4 micro-batches of packed documents: each stage masks
    its layers' attention to each token's own document (the mask built from the micro-batch on every
    stage; only activations travel). The losses and norms are Megatron-Core's at PP=1 given its own
    documents' masks."""
    t = runs["torch_eod"]
    for rank in range(2):
        run = runs["all"][rank]["pp2_eod"]
        assert len(run["losses"]) == mpp.EOD_STEPS
        np.testing.assert_allclose(run["losses"], t["losses"], atol=TOL, rtol=0, err_msg=f"rank {rank}")
        np.testing.assert_allclose(run["grad_norms"], t["grad_norms"], rtol=1e-4, err_msg=f"rank {rank}")
