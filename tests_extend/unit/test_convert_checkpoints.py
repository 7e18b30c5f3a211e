"""Hugging Face <-> Megatron-Core conversion, checked through the built-in trainers' own models and
checkpoint loaders: torch logits at TP1 (in this process), at TP2 and at PP2 (2 gloo processes);
MindSpore logits at TP1 (in this process) and TP2 (one msrun launch of 2 workers), from torch_dist
and from the neutral copy; HF -> MG -> HF round trips that must give back every tensor bit for bit."""
from __future__ import annotations

import filecmp
import json
import multiprocessing
import os
import shutil

import numpy as np
import pytest
import torch

from tests_extend.distributed.harness import run_distributed
from tests_extend.unit import convert_kit as kit

TOL = 1e-4
TOKENS = torch.randint(0, kit.VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Llama 3-style, GQA, untied embeddings, converted as the user's guide does (TP2, PP2, stages of
    1 and 3 layers)."""
    root = tmp_path_factory.mktemp("llama")
    hf, mg = str(root / "hf"), str(root / "mg")
    kit.make_hf_model(hf, "llama", tied=False, max_shard_size="100KB")   # sharded, with an index
    assert os.path.isfile(os.path.join(hf, "model.safetensors.index.json"))
    kit.write_tokenizer_json(os.path.join(hf, "tokenizer.json"), kit.VOCAB)
    kit.convert("--use-mcore-models", "--model-type", "GPT", "--load-model-type", "hf", "--save-model-type", "mg",
                "--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2",
                "--num-layer-list", "1,3", "--load-dir", hf, "--save-dir", mg,
                "--tokenizer-model", os.path.join(hf, "tokenizer.json"), "--model-type-hf", "llama3")
    return {"hf": hf, "mg": mg, "root": root, "ref": kit.hf_logits(hf, TOKENS)}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Qwen2-style: q/k/v biases, tied embeddings, converted for TP1 with the neutral copy."""
    root = tmp_path_factory.mktemp("qwen")
    hf, mg = str(root / "hf"), str(root / "mg")
    kit.make_hf_model(hf, "qwen2", tied=True)
    kit.convert("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "qwen2",
                "--add-qkv-bias", "--neutral-copy", "--load-dir", hf, "--save-dir", mg)
    return {"hf": hf, "mg": mg, "root": root, "ref": kit.hf_logits(hf, TOKENS)}


