"""Conversion of the model families beyond Llama/Qwen2 (--model-type-hf qwen25, qwen3, qwen3-moe, mixtral,
deepseek3; Llama 3.1 as llama2), on tiny models built from transformers' own config classes (random
weights, fixed seeds): hf->mg, then the built-in torch trainer's model loaded by its own checkpoint
loader gives transformers' logits within 1e-4 -- at TP1 in this process; at TP2 (the experts split over
the TP ranks), PP2 and EP2 in two gloo processes -- and mg->hf gives every tensor back bit for bit, from
the converted checkpoint and from the checkpoints the trainer saves at TP2 and at EP2 (experts spread
over the ranks). DeepSeek-V3's multi-token-prediction layer (which transformers drops on load) is
checked by the round trip and by the trainer's per-token loss. A converted Qwen3-MoE fine-tunes in the
trainer and converts back to what the trainer computes; `python -m mindspeed.generate` on converted
Qwen3 and Mixtral gives transformers' greedy tokens."""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch

from tests_extend.distributed.harness import run_distributed
from tests_extend.unit import convert_kit as kit
from tests_extend.unit.test_convert_refusals import run_cli

pytest.importorskip("transformers")
TOL = 1e-4
TOKENS = torch.randint(0, kit.VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.001)
# --model-type-hf -> (make_hf_model's kind, tied embeddings, config fields beyond convert_kit's sizes)
FAMILIES = {
    "qwen25": ("qwen2", True, {}),
    # head_dim 24, not hidden / heads = 16: the trainer's --kv-channels
    "qwen3": ("qwen3", False, dict(head_dim=24)),
    # layer 0 dense (mlp_only_layers), 1-3 MoE; no renormalization of the top-k (transformers' default)
    "qwen3-moe": ("qwen3_moe", False, dict(head_dim=24, num_experts=4, moe_intermediate_size=32, mlp_only_layers=[0],
                                           norm_topk_prob=False, **MOE)),
    "mixtral": ("mixtral", False, dict(num_local_experts=4, **MOE)),
    # multi-latent attention with YaRN (mscale 1: the softmax scale changes too), layer 0 dense, then a
    # sigmoid router with a random e_score_correction_bias, 2 groups of which 1 is used, scaled weights,
    # one shared expert
    "deepseek3": ("deepseek_v3", False, dict(
        num_key_value_heads=kit.HEADS, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.5,
        rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                             mscale_all_dim=1.0, original_max_position_embeddings=16, rope_theta=10000.0))),
}
MOE_TYPES = ("qwen3-moe", "mixtral", "deepseek3")


def _convert_hf_to_mg(hf: str, mg: str, model_type: str, *extra: str) -> None:
    kit.convert("--use-mcore-models", "--model-type", "GPT", "--load-model-type", "hf", "--save-model-type", "mg",
                "--model-type-hf", model_type, "--load-dir", hf, "--save-dir", mg, *extra)


def _mg_to_hf(mg: str, back: str, model_type: str, *extra: str) -> None:
    kit.convert("--load-model-type", "mg", "--save-model-type", "hf", "--model-type-hf", model_type,
                "--load-dir", mg, "--save-dir", back, *extra)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family converted as MindSpeed-LLM's guides do it: TP2 x PP2 (x EP2 for the MoE models)."""
    out = {}
    for model_type, (kind, tied, fields) in FAMILIES.items():
        root = tmp_path_factory.mktemp(model_type)
        hf, mg = str(root / "hf"), str(root / "mg")
        kit.make_hf_model(hf, kind, tied=tied, **fields)
        ep = ["--target-expert-parallel-size", "2"] if model_type in MOE_TYPES else []
        neutral = ["--neutral-copy"] if model_type == "qwen3" else []      # for the MindSpore trainer too
        _convert_hf_to_mg(hf, mg, model_type, "--target-tensor-parallel-size", "2",
                          "--target-pipeline-parallel-size", "2", *ep, *neutral)
        out[model_type] = {"hf": hf, "mg": mg, "root": root, "ref": kit.hf_logits(hf, TOKENS)}
    return out


def _close(logits: torch.Tensor, ref: torch.Tensor) -> float:
    return (logits[..., :kit.VOCAB] - ref[..., :kit.VOCAB]).abs().max().item()


def _assert_same_hf(original: str, converted: str) -> None:
    want, got = kit.read_safetensors(original), kit.read_safetensors(converted)
    assert sorted(want) == sorted(got)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
    with open(os.path.join(original, "config.json")) as a, open(os.path.join(converted, "config.json")) as b:
        assert json.load(a) == json.load(b)


