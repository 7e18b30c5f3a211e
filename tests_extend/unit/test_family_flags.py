"""The model-family flags of MindSpeed-LLM's recipes on the built-in trainers' parser
(mindspeed/flags/family_flags.py) and the Megatron-Core model they build (training/model.py)."""
import pytest

from mindspeed.errors import ArgumentError
from mindspeed.flags.family_flags import moe_layer_freq, moe_layer_pattern
from mindspeed.flags.trainer_flags import parse_args
from tests_extend.distributed.harness import run_distributed

MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--hidden-size", "64", "--num-attention-heads", "4"]
# DeepSeek-V3's router, MLA and YaRN as MindSpeed-LLM master (Megatron's names) and 2.1.0 spell them
MASTER = MOE + ["--moe-router-topk", "2", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32",
                "--moe-router-load-balancing-type", "none", "--moe-router-score-function", "sigmoid",
                "--moe-router-enable-expert-bias", "--norm-topk-prob", "--multi-latent-attention",
                "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--beta-fast", "32", "--beta-slow", "1",
                "--rope-scaling-type", "yarn", "--rope-scaling-factor", "40"]
V210 = ["--num-experts", "4", "--moe-intermediate-size", "32", "--hidden-size", "64", "--num-attention-heads", "4",
        "--moe-router-topk", "2", "--n-group", "2", "--topk-group", "1", "--routed-scaling-factor", "2.5",
        "--router-gating-in-fp32", "--moe-router-load-balancing-type", "noaux_tc", "--norm-topk-prob",
        "--multi-head-latent-attention", "--qk-nope-head-dim", "16", "--qk-rope-head-dim", "8",
        "--rope-scaling-beta-fast", "32", "--rope-scaling-beta-slow", "1", "--rope-scaling-type", "yarn",
        "--rope-scaling-factor", "40"]
MEANING = ["moe_ffn_hidden_size", "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
           "moe_router_dtype", "moe_router_load_balancing_type", "moe_router_score_function",
           "moe_router_enable_expert_bias", "multi_latent_attention", "qk_head_dim", "qk_pos_emb_head_dim",
           "beta_fast", "beta_slow", "yarn", "rotary_scaling_factor"]


def _args(*argv):
    return parse_args(list(argv), world_size=1)


def test_megatrons_and_mindspeed_llms_spellings_mean_the_same():
    master, old = _args(*MASTER), _args(*V210)
    assert {d: getattr(master, d) for d in MEANING} == {d: getattr(old, d) for d in MEANING}
    assert master.moe_router_score_function == "sigmoid" and master.moe_router_enable_expert_bias
    assert master.rotary_scaling_factor == 40 and master.yarn


@pytest.mark.parametrize("argv, expected", [
    (["--moe-router-load-balancing-type", "noaux_tc", "--norm-topk-prob"],
     dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
          moe_router_load_balancing_type="none")),
    (["--moe-router-load-balancing-type", "noaux_tc", "--norm-topk-prob", "--seq-aux"],
     dict(moe_router_load_balancing_type="seq_aux_loss")),
    (["--seq-aux"], dict(moe_router_load_balancing_type="seq_aux_loss")),
    (["--moe-router-load-balancing-type", "softmax_topk"],
     dict(moe_router_pre_softmax=True, moe_router_load_balancing_type="none")),
    (["--n-shared-experts", "2"], dict(moe_shared_expert_intermediate_size=64)),
    (["--moe-token-dispatcher-type", "alltoall_seq"], dict(moe_token_dispatcher_type="alltoall")),
])
def test_mindspeed_llms_combined_options_become_megatron_cores_values(argv, expected):
    args = _args(*MOE, *argv)
    assert {k: getattr(args, k) for k in expected} == expected


def test_llama3_scaling_is_llama_3_1s():
    args = _args("--rope-scaling-type", "llama3", "--rope-scaling-factor", "8", "--low-freq-factor", "1",
                 "--high-freq-factor", "4", "--original-max-position-embeddings", "8192")
    assert args.use_rope_scaling and args.rope_scaling_factor == 8 and not args.yarn


