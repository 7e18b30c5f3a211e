"""MindSpeed-LLM's model-family spellings under Megatron-LM's own pretrain_gpt.py with the one import line
(mindspeed/megatron_lm_family.py), on each tested Megatron-LM version's real parser:

* Megatron's parser gains exactly the MindSpeed-LLM spellings it lacks (aliases of its own options where
  it has them) and MindSpeed-LLM's choices;
* MindSpeed-LLM's spelling of a Qwen3-MoE and of a DeepSeek-V3 model gives the same Megatron args (but
  for the MindSpeed-LLM-only dests) and the same TransformerConfig as Megatron's spelling;
* what Megatron-LM cannot honour is one `MindSpeed:` line; what runs as another, or has no effect, is one
  line beside MindSpeed's features line;
* MindSpeed-LLM's DeepSeek-V3 recipe (recipes/deepseek3.flags at CPU size, EP 2; less the options
  shrink.NOT_YET names) trains 3 iterations on 2 processes in Megatron-LM core_v0.16.1's own loop, from a
  Hugging Face DeepSeek-V3 that its --enable-hf2mg-convert converts (MLA, YaRN, MTP, the noaux_tc router,
  --first-k-dense-replace, shared experts, --noop-layers); the conversion is the one `convert_ckpt.py` makes
  first (with MINDSPEED_SLOW_TESTS=1 a run loading that one gives the same losses), and a Hugging Face model
  at --load converts without the flag (MindSpeed-LLM's behaviour);
* a Qwen3-MoE in MindSpeed-LLM's spellings trains 3 iterations on 2 processes (EP 2) in Megatron-LM's
  own loop (with MINDSPEED_SLOW_TESTS=1).

The in-process checks run at --optimization-level 0: MindSpeed's hooks apply once per process, and at
level 0 there are none to apply, so one process validates every command line.
"""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests_extend.example.recipes import shrink
from tests_extend.system import megatron_lm_kit as kit

SLOW = not os.environ.get("MINDSPEED_SLOW_TESTS")

CODE = r"""
import contextlib, dataclasses, io, json, os, sys
os.environ['WORLD_SIZE'] = '2'
base = ['pretrain_gpt.py', '--num-layers', '4', '--hidden-size', '64', '--num-attention-heads', '4',
        '--seq-length', '64', '--max-position-embeddings', '64', '--micro-batch-size', '1',
        '--tokenizer-type', 'NullTokenizer', '--vocab-size', '100', '--train-iters', '1', '--lr', '1e-3',
        '--disable-bias-linear', '--optimization-level', '0']
sys.argv = base
import torch
import mindspeed.megatron_adaptor
import megatron.training.arguments as margs
cases = json.loads(os.environ['CASES'])
parsers = []
def capture(parser):
    parsers.append(parser)
    return parser
sys.argv = base
margs.parse_args(capture)
actions = parsers[0]._option_string_actions
def described(flag):
    a = actions.get(flag)
    return None if a is None else {'dest': a.dest, 'choices': list(a.choices) if a.choices else None,
                                   'help': a.help}
plain = lambda d: {k: v for k, v in d.items() if isinstance(v, (str, int, float, bool, type(None), list))}
out = {'flags': {f: described(f) for f in cases['flags']}, 'runs': {}}
for name, extra in cases['runs'].items():
    sys.argv = base + extra
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            args = margs.parse_args()
            margs.validate_args(args)
            config = margs.core_transformer_config_from_args(args)
    except SystemExit as exc:
        out['runs'][name] = {'refused': str(exc)}
        continue
    notes = [l for l in stdout.getvalue().splitlines() if l.startswith('> MindSpeed: ')]
    out['runs'][name] = {'args': plain(vars(args)), 'config': plain(vars(config)), 'notes': notes,
                         'config_class': type(config).__name__}
print('RESULT ' + json.dumps(out))
"""

# a Qwen3-MoE (q/k norms, a dense first layer, a shared expert) as MindSpeed-LLM's recipes spell it, and
# as Megatron does
QWEN3_MOE_LLM = ["--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2", "--moe-intermediate-size", "32",
                 "--norm-topk-prob", "--first-k-dense-replace", "1", "--n-shared-experts", "1", "--seq-aux",
                 "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall_seq",
                 "--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"]
QWEN3_MOE_MEGATRON = ["--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                      "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-shared-expert-intermediate-size", "32",
                      "--moe-router-load-balancing-type", "seq_aux_loss", "--expert-model-parallel-size", "2",
                      "--moe-token-dispatcher-type", "alltoall"]