def test_trainer_flags_rebuild_each_family(models):
    from mindspeed.convert.sidecar import read_info
    flags = {t: read_info(m["mg"])["trainer_flags"] for t, m in models.items()}

    def value(model_type, flag):
        f = flags[model_type]
        return f[f.index(flag) + 1] if flag in f else None
    assert "--add-qkv-bias" in flags["qwen25"] and "--qk-layernorm" not in flags["qwen25"]
    assert "--qk-layernorm" in flags["qwen3"] and value("qwen3", "--kv-channels") == "24"
    assert "--add-qkv-bias" not in flags["qwen3"] and "--num-experts" not in flags["qwen3"]
    assert value("qwen3-moe", "--moe-layer-freq") == "([0]*1+[1]*3)"
    assert value("qwen3-moe", "--moe-ffn-hidden-size") == "32" and value("qwen3-moe", "--num-experts") == "4"
    # norm_topk_prob false: softmax over all experts, top-k, no renormalization
    assert "--moe-router-pre-softmax" in flags["qwen3-moe"] and "--norm-topk-prob" not in flags["qwen3-moe"]
    assert "--norm-topk-prob" in flags["mixtral"] and "--moe-layer-freq" not in flags["mixtral"]
    for model_type in ("qwen3-moe", "mixtral"):
        assert value(model_type, "--moe-router-topk") == "2" and value(model_type, "--moe-aux-loss-coeff") == "0.001"
    for model_type in MOE_TYPES:
        assert value(model_type, "--expert-model-parallel-size") == "2"
    # DeepSeek-V3: MLA, YaRN, the sigmoid router with expert bias and groups, shared experts, no aux loss
    assert "--multi-latent-attention" in flags["deepseek3"] and "--group-query-attention" not in flags["deepseek3"]
    assert [value("deepseek3", f) for f in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                                            "--v-head-dim")] == ["32", "16", "16", "8", "16"]
    assert value("deepseek3", "--rope-scaling-type") == "yarn" and value("deepseek3", "--rope-scaling-factor") == "4.0"
    assert value("deepseek3", "--moe-router-score-function") == "sigmoid"
    assert "--moe-router-enable-expert-bias" in flags["deepseek3"] and "--norm-topk-prob" in flags["deepseek3"]
    assert (value("deepseek3", "--moe-router-num-groups"), value("deepseek3", "--moe-router-group-topk")) == ("2", "1")
    assert value("deepseek3", "--moe-router-topk-scaling-factor") == "2.5"
    assert value("deepseek3", "--moe-shared-expert-intermediate-size") == "32"
    assert value("deepseek3", "--moe-router-load-balancing-type") == "none"
    assert "--mtp-num-layers" not in flags["deepseek3"]      # transformers' save has no MTP layer


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_tp1_logits_and_round_trip(models, model_type, tmp_path):
    """The checkpoint written for TP2 loads at TP1 too (vocabulary padded as at TP2) and converts back
    bit for bit."""
    case = models[model_type]
    logits = kit.tp1_logits(case["mg"], TOKENS, extra=("--make-vocab-size-divisible-by", "256",
                                                      "--expert-model-parallel-size", "1"))
    assert _close(logits, case["ref"]) <= TOL
    back = str(tmp_path / "back")
    _mg_to_hf(case["mg"], back, model_type)
    _assert_same_hf(case["hf"], back)


def test_mindspore_trainer_gives_transformers_qwen3_logits(models):
    """The MindSpore trainer's GPT on the converted Qwen3 (per-head q/k norms, head_dim 24 != hidden /
    heads), from the converter's neutral copy: transformers' logits; the MindSpore trainer's reader of
    the torch_dist files beside it finds the same arrays."""
    pytest.importorskip("mindspore")
    from mindspeed.backends.mindspore.backend import MindSporeBackend
    from mindspeed.checkpoint import neutral
    from mindspeed.checkpoint.scan import iteration_dir
    case = models["qwen3"]
    weights, _, _ = neutral.load(iteration_dir(case["mg"], 0))
    assert weights["decoder.layers.1.self_attention.k_layernorm.weight"].shape == (24,)
    backend = MindSporeBackend("cpu")
    model = kit.ms_load(case["mg"], backend, seq_length=TOKENS.shape[1])
    assert _close(torch.from_numpy(kit.ms_logits(model, TOKENS.numpy())), case["ref"]) <= TOL
    # the torch_dist files (decoder layers stacked, norms under their fused names) hold the same arrays
    from mindspeed.checkpoint.cross_format import neutral_from_torch_dist
    from_torch_dist, _, _ = neutral_from_torch_dist(iteration_dir(case["mg"], 0), False)
    assert sorted(from_torch_dist) == sorted(weights)
    for name, value in weights.items():
        assert (from_torch_dist[name] == value).all(), name