@pytest.mark.parametrize("freq, first, layers, pattern", [
    ("1", None, 4, [1, 1, 1, 1]), ("-1", "-1", 3, [1, 1, 1]), ("2", None, 4, [1, 0, 1, 0]),
    ("1", "3", 5, [0, 0, 0, 1, 1]), ("([0]*1+[1]*3)", None, 4, [0, 1, 1, 1]), ("[1,0,1]", "1", 3, [0, 0, 1]),
])
def test_moe_layer_pattern(freq, first, layers, pattern):
    argv = [*MOE, "--num-layers", str(layers), "--moe-layer-freq", freq] + (["--first-k-dense-replace", first]
                                                                           if first else [])
    assert moe_layer_pattern(_args(*argv)) == pattern


def test_moe_layer_freq_reads_megatrons_list_without_eval():
    assert moe_layer_freq("([0]*2+[1]*2)") == [0, 0, 1, 1]
    for text in ("__import__('os')", "[2]*3", "[]", "x"):
        with pytest.raises(Exception, match="integer or a 0/1 list"):
            moe_layer_freq(text)


@pytest.mark.parametrize("argv, message", [
    (["--rope-scaling-factor", "40"], "--rope-scaling-factor 40 acts only with --use-rope-scaling"),
    (["--rope-scaling-type", "yarn"], "YaRN scaling needs its factor"),
    (["--beta-fast", "16"], "--beta-fast: only YaRN scaling reads them"),
    (["--low-freq-factor", "2"], "--low-freq-factor: only --rope-scaling-type llama3 reads them"),
    (["--rope-scaling-type", "llama3", "--high-freq-factor", "2"], "Megatron-Core's Llama-3.1 scaling has"),
    (["--q-lora-rank", "8"], "--q-lora-rank: only multi-latent attention reads them"),
    (["--moe-router-score-function", "sigmoid"], "configure MoE layers: add --num-experts"),
    ([*MOE, "--moe-router-num-groups", "2"], "--moe-router-num-groups and --moe-router-group-topk"),
    ([*MOE, "--moe-router-topk", "4", "--n-group", "2", "--topk-group", "1"], "at most the experts of a group"),
    ([*MOE, "--moe-router-enable-expert-bias"], "balances sigmoid scores"),
    ([*MOE, "--moe-router-score-function", "sigmoid"], "add --norm-topk-prob"),
    ([*MOE, "--moe-router-load-balancing-type", "group_limited_greedy"], "Megatron-Core's group-limited routing"),
    ([*MOE, "--num-layers", "2", "--first-k-dense-replace", "2"], "leave no MoE layer"),
    ([*MOE, "--num-layers", "2", "--moe-layer-freq", "[1,1,1]"], "--moe-layer-freq gives 3 layers"),
    (["--mtp-num-layers", "0"], "--mtp-num-layers must be a positive integer"),
    (["--manual-gc-interval", "5"], "--manual-gc-interval acts only with --manual-gc"),
    (["--spec", "my.spec", "layer_spec"], "--spec my.spec layer_spec: the built-in trainer builds"),
    (["--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"], "add --qk-layernorm"),
    (["--enable-hf2mg-convert", "--model-type-hf", "qwen3"], "--enable-hf2mg-convert converts the Hugging Face model "
                                                             "that --load names: give --load HF_DIR"),
    (["--enable-hf2mg-convert", "--load", ".", "--backend", "mindspore"], "on MindSpore convert first"),
])
def test_what_megatron_core_cannot_express_is_refused_in_one_line(argv, message):
    with pytest.raises(ArgumentError) as err:
        _args(*argv)
    assert len(str(err.value).splitlines()) == 1 and message in str(err.value), str(err.value)