def _tp1_logits(mg_dir: str, extra=(), tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    return kit.tp1_logits(mg_dir, tokens, extra)


def _ms_tp1_logits(mg_dir: str, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """The MindSpore trainer's logits (its neutral copy when the directory has one, else torch_dist)."""
    pytest.importorskip("mindspore")
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    model = kit.ms_load(mg_dir, MindSporeBackend("cpu"), seq_length=tokens.shape[1])
    return torch.from_numpy(kit.ms_logits(model, tokens.numpy()))


def _close(logits: torch.Tensor, ref: torch.Tensor, vocab: int = kit.VOCAB) -> bool:
    return (logits[..., :vocab] - ref[..., :vocab]).abs().max().item() <= TOL


def test_qwen2_tp1_logits_match_hf_on_torch_and_mindspore(qwen):
    """--neutral-copy: one converted directory that both trainers load (each its own files); the
    q/k/v biases reach both."""
    assert _close(_tp1_logits(qwen["mg"]), qwen["ref"])
    assert _close(_ms_tp1_logits(qwen["mg"]), qwen["ref"])


def test_llama_untied_checkpoint_loads_at_tp1_too(llama):
    # written for TP2 x PP2 (vocab padded to 2 x 128): at TP1 the trainer pads alike with 256;
    # the MindSpore trainer (no pipeline) reads the torch_dist tensors whole
    assert _close(_tp1_logits(llama["mg"], extra=("--make-vocab-size-divisible-by", "256")), llama["ref"])
    assert _close(_ms_tp1_logits(llama["mg"]), llama["ref"])


def test_llama31_rope_scaling_tp1_logits_match_hf(tmp_path):
    """Llama 3.1's scaled RoPE frequencies (base 10000, head_dim 16: the lowest frequencies have
    wavelengths above 2048, where the scaling acts) over 64 positions."""
    hf, mg = str(tmp_path / "hf"), str(tmp_path / "mg")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 10000.0}
    kit.make_hf_model(hf, "llama", num_hidden_layers=2, rope_theta=10000.0, rope_parameters=scaling)
    kit.convert("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "llama3",
                "--neutral-copy", "--load-dir", hf, "--save-dir", mg)
    tokens = torch.randint(0, kit.VOCAB, (1, 64), generator=torch.Generator().manual_seed(3))
    ref = kit.hf_logits(hf, tokens)
    assert _close(_tp1_logits(mg, tokens=tokens), ref)
    assert _close(_ms_tp1_logits(mg, tokens=tokens), ref)
    # the MindSpore GPT's scaled frequencies are Megatron-Core's, bit for bit
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from mindspeed.training.mindspore.model import llama3_scaled_inv_freq
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert np.array_equal(llama3_scaled_inv_freq(inv.numpy(), 8.0),
                          RotaryEmbedding._apply_scaling(None, inv, factor=8.0).numpy())


def test_tokenizer_smaller_than_the_embedding(tmp_path):
    """--tokenizer-model with 100 tokens for 128 embedding rows (as Qwen2's 151665 for 151936): the
    checkpoint keeps 100 rows padded as the trainer pads 100 (to 104 with divisible-by 8); the way
    back returns the 100 rows exactly and zeros for the rest."""
    hf, mg, back = str(tmp_path / "hf"), str(tmp_path / "mg"), str(tmp_path / "back")
    kit.make_hf_model(hf, "llama", num_hidden_layers=2)
    kit.write_tokenizer_json(os.path.join(hf, "tokenizer.json"), 100)
    kit.convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir", mg,
                "--tokenizer-model", os.path.join(hf, "tokenizer.json"), "--make-vocab-size-divisible-by", "8")
    from mindspeed.checkpoint.megatron_read import open_checkpoint
    assert open_checkpoint(mg).shape("embedding.word_embeddings.weight") == (104, kit.HIDDEN)
    tokens = TOKENS % 100
    logits = _tp1_logits(mg, tokens=tokens)
    assert (logits[..., :100] - kit.hf_logits(hf, tokens)[..., :100]).abs().max() <= TOL
    kit.convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", back)
    want, got = kit.read_safetensors(hf), kit.read_safetensors(back)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(got[name][:100], want[name][:100]) and not got[name][100:].any()
    assert all(torch.equal(got[n], t) for n, t in want.items() if n not in ("model.embed_tokens.weight", "lm_head.weight"))


def _logits_at(mg_dir, tokens, tp, pp, world_size):
    """The trainer's model at this rank for TP x PP = world size: loaded with the trainer's loader,
    the pipeline stages run by hand, the vocab-parallel logits gathered. Returns (model, logits or
    None on ranks that are not in the last stage)."""
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(tp, pp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    args = kit.trainer_args(mg_dir, tp=tp, pp=pp, world_size=world_size)
    model = kit.load_trainer_model(args)
    if not parallel_state.is_pipeline_last_stage():
        hidden = kit.stage_forward(model, tokens)
        torch.distributed.send(hidden.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
        return model, None
    hidden = None
    if not parallel_state.is_pipeline_first_stage():
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], args.hidden_size)
        torch.distributed.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
    local = kit.stage_forward(model, tokens, hidden_in=hidden)
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return model, torch.cat(parts, dim=-1)