def test_qwen3_moe_renormalized_router_and_sparse_step(tmp_path):
    """norm_topk_prob true (Qwen3-30B-A3B's: Megatron-Core's default routing) and decoder_sparse_step 2
    (MoE at layers 1 and 3, as transformers places them)."""
    hf, mg = str(tmp_path / "hf"), str(tmp_path / "mg")
    kit.make_hf_model(hf, "qwen3_moe", head_dim=24, num_experts=4, moe_intermediate_size=32, decoder_sparse_step=2,
                      norm_topk_prob=True, seed=3, **MOE)
    _convert_hf_to_mg(hf, mg, "qwen3-moe")
    from mindspeed.convert.sidecar import read_info
    flags = read_info(mg)["trainer_flags"]
    assert flags[flags.index("--moe-layer-freq") + 1] == "([0]*1+[1]*1+[0]*1+[1]*1)"
    assert "--norm-topk-prob" in flags and "--moe-router-pre-softmax" not in flags
    assert _close(kit.tp1_logits(mg, TOKENS), kit.hf_logits(hf, TOKENS)) <= TOL


def test_qwen3_with_yarn_gives_transformers_logits(tmp_path):
    """A dense model's YaRN (Qwen3's long-context recipe): Megatron-Core's YarnRotaryEmbedding with its
    attention factor (0.1 ln(factor) + 1 on cos and sin, i.e. on both q and k) gives transformers' logits."""
    hf, mg = str(tmp_path / "hf"), str(tmp_path / "mg")
    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=1000000.0)
    kit.make_hf_model(hf, "qwen3", head_dim=24, rope_parameters=yarn, max_position_embeddings=64, seed=5)
    _convert_hf_to_mg(hf, mg, "qwen3")
    from mindspeed.convert.sidecar import read_info
    flags = read_info(mg)["trainer_flags"]
    assert flags[flags.index("--rope-scaling-type") + 1] == "yarn"
    assert flags[flags.index("--rope-scaling-factor") + 1] == "4.0"
    ref = kit.hf_logits(hf, TOKENS)
    assert _close(kit.tp1_logits(mg, TOKENS), ref) <= TOL
    unscaled = str(tmp_path / "unscaled")      # the scaling matters at these sizes: without it, other logits
    kit.make_hf_model(unscaled, "qwen3", head_dim=24, max_position_embeddings=64, seed=5)
    assert _close(kit.hf_logits(unscaled, TOKENS), ref) > 100 * TOL


def test_experts_stacked_over_the_layers_round_trip(models, tmp_path, monkeypatch):
    """Megatron-LM's own runs give Megatron-Core an int --moe-layer-freq: every layer's experts then sit in
    one torch_dist tensor [layer, expert, ...]. The converter writes (its model built so) and reads that
    layout too."""
    import mindspeed.training.model as trainer_model
    from mindspeed.checkpoint.megatron_read import open_checkpoint
    built = trainer_model.transformer_config

    def stacked(args):
        config = built(args)
        config.moe_layer_freq = 1
        return config
    monkeypatch.setattr(trainer_model, "transformer_config", stacked)
    case, mg, back = models["mixtral"], str(tmp_path / "mg"), str(tmp_path / "back")
    _convert_hf_to_mg(case["hf"], mg, "mixtral")
    reader = open_checkpoint(mg)
    assert tuple(reader.meta["decoder.layers.mlp.experts.experts.linear_fc2.weight"].size) == (
        kit.LAYERS, 4, kit.HIDDEN, kit.FFN)
    _mg_to_hf(mg, back, "mixtral")
    _assert_same_hf(case["hf"], back)


def _logits_at(mg_dir, tokens, tp, pp, ep, world_size):
    """The trainer's model at this rank for TP x PP (x EP over the data-parallel ranks), loaded with the
    trainer's loader, the pipeline stages run by hand, the vocab-parallel logits gathered. Returns
    (model, logits or None on ranks that are not in the last stage)."""
    from megatron.core import parallel_state, tensor_parallel
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    extra = ["--expert-model-parallel-size", str(ep)] + (["--make-vocab-size-divisible-by", "256"] if tp == 1 else [])
    args = kit.trainer_args(mg_dir, tp=tp, pp=pp, world_size=world_size, extra=extra)
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