@pytest.mark.parametrize("argv, note", [
    (["--bf16", "--initial-loss-scale", "4096"], "> --initial-loss-scale has no effect here: loss scaling is for --fp16"),
    (["--handler-name", "GeneralPretrainHandler", "--workers", "4"], "> --workers has no effect here"),
    (["--model-type-hf", "qwen3"], "> --model-type-hf has no effect without --enable-hf2mg-convert"),
    (["--mg-save-dir", "cache"], "> --mg-save-dir has no effect without --enable-hf2mg-convert"),
    (["--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec", "--qk-layernorm"],
     "> --spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec: Megatron-Core's local spec with --qk-layernorm"),
    ([*MOE, "--moe-token-dispatcher-type", "alltoall_seq"], "> --moe-token-dispatcher-type alltoall_seq runs as alltoall"),
    (["--tokenizer-not-use-fast"], "> --tokenizer-not-use-fast has no effect here: training reads token ids"),
    (["--vocab-size", "129280"], "> --vocab-size has no effect here: only --tokenizer-type NullTokenizer reads it"),
])
def test_flags_that_do_nothing_or_run_as_another_say_so_once(argv, note):
    notes = _args(*argv).flag_notes
    assert sum(line.startswith(note) for line in notes) == 1, notes


def _built(rank, world_size, argv):
    """The trainer's model for argv: what Megatron-Core built from the flags."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    import mindspeed
    from mindspeed.training import model as model_lib
    from tests_extend.megatron_tiny import init_parallel
    args = parse_args(argv, world_size=1)
    mindspeed.adapt(args)           # the trainer's device shim (Megatron-Core allocates on cuda otherwise)
    init_parallel()
    args.padded_vocab_size = 128
    config = model_lib.transformer_config(args)
    gpt = model_lib.build_model_chunks(args, config)[0]
    layers = gpt.decoder.layers
    router = next((m.router for m in gpt.modules() if isinstance(m, MoELayer)), None)
    return dict(
        q_norm=[type(layer.self_attention.q_layernorm).__name__ for layer in layers],
        moe=[isinstance(layer.mlp, MoELayer) for layer in layers],
        shared=[getattr(getattr(layer.mlp, "shared_experts", None), "config", None) is not None for layer in layers],
        mtp=len(gpt.mtp.layers) if getattr(gpt, "mtp", None) is not None else 0,
        rotary=type(gpt.rotary_pos_emb).__name__,
        expert_bias=router is not None and router.expert_bias is not None,
        router=None if router is None else (config.moe_router_score_function, config.moe_router_num_groups,
                                            config.moe_router_group_topk, config.moe_router_topk_scaling_factor))


def test_the_model_is_megatron_cores_own_with_each_option():
    common = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
    deepseek = common + ["--qk-layernorm", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
                         "--first-k-dense-replace", "1", "--n-shared-experts", "1",
                         "--moe-router-load-balancing-type", "noaux_tc", "--norm-topk-prob", "--n-group", "2",
                         "--topk-group", "1", "--routed-scaling-factor", "2.5", "--mtp-num-layers", "1",
                         "--untie-embeddings-and-output-weights", "--rope-scaling-type", "yarn",
                         "--rope-scaling-factor", "4", "--rope-scaling-original-max-position-embeddings", "16"]
    built, plain = run_distributed(_built, world_size=1, args=(deepseek,))[0], \
        run_distributed(_built, world_size=1, args=(common,))[0]
    qwen3 = run_distributed(_built, world_size=1, args=(common + ["--qk-layernorm"],))[0]     # one layer spec
    assert built["q_norm"] == qwen3["q_norm"] == ["RMSNorm"] * 3 and plain["q_norm"] == ["IdentityOp"] * 3
    assert built["moe"] == [False, True, True] and built["shared"] == [False, True, True]
    assert built["mtp"] == 1 and plain["mtp"] == 0
    assert built["rotary"] == "YarnRotaryEmbedding" and plain["rotary"] == "RotaryEmbedding"
    assert built["expert_bias"] and built["router"] == ("sigmoid", 2, 1, 2.5)


def test_llama2_tokenizer_reads_a_sentencepiece_model_and_refuses_anything_else(tmp_path):
    """Megatron's Llama2Tokenizer (MindSpeed-LLM 2.1.0's Mixtral recipe): SentencePiece's piece count and eos id."""
    import io

    import sentencepiece
    from mindspeed.data import TokenizerError
    from mindspeed.data.flag_tokenizers import from_flags
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(["a quick brown fox"] * 20), model_writer=model,
                                             vocab_size=20, model_type="bpe", minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    argv = ["--tokenizer-type", "Llama2Tokenizer", "--data-path", "x"]
    tok = from_flags(_args(*argv, "--tokenizer-model", str(tmp_path / "tokenizer.model")))
    assert (tok.vocab_size, tok.eod) == (20, 2)
    (tmp_path / "not.model").write_text("not a model")
    with pytest.raises(TokenizerError, match="is not a SentencePiece model"):
        from_flags(_args(*argv, "--tokenizer-model", str(tmp_path / "not.model")))
    with pytest.raises(ArgumentError, match="Llama2Tokenizer needs --tokenizer-model FILE"):
        _args(*argv, "--tokenizer-model", str(tmp_path / "missing.model"))