def _two_rank_body(rank, world_size, mg_dir, tokens, save_dir, tied_mg_dir, tied_save_dir):
    """TP2 (and the trainer saving that TP2 model: a checkpoint of TP-split chunks), then PP2, then
    PP2 of a model with tied embeddings (the last stage's output layer comes from the embedding; the
    trainer saves it too: a checkpoint of pipeline-split chunks), in the same two processes."""
    from megatron.core import parallel_state
    from mindspeed.convert.megatron_write import _NoScheduler, adapted
    from mindspeed.checkpoint import torch_dist as checkpointing
    with adapted(kit.trainer_args(mg_dir, tp=2, world_size=world_size)):
        model, tp2 = _logits_at(mg_dir, tokens, tp=2, pp=1, world_size=world_size)
        # Megatron's checkpoint writer starts a multiprocessing manager; the harness's ranks are
        # daemonic processes, which may not have children
        multiprocessing.current_process().daemon = False
        checkpointing.save_checkpoint(save_dir, 0, [model], None, _NoScheduler(), 0)
        parallel_state.destroy_model_parallel()
        stage, pp2 = _logits_at(mg_dir, tokens, tp=1, pp=2, world_size=world_size)
        parallel_state.destroy_model_parallel()
        tied_stage, tied_pp2 = _logits_at(tied_mg_dir, tokens, tp=1, pp=2, world_size=world_size)
        checkpointing.save_checkpoint(tied_save_dir, 0, [tied_stage], None, _NoScheduler(), 0)
        parallel_state.destroy_model_parallel()
    return tp2, pp2, len(stage.decoder.layers), tied_pp2


def test_tp2_and_pp2_logits_in_two_processes_and_back(llama, qwen, tmp_path):
    saved, tied_saved = str(tmp_path / "trainer_saved_tp2"), str(tmp_path / "trainer_saved_pp2")
    (tp2_0, pp2_0, layers_0, tied_0), (tp2_1, pp2_1, layers_1, tied_1) = run_distributed(
        _two_rank_body, world_size=2, args=(llama["mg"], TOKENS, saved, qwen["mg"], tied_saved), timeout=150)
    for logits in (tp2_0, tp2_1, pp2_1):
        assert (logits[..., :kit.VOCAB] - llama["ref"]).abs().max() <= TOL
    assert (tied_1[..., :kit.VOCAB] - qwen["ref"]).abs().max() <= TOL
    assert pp2_0 is None and tied_0 is None   # first pipeline stage: no logits
    assert (layers_0, layers_1) == (1, 3)   # --num-layer-list 1,3 reached the trainer
    # the MindSpore trainer reads those torch_dist checkpoints whole: TP-split, and pipeline-split with biases
    for trainer_saved, converted, ref in ((saved, llama["mg"], llama["ref"]), (tied_saved, qwen["mg"], qwen["ref"])):
        # the model's flags (kit.trainer_args reads them there), as in the converted directory
        shutil.copyfile(os.path.join(converted, "convert_info.json"), os.path.join(trainer_saved, "convert_info.json"))
        assert _close(_ms_tp1_logits(trainer_saved), ref)
    # the checkpoint the trainer wrote from TP2 (each tensor in two chunks) converts back bit for bit
    back = str(tmp_path / "hf_back")
    kit.convert("--load-model-type", "mg", "--save-model-type", "hf", "--model-type-hf", "llama3",
                "--load-dir", saved, "--save-dir", back, "--hf-config", llama["hf"])
    _assert_same_hf(llama["hf"], back)


def _assert_same_hf(original: str, converted: str) -> None:
    want, got = kit.read_safetensors(original), kit.read_safetensors(converted)
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
    with open(os.path.join(original, "config.json")) as a, open(os.path.join(converted, "config.json")) as b:
        assert json.load(a) == json.load(b)


@pytest.mark.parametrize("model", ["llama", "qwen"])
def test_round_trip_is_bit_identical(model, request, tmp_path):
    case = request.getfixturevalue(model)
    back = str(tmp_path / "hf_back")
    args = ["--add-qkv-bias", "--model-type-hf", "qwen2"] if model == "qwen" else ["--model-type-hf", "llama3"]
    kit.convert("--load-model-type", "mg", "--save-model-type", "hf", *args, "--load-dir", case["mg"],
                "--save-dir", back)
    _assert_same_hf(case["hf"], back)
    for name in os.listdir(case["hf"]):   # config, generation config, tokenizer: copied as they were
        if not name.endswith((".safetensors", ".index.json")):   # the weights may be sharded otherwise
            assert filecmp.cmp(os.path.join(case["hf"], name), os.path.join(back, name), shallow=False), name