# DeepSeek-V3's MLA, YaRN and router as MindSpeed-LLM 2.1.0 spells them, and as Megatron does
MLA_SIZES = ["--q-lora-rank", "32", "--kv-lora-rank", "16", "--v-head-dim", "16", "--num-experts", "4",
             "--moe-router-topk", "2"]
DEEPSEEK_LLM = MLA_SIZES + [
    "--multi-head-latent-attention", "--qk-nope-head-dim", "16", "--qk-rope-head-dim", "8",
    "--rope-scaling-type", "yarn", "--rope-scaling-factor", "40", "--rope-scaling-mscale", "0.7",
    "--rope-scaling-mscale-all-dim", "0.7", "--moe-router-load-balancing-type", "noaux_tc", "--norm-topk-prob",
    "--n-group", "2", "--topk-group", "1", "--routed-scaling-factor", "2.5", "--router-gating-in-fp32",
    "--moe-intermediate-size", "16"]
DEEPSEEK_MEGATRON = MLA_SIZES + [
    "--multi-latent-attention", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
    "--rotary-scaling-factor", "40", "--mscale", "0.7", "--mscale-all-dim", "0.7",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "none", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32", "--moe-ffn-hidden-size", "16"]
# YaRN's settings that only MindSpeed-LLM spells: MLATransformerConfig's fields
YARN_ONLY_LLM = DEEPSEEK_LLM + ["--rope-scaling-beta-fast", "16", "--beta-slow", "2",
                                "--rope-scaling-original-max-position-embeddings", "64"]
YARN_ORIGINAL_LLM = DEEPSEEK_LLM + ["--rope-scaling-original-max-position-embeddings", "4096"]
# the dests only MindSpeed-LLM's spellings write (Megatron's own spelling leaves them at their defaults)
SPELLING_ONLY = {"norm_topk_prob", "first_k_dense_replace", "n_shared_experts", "seq_aux", "rope_scaling_type",
                 "rope_scaling_factor"}
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
REFUSED = {
    "greedy": (MOE + ["--moe-router-load-balancing-type", "group_limited_greedy"],
               "--moe-router-load-balancing-type group_limited_greedy: DeepSeek-V2's per-group maximum"),
    "sparsemixer": (MOE + ["--moe-router-load-balancing-type", "sparsemixer_topk"], "SparseMixer's top-2"),
    "noaux-unnormalized": (MOE + ["--moe-router-load-balancing-type", "noaux_tc"], "add --norm-topk-prob"),
    "softmax-topk-norm": (MOE + ["--moe-router-load-balancing-type", "softmax_topk", "--norm-topk-prob"],
                          "renormalized pre-softmax weights"),
    "seq-aux-dense": (["--seq-aux", "--n-shared-experts", "1"],
                      "--seq-aux, --n-shared-experts configure MoE layers: add --num-experts"),
    "no-moe-layer": (MOE + ["--first-k-dense-replace", "4"], "leave no MoE layer"),
    "llama3-factors": (["--rope-scaling-type", "llama3", "--low-freq-factor", "2"],
                       "--rope-scaling-type llama3 with --low-freq-factor 2: Megatron-Core's Llama-3.1 scaling"),
    "llama3-only": (["--original-max-position-embeddings", "8192"],
                    "--original-max-position-embeddings: only --rope-scaling-type llama3 reads them"),
    "dense-yarn": (["--rope-scaling-type", "yarn", "--rope-scaling-factor", "4"],
                   "--rope-scaling-type yarn without multi-latent attention: Megatron-LM's GPT builder has no YaRN"),
    "yarn-only": (["--beta-fast", "16"], "--beta-fast: only YaRN scaling reads them"),
    "two-factors": (["--multi-latent-attention", "--rope-scaling-type", "yarn", "--rope-scaling-factor", "4",
                     "--rotary-scaling-factor", "8"], "both set YaRN's factor: give one"),
    "mla-only": (["--mla-fa-without-pad"], "--mla-fa-without-pad: only multi-latent attention reads them"),
    "spec-without-flag": (["--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"],
                          "with --qk-layernorm: add --qk-layernorm"),
    "other-llm-spec": (["--spec", "mindspeed_llm.tasks.models.spec.other", "layer_spec"],
                       "MindSpeed-LLM's module is not here"),
    "hf2mg-without-load": (["--enable-hf2mg-convert", "--model-type-hf", "qwen3"],
                           "--enable-hf2mg-convert converts the Hugging Face model that --load names: give --load"),
    # a config.json beside safetensors at --load: converted without the flag, and this one's type is refused
    "hf2mg-auto": (["--load", "HF_LIKE"], "--enable-hf2mg-convert: config.json model_type 'bert' is not one the "
                                         "converter knows"),
}
NOTES_RUN = QWEN3_MOE_LLM + ["--handler-name", "GeneralPretrainHandler", "--workers", "4", "--no-shared-storage"]
FLAGS = ["--n-group", "--qk-nope-head-dim", "--moe-intermediate-size", "--rope-scaling-mscale",
         "--router-gating-in-fp32", "--first-k-dense-replace", "--beta-fast", "--moe-permute-fusion", "--rope-type",
         "--moe-token-dispatcher-type", "--moe-router-load-balancing-type"]


@pytest.fixture(scope="module", params=kit.VERSIONS, ids=lambda v: f"core_v{v}")
def checkout(request, tmp_path_factory):
    return kit.checkout_or_skip(request.param, tmp_path_factory)


def _version(checkout) -> str:
    return os.path.basename(checkout).rsplit("-", 1)[1]


@pytest.fixture(scope="module")
def parsed(checkout, tmp_path_factory):
    """Every command line of this module, through Megatron-LM's own parse_args/validate_args, in one process."""
    hf_like = tmp_path_factory.mktemp("hf_like")
    (hf_like / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (hf_like / "model.safetensors").write_bytes(b"")
    runs = {"qwen3-moe-llm": QWEN3_MOE_LLM, "qwen3-moe-megatron": QWEN3_MOE_MEGATRON,
            "deepseek-llm": DEEPSEEK_LLM, "deepseek-megatron": DEEPSEEK_MEGATRON, "yarn-only-llm": YARN_ONLY_LLM,
            "yarn-original-llm": YARN_ORIGINAL_LLM, "notes": NOTES_RUN,
            **{name: [str(hf_like) if a == "HF_LIKE" else a for a in argv] for name, (argv, _) in REFUSED.items()}}
    if _version(checkout) != "0.12.1":
        runs["deepseek-megatron"] = DEEPSEEK_MEGATRON + ["--rope-type", "yarn"]   # core_v0.12's MLA: always YaRN
    else:       # core_v0.12's Megatron-Core still has alltoall_seq: MindSpeed-LLM's value is Megatron's own there
        runs["qwen3-moe-megatron"] = [("alltoall_seq" if a == "alltoall" else a) for a in QWEN3_MOE_MEGATRON]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([checkout, kit.ROOT]), RANK="0",
               CASES=json.dumps({"flags": FLAGS, "runs": runs}))
    result = subprocess.run([sys.executable, "-c", CODE], cwd=checkout, env=env, capture_output=True, text=True,
                            timeout=300)
    line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert result.returncode == 0 and line, (result.stdout + result.stderr)[-4000:]
    return json.loads(line.split(" ", 1)[1])


def test_megatrons_parser_gains_only_the_spellings_it_lacks(parsed, checkout):
    flags, newer = parsed["flags"], _version(checkout) != "0.12.1"
    assert flags["--n-group"]["dest"] == "moe_router_num_groups"
    assert flags["--n-group"]["help"] == "MindSpeed-LLM's spelling of --moe-router-num-groups"
    assert flags["--qk-nope-head-dim"]["dest"] == "qk_head_dim"
    assert flags["--moe-intermediate-size"]["dest"] == "moe_ffn_hidden_size"
    assert flags["--rope-scaling-mscale"]["dest"] == "mscale"
    assert flags["--router-gating-in-fp32"]["dest"] == "moe_router_dtype"
    assert flags["--first-k-dense-replace"]["dest"] == "first_k_dense_replace"
    assert flags["--beta-fast"]["dest"] == "beta_fast"
    # Megatron's own flags stay Megatron's; Megatron's newer spelling is not added to the older parser
    assert "MindSpeed-LLM" not in (flags["--moe-permute-fusion"]["help"] or "")
    assert (flags["--rope-type"] is not None) == newer
    assert {"noaux_tc", "softmax_topk", "group_limited_greedy"} <= set(flags["--moe-router-load-balancing-type"]
                                                                     ["choices"])
    assert "alltoall_seq" in flags["--moe-token-dispatcher-type"]["choices"]


@pytest.mark.parametrize("model", ["qwen3-moe", "deepseek"])
def test_both_spellings_give_the_same_megatron_args(parsed, model):
    llm, megatron = parsed["runs"][f"{model}-llm"], parsed["runs"][f"{model}-megatron"]
    assert "args" in llm and "args" in megatron, (llm, megatron)
    differ = {k for k in set(llm["args"]) | set(megatron["args"]) if llm["args"].get(k) != megatron["args"].get(k)}
    assert differ <= SPELLING_ONLY, {k: (llm["args"].get(k), megatron["args"].get(k)) for k in differ}
    assert llm["config"] == megatron["config"] and llm["config_class"] == megatron["config_class"]


def test_the_translations_reach_megatrons_transformer_config(parsed, checkout):
    qwen3 = parsed["runs"]["qwen3-moe-llm"]["config"]
    assert qwen3["qk_layernorm"] and qwen3["moe_layer_freq"] == [0, 1, 1, 1]
    assert (qwen3["moe_ffn_hidden_size"], qwen3["moe_shared_expert_intermediate_size"]) == (32, 32)
    assert qwen3["moe_router_load_balancing_type"] == "seq_aux_loss"
    # core_v0.12's Megatron-Core still has alltoall_seq; 0.16 dropped it
    assert qwen3["moe_token_dispatcher_type"] == ("alltoall_seq" if _version(checkout) == "0.12.1" else "alltoall")
    assert parsed["runs"]["qwen3-moe-llm"]["args"]["spec"] is None
    deepseek = parsed["runs"]["deepseek-llm"]
    assert deepseek["config_class"] == "MLATransformerConfig"
    config = deepseek["config"]
    assert (config["rope_type"], config["rotary_scaling_factor"], config["mscale"], config["mscale_all_dim"]) == \
        ("yarn", 40.0, 0.7, 0.7)
    assert (config["moe_router_score_function"], config["moe_router_enable_expert_bias"],
            config["moe_router_load_balancing_type"], config["moe_router_num_groups"],
            config["moe_router_group_topk"], config["moe_router_topk_scaling_factor"],
            config["moe_router_dtype"]) == ("sigmoid", True, "none", 2, 1, 2.5, "fp32")
    assert (config["qk_head_dim"], config["qk_pos_emb_head_dim"]) == (16, 8)
    # the YaRN fields only MindSpeed-LLM spells keep MLATransformerConfig's defaults when not given (never None)
    assert (config["beta_fast"], config["beta_slow"], config.get("original_max_position_embeddings", 4096)) == \
        (32, 1, 4096)
    yarn = parsed["runs"]["yarn-only-llm"]["config"]
    assert (yarn["beta_fast"], yarn["beta_slow"]) == (16, 2)
    original = "original_max_position_embeddings" if "original_max_position_embeddings" in yarn \
        else "max_position_embeddings"      # core_v0.12's MLA: YaRN's original context is its max_position_embeddings
    assert yarn[original] == 64
    other = parsed["runs"]["yarn-original-llm"]
    if original == "original_max_position_embeddings":
        assert other["config"][original] == 4096, other
    else:
        assert other["refused"] == (
            "MindSpeed: --rope-scaling-original-max-position-embeddings 4096: Megatron-Core 0.12.1's multi-latent "
            "attention takes YaRN's original context from --max-position-embeddings (64): give the same value, or "
            "use Megatron-LM core_v0.16.1"), other


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_megatron_lm_cannot_honour_is_one_line(parsed, name):
    refused = parsed["runs"][name].get("refused")
    assert refused and refused.startswith("MindSpeed: ") and REFUSED[name][1] in refused, parsed["runs"][name]
    assert "\n" not in refused


def test_what_runs_as_another_or_has_no_effect_says_so(parsed, checkout):
    notes = parsed["runs"]["notes"].get("notes")
    assert notes is not None, parsed["runs"]["notes"]
    expected = ["> MindSpeed: --handler-name has no effect here: it is a preprocessing flag",
                "> MindSpeed: --workers has no effect here",
                "> MindSpeed: --spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec: Megatron-LM's own layer "
                "spec (--transformer-impl) with --qk-layernorm",
                "> MindSpeed: --no-shared-storage has no effect here"]
    if _version(checkout) != "0.12.1":
        expected.append("> MindSpeed: --moe-token-dispatcher-type alltoall_seq runs as alltoall")
    for line in expected:
        assert sum(n.startswith(line) for n in notes) == 1, (line, notes)


# a Qwen3-MoE as MindSpeed-LLM's recipes spell it, at CPU size, in Megatron-LM's own training loop
TRAIN_FLAGS = ["--qk-layernorm", "--moe-router-topk", "2", "--moe-intermediate-size", "32", "--norm-topk-prob",
               "--first-k-dense-replace", "1", "--n-shared-experts", "1", "--seq-aux",
               "--moe-token-dispatcher-type", "alltoall_seq", "--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec",
               "layer_spec", "--no-shared-storage"]


def test_qwen3_moe_in_mindspeed_llms_spellings_trains(checkout):
    version = _version(checkout)
    if SLOW:
        pytest.skip("MINDSPEED_SLOW_TESTS=1 trains it (CI's launch here is the DeepSeek-V3 recipe's, which covers "
                    "its translations but for --spec qwen3_spec and alltoall_seq: the parse checks above have those)")
    result = kit.launch(checkout, 2, TRAIN_FLAGS, {"MOCK_DATA": "1", "EP": "2", "NUM_EXPERTS": "4",
                                                   "TRAIN_ITERS": "3"})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    losses = kit.losses(output)
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) and 0 < v < 20 for v in losses.values()), \
        (losses, output[-3000:])
    print(f"core_v{version} qwen3-moe (MindSpeed-LLM spellings): lm loss {losses[1]:.4f} -> {losses[3]:.4f}")
    # Megatron's args dump: what MindSpeed-LLM's spellings became
    for dest, value in (("moe_layer_freq", "[0, 1, 1, 1]"), ("moe_shared_expert_intermediate_size", "32"),
                        ("moe_ffn_hidden_size", "32"), ("moe_router_load_balancing_type", "seq_aux_loss"),
                        ("qk_layernorm", "True"), ("spec", "None"),
                        ("moe_token_dispatcher_type", "alltoall_seq" if version == "0.12.1" else "alltoall")):
        assert re.search(rf"^\s*{dest} \.+ {re.escape(value)}$", output, re.M), (dest, value, output[-3000:])
    assert "> MindSpeed: --spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec: Megatron-LM's own layer " \
           "spec" in output
    assert ("> MindSpeed: --moe-token-dispatcher-type alltoall_seq runs as alltoall" in output) == \
        (version != "0.12.1"), output[-3000:]
    assert "expert-parallel" in kit.mindspeed_features(output)