# (model type, TP, PP, EP) run in the two processes; the trainer saves the models of SAVED again
LAYOUTS = [("qwen25", 2, 1, 1), ("qwen3", 2, 1, 1), ("qwen3", 1, 2, 1), ("qwen3-moe", 2, 1, 1),
           ("qwen3-moe", 1, 2, 1), ("qwen3-moe", 1, 1, 2), ("mixtral", 2, 1, 1), ("mixtral", 1, 1, 2),
           ("deepseek3", 2, 1, 1), ("deepseek3", 1, 1, 2)]
SAVED = {("mixtral", 2, 1, 1), ("qwen3-moe", 1, 1, 2), ("deepseek3", 1, 1, 2)}


def _two_rank_body(rank, world_size, dirs, tokens, save_root):
    from megatron.core import parallel_state
    from mindspeed.checkpoint import torch_dist as checkpointing
    from mindspeed.convert.megatron_write import _NoScheduler, adapted
    # Megatron's checkpoint writer starts a multiprocessing manager; the harness's ranks are daemonic
    multiprocessing.current_process().daemon = False
    out = {}
    for layout in LAYOUTS:
        model_type, tp, pp, ep = layout
        with adapted(kit.trainer_args(dirs[model_type], tp=tp, pp=pp, world_size=world_size)):
            model, logits = _logits_at(dirs[model_type], tokens, tp, pp, ep, world_size)
            if layout in SAVED:
                checkpointing.save_checkpoint(os.path.join(save_root, "_".join(map(str, layout))), 0, [model], None,
                                              _NoScheduler(), 0)
            parallel_state.destroy_model_parallel()
        out[layout] = logits
    return out


def test_tp2_pp2_ep2_logits_in_two_processes_and_back(models, tmp_path):
    dirs = {t: m["mg"] for t, m in models.items()}
    results = run_distributed(_two_rank_body, world_size=2, args=(dirs, TOKENS, str(tmp_path)), timeout=300,
                              daemon=False)
    for layout in LAYOUTS:
        model_type, tp, pp, ep = layout
        ranks = [1] if pp == 2 else [0, 1]         # the last pipeline stage has the logits
        assert pp == 1 or results[0][layout] is None
        for rank in ranks:
            assert _close(results[rank][layout], models[model_type]["ref"]) <= TOL, (layout, rank)
    # the checkpoints the trainer wrote (each tensor in TP chunks; the experts from both EP ranks) convert back
    for layout in sorted(SAVED):
        model_type = layout[0]
        back = str(tmp_path / f"back_{'_'.join(map(str, layout))}")
        _mg_to_hf(str(tmp_path / "_".join(map(str, layout))), back, model_type, "--hf-config", models[model_type]["hf"])
        _assert_same_hf(models[model_type]["hf"], back)