def test_bf16_round_trip_through_fp32_megatron(tmp_path):
    hf, mg, back = str(tmp_path / "hf"), str(tmp_path / "mg"), str(tmp_path / "back")
    kit.make_hf_model(hf, "llama", tied=True, dtype=torch.bfloat16, num_hidden_layers=2)
    kit.convert("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf, "--save-dir", mg)
    kit.convert("--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", mg, "--save-dir", back)
    _assert_same_hf(hf, back)


def test_mindspore_tp2_loads_converted_checkpoints_and_trains(llama, qwen, tmp_path):
    """One msrun launch, 2 workers at TP2: the torch_dist converted for a TP2 x PP2 target and the
    neutral copy with q/k/v biases give Hugging Face's logits; two Adam steps on the biased model give
    the losses and the q/k/v bias (split like the weight's rows) of the same steps at TP1."""
    pytest.importorskip("mindspore")
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from tests_extend.distributed.msrun_helper import run_msrun
    tokens = str(tmp_path / "tokens.npy")
    np.save(tokens, TOKENS.numpy())
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "convert_ms_worker.py")
    results = run_msrun(worker, [str(tmp_path), tokens, llama["mg"], qwen["mg"]], str(tmp_path), timeout=300)
    assert all(r["ok"] for r in results), [r.get("error") for r in results]
    for rank in range(2):
        for case in (llama, qwen):
            name = "llama" if case is llama else "qwen"
            assert _close(torch.from_numpy(np.load(tmp_path / f"{name}_rank{rank}.npy")), case["ref"]), (name, rank)
    # padded as at TP2 (the zero padding logits enter the softmax, as in Megatron)
    tp1 = kit.ms_load(qwen["mg"], MindSporeBackend("cpu"), train=True, extra=("--make-vocab-size-divisible-by", "256"))
    tp1_losses, tp1_bias = kit.ms_train_steps(tp1, TOKENS.numpy())
    assert tp1_losses[1] < tp1_losses[0]
    assert np.mean(tp1_bias[1] != tp1_bias[0]) > 0.95        # the biases train
    for rank in range(2):
        losses, bias = results[rank]["losses"], np.load(tmp_path / f"qwen_bias_rank{rank}.npy")
        assert abs(losses[0] - tp1_losses[0]) <= 1e-5 and abs(losses[1] - tp1_losses[1]) <= 1e-3, (losses, tp1_losses)
        assert np.array_equal(bias[0], tp1_bias[0])
        # with Adam's eps above the gradients' rounding noise (kit.ms_load) every element moves as at TP1
        # (a bias split along the wrong rows moves by lr in the wrong places)
        assert np.abs(bias[1] - tp1_bias[1]).max() <= 1e-5, np.abs(bias[1] - tp1_bias[1])


def test_mindspore_trainer_checkpoint_converts_back(llama, tmp_path):
    """A neutral-only checkpoint (as the MindSpore trainer saves) -> Hugging Face, bit for bit."""
    from mindspeed.checkpoint import neutral as neutral_format
    from mindspeed.checkpoint.megatron_read import open_checkpoint
    reader = open_checkpoint(llama["mg"])   # torch_dist: the model-local names, whole tensors
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    arrays = {n: reader.get(n).numpy() for n in names}
    for i in range(reader.num_layers()):
        for suffix in ("input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
                       "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
            arrays[f"decoder.layers.{i}.{suffix}"] = reader.get_layer(suffix, i).numpy()
    neutral = str(tmp_path / "ms_ckpt")
    neutral_format.save(neutral, 5, arrays)
    back = str(tmp_path / "hf_back")
    kit.convert("--load-model-type", "mg", "--save-model-type", "hf", "--model-type-hf", "llama3",
                "--load-dir", neutral, "--save-dir", back, "--hf-config", llama["hf"])
    _assert_same_hf(llama["hf"], back)


def test_mg_to_hf_refuses_a_config_that_does_not_describe_the_checkpoint(llama, tmp_path):
    from tests_extend.unit.test_convert_refusals import run_cli
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads(open(os.path.join(llama["hf"], "config.json")).read())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    out = tmp_path / "out"
    out.mkdir()
    rc, err = run_cli("--load-model-type", "mg", "--save-model-type", "hf", "--model-type-hf", "llama3",
                      "--load-dir", llama["mg"], "--save-dir", str(out / "hf"), "--hf-config", str(other))
    assert rc == 1 and err.count("\n") == 1 and "has 4 layers, the Hugging Face config 2" in err, err
    assert os.listdir(out) == []