# the recipe's Hugging Face model at its CPU size (shrink.SIZES): 3 layers (the recipe's 4th is a noop layer)
# and the MTP layer, the weights random
DEEPSEEK3_HF = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                    first_k_dense_replace=1, n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=2.5,
                    rms_norm_eps=1e-6, rope_parameters=dict(rope_type="yarn", factor=40.0, beta_fast=32.0,
                                                            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                                            original_max_position_embeddings=32, rope_theta=10000.0))
# what the recipe's MindSpeed-LLM spellings became, in Megatron's arguments dump
DEEPSEEK3_ARGS = (("multi_latent_attention", "True"), ("rope_type", "yarn"), ("rotary_scaling_factor", "40.0"),
                  ("beta_fast", "32.0"), ("original_max_position_embeddings", "32"), ("mtp_num_layers", "1"),
                  ("moe_layer_freq", "[0, 1, 1, 1]"), ("moe_shared_expert_intermediate_size", "32"),
                  ("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", "True"),
                  ("moe_router_load_balancing_type", "seq_aux_loss"), ("moe_router_num_groups", "2"),
                  ("moe_router_group_topk", "1"), ("moe_router_topk_scaling_factor", "2.5"),
                  ("spec", "None"))


def _without(argv: list, flags) -> list:
    """argv less the options named (each with its values)."""
    out, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token in flags
        if not skipping:
            out.append(token)
    return out