def test_deepseek3_mtp_layer_round_trip(models, tmp_path):
    """The MTP layer becomes Megatron-Core's mtp.layers.0 (its experts at EP2 too); the trainer builds it
    (--mtp-num-layers 1) and its per-token language-model loss is the cross entropy of transformers'
    logits (the MTP layer adds its own loss only to the gradient); mg->hf gives the layer back bit for bit.
    An MTP embedding that is not the main model's is refused (Megatron-Core shares it)."""
    import shutil
    from mindspeed.convert.megatron_write import adapted, world_of_one
    from mindspeed.convert.sidecar import read_info
    hf, mg, back = str(tmp_path / "hf"), str(tmp_path / "mg"), str(tmp_path / "back")
    shutil.copytree(models["deepseek3"]["hf"], hf)
    kit.add_mtp_layer(hf)
    _convert_hf_to_mg(hf, mg, "deepseek3")
    flags = read_info(mg)["trainer_flags"]
    assert flags[flags.index("--mtp-num-layers") + 1] == "1"
    labels = torch.roll(TOKENS, -1, dims=1)
    ref = models["deepseek3"]["ref"]
    expected = torch.nn.functional.cross_entropy(ref.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    args = kit.trainer_args(mg)
    with adapted(args), world_of_one():
        model = kit.load_trainer_model(args)
        assert len(model.mtp.layers) == 1
        positions = torch.arange(TOKENS.shape[1]).unsqueeze(0).expand_as(TOKENS)
        with torch.no_grad():
            loss = model(TOKENS, positions, None, labels=labels)
    assert (loss - expected).abs().max().item() <= TOL
    _mg_to_hf(mg, back, "deepseek3")
    _assert_same_hf(hf, back)
    from safetensors.torch import save_file
    tensors = kit.read_safetensors(hf)
    tensors[f"model.layers.{kit.LAYERS}.embed_tokens.weight"][5, 3] += 1
    save_file(tensors, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    rc, err = run_cli("--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "deepseek3",
                      "--load-dir", hf, "--save-dir", str(tmp_path / "out"))
    assert rc == 1 and err.count("\n") == 1, err
    assert f"model.layers.{kit.LAYERS}.embed_tokens.weight differs from model.embed_tokens.weight" in err, err
    assert not os.path.exists(tmp_path / "out")


def test_llama31_as_llama2_with_its_rope_flags(tmp_path):
    """Llama 3.1 converted as MindSpeed-LLM's guides do (--model-type-hf llama2): its scaled RoPE in the
    trainer flags, transformers' logits over 64 positions (where the scaling acts at head_dim 16)."""
    from mindspeed.convert.sidecar import read_info
    hf, mg = str(tmp_path / "hf"), str(tmp_path / "mg")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 10000.0}
    kit.make_hf_model(hf, "llama", num_hidden_layers=2, rope_theta=10000.0, rope_parameters=scaling)
    _convert_hf_to_mg(hf, mg, "llama2")
    flags = read_info(mg)["trainer_flags"]
    assert flags[flags.index("--use-rope-scaling"):][:3] == ["--use-rope-scaling", "--rope-scaling-factor", "8.0"]
    tokens = torch.randint(0, kit.VOCAB, (1, 64), generator=torch.Generator().manual_seed(3))
    assert _close(kit.tp1_logits(mg, tokens), kit.hf_logits(hf, tokens)) <= TOL


def test_converted_qwen3_moe_fine_tunes_and_converts_back(models, tmp_path):
    """The converted Qwen3-MoE trains in the torch trainer (pretrain_gpt.py, 3 steps); the checkpoint it
    saves (optimizer state beside the weights) converts back to a Hugging Face model whose transformers
    logits are the trainer's, with weights that moved."""
    import math
    import shutil
    from mindspeed.convert.sidecar import INFO_FILE, read_info
    from tests_extend.system.one_process_run import run_pretrain_gpt
    case = models["qwen3-moe"]
    save, back, losses = str(tmp_path / "trained"), str(tmp_path / "back"), str(tmp_path / "loss.jsonl")
    flags = read_info(case["mg"])["trainer_flags"] + [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size",
        "1", "--make-vocab-size-divisible-by", "256", "--load", case["mg"], "--finetune", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(kit.VOCAB - 1), "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--save", save, "--save-interval", "3", "--log-loss-file", losses]
    result = run_pretrain_gpt(*flags)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    logged = [json.loads(line)["lm_loss"] for line in open(losses)]
    assert len(logged) == 3 and all(math.isfinite(x) for x in logged), logged
    _mg_to_hf(save, back, "qwen3-moe", "--hf-config", case["hf"])
    shutil.copyfile(os.path.join(case["mg"], INFO_FILE), os.path.join(save, INFO_FILE))   # the model's flags
    trained = kit.tp1_logits(save, TOKENS, extra=("--make-vocab-size-divisible-by", "256",
                                                 "--expert-model-parallel-size", "1"))
    assert _close(trained, kit.hf_logits(back, TOKENS)) <= TOL
    assert _close(trained, case["ref"]) > 1e-3          # it trained
    before, after = kit.read_safetensors(case["hf"]), kit.read_safetensors(back)
    assert not torch.equal(before["model.layers.1.mlp.experts.3.down_proj.weight"],
                           after["model.layers.1.mlp.experts.3.down_proj.weight"])


GENERATE_PROMPT = [42, 93, 96, 47, 64, 21, 11, 76]


@pytest.mark.parametrize("model_type", ["qwen3", "mixtral"])
def test_generate_gives_transformers_greedy_tokens(models, model_type, tmp_path):
    """`python -m mindspeed.generate` (in this process, TP1) on the converted checkpoint: transformers'
    greedy continuation, token for token (Megatron-Core's inference path: q/k norms, MoE layers)."""
    from transformers import AutoModelForCausalLM
    case, eos, new = models[model_type], kit.VOCAB - 1, 16
    tok = tmp_path / "tok"
    tok.mkdir()
    kit.write_tokenizer_json(str(tok / "tokenizer.json"), kit.VOCAB)
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                          "eos_token": "<eos>"}))
    hf = AutoModelForCausalLM.from_pretrained(case["hf"], dtype=torch.float32, attn_implementation="eager").eval()
    expected = hf.generate(torch.tensor([GENERATE_PROMPT]), max_new_tokens=new, do_sample=False, eos_token_id=eos,
                           pad_token_id=eos)[0, len(GENERATE_PROMPT):].tolist()
    assert len(set(expected)) >= 8, expected        # a continuation that tells two models apart
    out = str(tmp_path / "out.json")
    argv = ["--load", case["mg"], "--tokenizer-model", str(tok), "--prompt", " ".join(f"w{i}" for i in GENERATE_PROMPT),
            "--max-new-tokens", str(new), "--output-json", out]
    # in a child process: generate's process group and environment stay out of this test process
    assert run_distributed(_generate, world_size=1, args=(argv,))[0] == 0
    assert json.load(open(out))["tokens"] == expected


