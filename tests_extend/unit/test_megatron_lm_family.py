"""mindspeed/megatron_lm_family.py without a Megatron-LM checkout: MindSpeed-LLM's spellings join a parser
shaped like Megatron-LM's (its options' names, types, defaults and choices as core_v0.16.1 defines them), and
the translation before Megatron's checks. tests_extend/system/test_megatron_lm_family_flags.py runs the real
parsers of both tested Megatron-LM versions."""
import argparse

from mindspeed import megatron_lm_family as family


def _megatron_like_parser(dispatchers=("allgather", "alltoall", "flex")):
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--ffn-hidden-size", type=int, default=None)
    p.add_argument("--max-position-embeddings", type=int, default=None)
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    p.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    p.add_argument("--moe-layer-freq", type=int, default=1)
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument("--moe-router-num-groups", type=int, default=None)
    p.add_argument("--moe-router-dtype", type=str, default=None, choices=("fp32", "fp64"))
    p.add_argument("--moe-router-score-function", type=str, default="softmax", choices=("softmax", "sigmoid"))
    p.add_argument("--moe-router-enable-expert-bias", action="store_true")
    p.add_argument("--moe-router-pre-softmax", action="store_true")
    p.add_argument("--moe-router-load-balancing-type", type=str, nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"])
    p.add_argument("--moe-token-dispatcher-type", type=str, default="allgather", choices=dispatchers)
    p.add_argument("--moe-permute-fusion", action="store_true")
    p.add_argument("--qk-layernorm", action="store_true")
    p.add_argument("--multi-latent-attention", action="store_true")
    p.add_argument("--qk-head-dim", type=int, default=128)
    p.add_argument("--use-rope-scaling", action="store_true")
    p.add_argument("--rope-scaling-factor", type=float, default=8.0)
    p.add_argument("--rope-type", type=str, default=None, choices=["rope", "yarn"])
    p.add_argument("--rotary-scaling-factor", type=float, default=1.0)
    p.add_argument("--mscale", type=float, default=1.0)
    p.add_argument("--spec", type=str, nargs="*", default=None)
    p.add_argument("--load", type=str, default=None)       # Megatron's: a Hugging Face model there converts
    return p


def _translated(*argv, dispatchers=("allgather", "alltoall", "flex")):
    parser = _megatron_like_parser(dispatchers)
    parsed = family.add_args(parser)
    args = parser.parse_args(["--num-layers", "4", *argv])
    problems, notes = family.before_checks(args, parsed)
    return parser, parsed, args, problems, notes


def test_only_the_missing_spellings_join_as_aliases_or_their_own():
    parser, parsed, args, _, _ = _translated()
    actions = parser._option_string_actions
    assert actions["--n-group"].dest == "moe_router_num_groups" and actions["--n-group"].type is int
    assert actions["--moe-intermediate-size"].dest == "moe_ffn_hidden_size"
    assert actions["--rope-scaling-mscale"].dest == "mscale"
    assert actions["--router-gating-in-fp32"].dest == "moe_router_dtype"
    assert actions["--first-k-dense-replace"].dest == "first_k_dense_replace"
    # Megatron's own options are not redefined; its defaults are not overridden by the aliases
    assert "--moe-permute-fusion" not in parsed.added and "--spec" not in parsed.added
    assert (args.moe_router_num_groups, args.mscale, args.moe_router_dtype) == (None, 1.0, None)
    assert parsed.added_choices == {"--moe-router-load-balancing-type": ["noaux_tc", "softmax_topk",
                                                                         "group_limited_greedy",
                                                                         "pai_megatron_aux_loss", "sparsemixer_topk"],
                                    "--moe-token-dispatcher-type": ["alltoall_seq"]}
    # a Megatron whose dispatcher still has alltoall_seq keeps its own value
    assert "--moe-token-dispatcher-type" not in _translated(
        dispatchers=("allgather", "alltoall", "alltoall_seq"))[1].added_choices


def test_qwen3_moe_in_mindspeed_llms_spellings_becomes_megatrons_args():
    _, _, args, problems, notes = _translated(
        "--qk-layernorm", "--num-experts", "4", "--moe-intermediate-size", "32", "--first-k-dense-replace", "1",
        "--n-shared-experts", "1", "--seq-aux", "--norm-topk-prob", "--moe-token-dispatcher-type", "alltoall_seq",
        "--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec", "--n-group", "2")
    assert problems == []
    assert (args.moe_layer_freq, args.moe_shared_expert_intermediate_size, args.moe_router_load_balancing_type,
            args.moe_token_dispatcher_type, args.spec, args.moe_router_num_groups) == \
        ([0, 1, 1, 1], 32, "seq_aux_loss", "alltoall", None, 2)
    assert notes == ["--spec mindspeed_llm.tasks.models.spec.qwen3_spec layer_spec: Megatron-LM's own layer spec "
                     "(--transformer-impl) with --qk-layernorm",
                     "--moe-token-dispatcher-type alltoall_seq runs as alltoall: Megatron-Core 0.16 dropped "
                     "alltoall_seq (the same tokens reach the same experts)"]


def test_deepseek_router_and_mla_yarn_become_megatrons_args():
    _, _, args, problems, _ = _translated(
        "--num-experts", "4", "--moe-router-load-balancing-type", "noaux_tc", "--norm-topk-prob",
        "--multi-latent-attention", "--rope-scaling-type", "yarn", "--rope-scaling-factor", "40",
        "--rope-scaling-beta-fast", "16")
    assert problems == []
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias,
            args.moe_router_load_balancing_type) == ("sigmoid", True, "none")
    assert (args.rope_type, args.rotary_scaling_factor, args.beta_fast, args.beta_slow,
            args.original_max_position_embeddings) == ("yarn", 40.0, 16.0, 1, 4096)


def test_what_megatron_lm_cannot_run_is_one_line():
    for argv, message in (
            (["--rope-scaling-type", "yarn"], "Megatron-LM's GPT builder has no YaRN position embedding"),
            (["--num-experts", "4", "--moe-router-load-balancing-type", "noaux_tc", "aux_loss"],
             "takes one load-balancing type"),
            (["--seq-aux"], "--seq-aux configure MoE layers"),
            (["--spec", "mindspeed_llm.tasks.models.spec.deepseek_spec", "layer_spec"],
             "add --multi-latent-attention")):
        problems = _translated(*argv)[3]
        assert problems and message in problems[0], (argv, problems)