@pytest.fixture(scope="module")
def deepseek3_recipe(checkout, tmp_path_factory):
    """The DeepSeek-V3 recipe at CPU size with its Hugging Face model at --load, a tokenizer and a dataset."""
    if _version(checkout) != kit.VERSIONS[-1]:
        pytest.skip(f"the DeepSeek-V3 recipe runs on core_v{kit.VERSIONS[-1]} (core_v0.12.1's MTP and YaRN differ)")
    from tests_extend.unit import convert_kit, data_kit
    tmp = tmp_path_factory.mktemp("deepseek3")
    hf = str(tmp / "hf")
    convert_kit.make_hf_model(hf, "deepseek_v3", **DEEPSEEK3_HF)
    convert_kit.add_mtp_layer(hf, layers=DEEPSEEK3_HF["num_hidden_layers"], hidden=DEEPSEEK3_HF["hidden_size"])
    tok = data_kit.make_tokenizer(str(tmp / "tok"), extra_texts=["the quick brown fox jumps over the lazy dog"])
    docs = data_kit.write_jsonl(str(tmp / "docs.jsonl"), [{"text": "the quick brown fox jumps over the lazy dog "
                                                                  * 20} for _ in range(40)])
    assert data_kit.preprocess("--input", docs, "--output-prefix", str(tmp / "data"), "--tokenizer-type",
                               "PretrainedFromHF", "--tokenizer-name-or-path", tok, "--append-eod") == 0
    paths = {"TOKENIZER_PATH": tok, "DATA_PATH": str(tmp / "data_text_document"), "CKPT_LOAD_DIR": hf,
             "CKPT_SAVE_DIR": str(tmp / "save")}
    argv = _without(shrink.shrink("deepseek3", paths), shrink.NOT_YET)
    return {"hf": hf, "argv": argv, "tmp": tmp}


