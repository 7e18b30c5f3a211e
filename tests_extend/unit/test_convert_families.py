"""Conversion of the model families beyond Llama/Qwen2 (--model-type-hf qwen25, qwen3, qwen3-moe, mixtral),
on tiny models built from transformers' own config classes (random weights, fixed seeds): hf->mg, then
the built-in torch trainer's model loaded by its own checkpoint loader gives transformers' logits
within 1e-4 -- at TP1 in this process; at TP2 (the experts split over the TP ranks), PP2 and EP2 in
two gloo processes -- and mg->hf gives every tensor back bit for bit, from the converted checkpoint and
from the checkpoints the trainer saves at TP2 and at EP2 (experts spread over the ranks)."""
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
}
MOE_TYPES = ("qwen3-moe", "mixtral")


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
        _convert_hf_to_mg(hf, mg, model_type, "--target-tensor-parallel-size", "2",
                          "--target-pipeline-parallel-size", "2", *ep)
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
    for model_type in MOE_TYPES:
        assert value(model_type, "--moe-router-topk") == "2" and value(model_type, "--moe-aux-loss-coeff") == "0.001"
        assert value(model_type, "--expert-model-parallel-size") == "2"


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
           ("qwen3-moe", 1, 2, 1), ("qwen3-moe", 1, 1, 2), ("mixtral", 2, 1, 1), ("mixtral", 1, 1, 2)]
SAVED = {("mixtral", 2, 1, 1), ("qwen3-moe", 1, 1, 2)}


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