MLA = ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"]


@pytest.mark.parametrize("extra, refusal", [
    (["--backend", "mindspore", "--tensor-model-parallel-size", "2"],
     "--multi-latent-attention with --tensor-model-parallel-size > 1 on the MindSpore trainer"),
    (["--context-parallel-size", "2", "--context-parallel-algo", "megatron_cp_algo"],
     "--multi-latent-attention with --context-parallel-size > 1"),
])
def test_multi_latent_attention_is_refused_where_it_cannot_run_before_any_work(extra, refusal):
    """The MindSpore trainer's MLA splits no heads over TP (TP 1 runs: test_mindspore_parity_mla.py), and
    MindSpeed's CP attention takes one head size: the gate says so in one line (python -m mindspeed check)."""
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    assert "multi-latent-attention" in {f.id for f in plan(MLA, unknown_flags="trainer").features}
    assert "multi-latent-attention" in {f.id for f in plan(MLA + ["--backend", "mindspore"],
                                                            unknown_flags="trainer").features}
    with pytest.raises(MindSpeedConfigError) as refused:
        plan(MLA + extra, unknown_flags="trainer")
    assert refusal in str(refused.value) and "\n" not in str(refused.value)


MTP = ["--mtp-num-layers", "1", "--untie-embeddings-and-output-weights", "--backend", "mindspore"]


@pytest.mark.parametrize("extra, lacking", [
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size > 1"),
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size > 1"),
    (["--hidden-dropout", "0.1"], "--hidden-dropout/--attention-dropout > 0"),
    (["--reset-position-ids"], "--reset-position-ids"),
])
def test_mtp_on_mindspore_runs_at_pp_tp_1_with_moe_and_refuses_the_rest_before_any_work(extra, lacking):
    """The MindSpore trainer's MTP (test_mindspore_parity_mla_mtp.py and, with MoE layers,
    test_mindspore_parity_moe.py match Megatron-Core's) is planned at PP/TP/CP 1 without dropout, on dense
    layers or MoE ones (EP 1 and 2 checked); beyond that the gate refuses it in one line, naming what."""
    from mindspeed.adaptor_core import MindSpeedConfigError, plan
    assert "mtp" in {f.id for f in plan(MTP, unknown_flags="trainer").features}
    moe = ["--num-experts", "4", "--moe-ffn-hidden-size", "64"]
    assert "mtp" in {f.id for f in plan(MTP + moe, unknown_flags="trainer").features}
    assert "mtp" in {f.id for f in plan(MTP + moe + ["--expert-model-parallel-size", "2"],
                                        unknown_flags="trainer").features}
    with pytest.raises(MindSpeedConfigError) as refused:
        plan(MTP + extra, unknown_flags="trainer")
    message = str(refused.value)
    assert f"--mtp-num-layers with {lacking}: the MindSpore trainer's MTP" in message and "\n" not in message