def test_deepseek3_recipe_trains_from_its_converted_hugging_face_model(checkout, deepseek3_recipe):
    hf, argv = deepseek3_recipe["hf"], deepseek3_recipe["argv"]
    assert "--enable-hf2mg-convert" in argv and argv[argv.index("--load") + 1] == hf
    result = kit.launch(kit.with_dataset_helpers(checkout), 2, argv, {"EP": "2"})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    losses = kit.losses(output)
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) and 0 < v < 20 for v in losses.values()), \
        (losses, output[-3000:])
    assert len(re.findall(r"mtp_1 loss: [0-9.]+E[+-]\d+", output)) == 3, output[-3000:]
    for dest, value in DEEPSEEK3_ARGS:
        assert re.search(rf"^\s*{dest} \.+ {re.escape(value)}$", output, re.M), (dest, value, output[-3000:])
    cache = os.path.join(hf, "megatron_cache_tp1pp1ep2")
    assert f"> --enable-hf2mg-convert: loading {cache}, converted from {hf}" in output
    assert f"successfully loaded checkpoint from {cache}" in output and "at iteration 0" in output
    assert {"expert-parallel", "noop-layers", "moe-grouped-gemm"} <= kit.mindspeed_features(output)
    # the conversion is the one convert_ckpt.py makes first, with the run's sizes, dtype and format
    first = str(deepseek3_recipe["tmp"] / "first")
    from mindspeed.convert.cli import main
    assert main(["--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", "deepseek3",
                 "--load-dir", hf, "--save-dir", first, "--target-expert-parallel-size", "2", "--params-dtype", "bf16",
                 "--ckpt-format", "torch", "--padded-vocab-size", "129280", "--make-vocab-size-divisible-by", "1",
                 "--moe-grouped-gemm"]) == 0
    _assert_same_checkpoint(cache, first)
    print(f"core_v{_version(checkout)} deepseek3 recipe from Hugging Face: lm loss {losses[1]:.4f} -> {losses[3]:.4f}")
    if not SLOW:     # a second launch (~50 CPU-s): the run that loads the conversion made first trains the same
        again = kit.launch(checkout, 2, _without(argv, ("--enable-hf2mg-convert", "--model-type-hf", "--load"))
                           + ["--load", first, "--finetune"], {"EP": "2"})
        assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
        assert kit.losses(again.stdout + again.stderr) == losses


def _assert_same_checkpoint(one: str, other: str) -> None:
    """Two legacy checkpoints of iteration 0 hold the same model tensors, rank file by rank file."""
    import torch
    ranks = sorted(os.listdir(os.path.join(one, "iter_0000000")))
    assert ranks == sorted(os.listdir(os.path.join(other, "iter_0000000"))) and len(ranks) == 2, ranks
    for rank in ranks:
        a, b = (torch.load(os.path.join(root, "iter_0000000", rank, "model_optim_rng.pt"), weights_only=False)["model"]
                for root in (one, other))
        tensors = {k for k, v in a.items() if isinstance(v, torch.Tensor)}
        assert tensors == {k for k, v in b.items() if isinstance(v, torch.Tensor)} and tensors, rank
        assert all(torch.equal(a[k], b[k]) for k in tensors), rank