def _generate(rank, world_size, argv):
    from mindspeed.generate.cli import main
    return main(argv)


REFUSALS = {
    # (model type of the HF model, --model-type-hf given, what the one line says)
    "qwen3 as qwen3-moe": ("qwen3", "qwen3-moe", "model_type 'qwen3' (Qwen3ForCausalLM) does not match: "
                           "--model-type-hf qwen3-moe converts model_type 'qwen3_moe' (convert it with --model-type-hf "
                           "qwen3)"),
    "mixtral as llama2": ("mixtral", "llama2", "model_type 'mixtral' (MixtralForCausalLM) does not match: "
                          "--model-type-hf llama2 converts model_type 'llama' or 'qwen2' (convert it with "
                          "--model-type-hf mixtral)"),
    "qwen2.5 as qwen3": ("qwen25", "qwen3", "model_type 'qwen2' (Qwen2ForCausalLM) does not match"),
    "qwen3-moe as mixtral": ("qwen3-moe", "mixtral", "model_type 'qwen3_moe' (Qwen3MoeForCausalLM) does not match"),
    "deepseek3 as qwen3-moe": ("deepseek3", "qwen3-moe", "model_type 'deepseek_v3' (DeepseekV3ForCausalLM) does not "
                               "match: --model-type-hf qwen3-moe converts model_type 'qwen3_moe' (convert it with "
                               "--model-type-hf deepseek3)"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_model_type_mismatch_is_one_line(models, tmp_path, case):
    source, given, needle = REFUSALS[case]
    for argv in (["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", models[source]["hf"]],
                 ["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", models[source]["mg"]]):
        rc, err = run_cli(*argv, "--model-type-hf", given, "--save-dir", str(tmp_path / "out"))
        assert rc == 1 and err.count("\n") == 1 and needle in err, err
        assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("argv, needle", [
    (("--model-type-hf", "qwen3", "--add-qkv-bias"), "a qwen3 model has no q/k/v biases"),
    (("--model-type-hf", "qwen3", "--target-expert-parallel-size", "2"), "the model has no experts"),
    (("--model-type-hf", "qwen3-moe", "--target-expert-parallel-size", "3"), "4 experts, not divisible by"),
    (("--model-type-hf", "qwen3-moe", "--neutral-copy"), "the MindSpore trainer does not build MoE layers"),
])
def test_family_refusals(models, tmp_path, argv, needle):
    model_type = argv[1]
    rc, err = run_cli("--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", models[model_type]["hf"],
                      "--save-dir", str(tmp_path / "out"), *argv)
    assert rc == 1 and err.count("\n") == 1 and needle in err, err
    assert not os.path.exists(tmp_path / "out")


def test_mg_to_hf_refuses_a_config_of_another_layer_layout(models, tmp_path):
    """A Qwen3-MoE config whose dense layer is another one: the checkpoint's layer 0 has no router."""
    config = json.loads(open(os.path.join(models["qwen3-moe"]["hf"], "config.json")).read())
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [1]}))
    rc, err = run_cli("--load-model-type", "mg", "--save-model-type", "hf", "--model-type-hf", "qwen3-moe",
                      "--load-dir", models["qwen3-moe"]["mg"], "--save-dir", str(tmp_path / "out"),
                      "--hf-config", str(other))
    assert rc == 1 and err.count("\n") == 1, err
    assert "has no decoder.layers.0.mlp.router.weight, which the Hugging Face config implies" in err, err
    assert not os.path.exists(tmp_path / "out")
