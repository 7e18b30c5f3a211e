"""MindSpeed-LLM's model-family flags under Megatron-LM's own pretrain_gpt.py (the one import line).

Megatron-LM's parser already knows Megatron's spellings of the family options (`--qk-layernorm`,
`--multi-latent-attention`, `--moe-router-num-groups`, `--rope-type yarn`, `--moe-layer-freq`, ...).
`add_args` adds exactly the MindSpeed-LLM spellings the parser at hand lacks (so core_v0.12.1 and
core_v0.16.1 each get their own set), from the built-in trainers' definitions (flags/family_flags.py):
an alias of Megatron's option where one exists (the same dest: `--n-group` is
`--moe-router-num-groups`), else the flag with its own dest (`--first-k-dense-replace`); Megatron's
choices gain MindSpeed-LLM's values (load-balancing types; `alltoall_seq` where Megatron-Core dropped
it).

`before_checks` then turns MindSpeed-LLM's combined options into Megatron's args before Megatron's
validate_args checks them, as derive_family_args does for the built-in trainer, with the same
helpers and texts: noaux_tc, softmax_topk, --seq-aux, --first-k-dense-replace, llama3 and (with
multi-latent attention) yarn RoPE scaling, alltoall_seq, MindSpeed-LLM's known --spec; what Megatron-LM
cannot honour is one line (`problems`). `after_checks` sizes the shared experts where only Megatron's
checks derive the experts' FFN size. Megatron's own spellings keep Megatron's meaning: only the
MindSpeed-LLM ones are checked here.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
from typing import NamedTuple

from mindspeed.flags import family_flags as ff
from mindspeed.flags import trainer_flags

# MindSpeed-LLM's spellings of the family options (master and 2.1.0): each joins Megatron-LM's parser
# where that parser lacks it
LLM_SPELLINGS = (
    "--rope-scaling-type", "--low-freq-factor", "--high-freq-factor", "--original-max-position-embeddings",
    "--beta-fast", "--beta-slow", "--rope-scaling-beta-fast", "--rope-scaling-beta-slow", "--rope-scaling-mscale",
    "--rope-scaling-mscale-all-dim", "--rope-scaling-original-max-position-embeddings",
    "--multi-head-latent-attention", "--qk-nope-head-dim", "--qk-rope-head-dim", "--mla-fa-without-pad",
    "--n-group", "--topk-group", "--routed-scaling-factor", "--router-gating-in-fp32", "--moe-intermediate-size",
    "--norm-topk-prob", "--seq-aux", "--first-k-dense-replace", "--n-shared-experts",
    "--mtp-mem-efficient-logits", "--no-shared-storage", "--moe-permute-fusion",
    "--spec", "--handler-name", "--workers", "--enable-hf2mg-convert", "--model-type-hf", "--mg-save-dir",
)
# MindSpeed-LLM's values of Megatron's choices (the unsupported balancing types are refused in one line)
LLM_CHOICES = {"--moe-router-load-balancing-type": [*ff.LLM_BALANCING, *ff.UNSUPPORTED_BALANCING],
               "--moe-token-dispatcher-type": ["alltoall_seq"],
               # upstream MindSpeed's alibi: parsed, then refused in one line (features/fused/alibi.py)
               "--position-embedding-type": ["alibi"]}
BUILTIN_TRAINER = "MindSpeed's built-in trainer (tests_extend/example/pretrain_gpt.py)"
MEGATRON_LM_SPEC = "Megatron-LM's own layer spec (--transformer-impl)"


class ParsedFamily(NamedTuple):
    """What `add_args` found in the parser: the spellings it added, Megatron's defaults (to tell a
    flag given from one left at its default) and the choices it extended."""
    added: tuple
    defaults: dict
    added_choices: dict


def add_args(parser: argparse.ArgumentParser) -> ParsedFamily:
    existing = parser._option_string_actions
    dests = {a.dest for a in parser._actions}
    donor = trainer_flags.build_parser()._option_string_actions    # one definition and help text for both
    group = parser.add_argument_group("MindSpeed-LLM model-family spellings")
    added = []
    for flag in LLM_SPELLINGS:
        if flag in existing:
            continue
        ours = donor[flag]
        megatron = next((existing[s] for s in ours.option_strings if s != flag and s in existing), None)
        if megatron is not None:     # an alias: Megatron's own option under MindSpeed-LLM's name
            action = copy.copy(megatron)
            action.help = f"MindSpeed-LLM's spelling of {megatron.option_strings[0]}"
        else:
            action = copy.copy(ours)
        action.option_strings = [flag]
        if action.dest in dests:     # Megatron's option sets the default; this one only writes its value
            action.default = argparse.SUPPRESS
        group._add_action(action)
        dests.add(action.dest)
        added.append(flag)
    added_choices = {}
    for flag, values in LLM_CHOICES.items():
        action = existing.get(flag)
        missing = [v for v in values if action is not None and action.choices is not None and v not in action.choices]
        if missing:
            action.choices = [*action.choices, *missing]
            added_choices[flag] = missing
    defaults = {a.dest: a.default for a in parser._actions if a.default is not argparse.SUPPRESS}
    return ParsedFamily(tuple(added), defaults, added_choices)


def _given(args, parsed: ParsedFamily, dest: str) -> bool:
    return hasattr(args, dest) and getattr(args, dest) != parsed.defaults.get(dest)


def _balancing(args) -> tuple[str | None, list[str]]:
    """Megatron 0.16's --moe-router-load-balancing-type takes several types (a list): MindSpeed-LLM's
    values and --seq-aux take one, returned as a plain value (as Megatron's checks make a one-item list)."""
    kind = args.moe_router_load_balancing_type
    if isinstance(kind, list) and len(kind) == 1:
        kind = args.moe_router_load_balancing_type = kind[0]
    if not isinstance(kind, list):
        return kind, []
    llm = [k for k in kind if k in ff.LLM_BALANCING or k in ff.UNSUPPORTED_BALANCING]
    if llm or args.seq_aux:
        what = f"--moe-router-load-balancing-type {llm[0]}" if llm else "--seq-aux"
        return None, [f"{what} takes one load-balancing type, not {' '.join(kind)}: give it alone"]
    return None, []


def before_checks(args, parsed: ParsedFamily) -> tuple[list[str], list[str]]:
    """MindSpeed-LLM's spellings -> Megatron's args, before Megatron's checks: (problems, notes), each one
    line (notes without a prefix)."""
    auto = ff.auto_hf2mg(args)      # before the notes: --model-type-hf then has an effect
    problems, notes = [], [n[2:] for n in [auto, *ff.preprocessing_notes(args)] if n]
    problems.extend(p for p in (ff.hf2mg_problem(args),) if p)
    _spec(args, problems, notes)
    _router(args, parsed, problems, notes)
    _layout(args, problems)
    if args.moe_ffn_hidden_size or args.ffn_hidden_size:    # else once Megatron derives them (after_checks)
        after_checks(args)
    _rope(args, parsed, problems)
    if args.mla_fa_without_pad and not args.multi_latent_attention:
        problems.append(ff.mla_only_problem(["--mla-fa-without-pad"]))
    return problems, notes


def _spec(args, problems, notes) -> None:
    spec = args.spec
    if not spec:
        return
    if spec[0] in ff.KNOWN_SPECS:
        problem = ff.known_spec_problem(args, spec)
        if problem:
            problems.append(problem)
        else:
            notes.append(ff.spec_note(spec, MEGATRON_LM_SPEC)[2:])
            args.spec = None         # Megatron-LM builds its own spec, with the flag that says so
    elif spec[0].startswith("mindspeed_llm."):
        problems.append(f"--spec {' '.join(spec)}: MindSpeed-LLM's module is not here; its qwen3_spec and "
                        "deepseek_spec are Megatron-LM's own layer spec with --qk-layernorm (--multi-latent-attention)"
                        ": give those flags and drop --spec")


def _router(args, parsed, problems, notes) -> None:
    kind, found = _balancing(args)
    problems.extend(found)
    if kind is not None:
        problems.extend(p for p in (ff.balancing_problem(kind),) if p)
        ff.derive_router(args)
    moe_only = [f for f, on in (("--seq-aux", args.seq_aux), ("--first-k-dense-replace",
                                                              (args.first_k_dense_replace or 0) > 0),
                                ("--n-shared-experts", bool(args.n_shared_experts))) if on]
    if moe_only and not args.num_experts:
        problems.append(ff.moe_only_problem(moe_only))
    if args.num_experts:
        # MindSpeed-LLM's noaux_tc without --norm-topk-prob asks for sigmoid weights left unnormalized
        if kind == "noaux_tc" and args.moe_router_topk > 1 and not args.norm_topk_prob:
            problems.append(ff.SIGMOID_NORMALIZES)
        if args.norm_topk_prob and args.moe_router_pre_softmax and args.moe_router_score_function == "softmax":
            problems.append(ff.NORM_TOPK_PRE_SOFTMAX)
    if args.moe_token_dispatcher_type == "alltoall_seq" and \
            "alltoall_seq" in parsed.added_choices.get("--moe-token-dispatcher-type", ()):
        args.moe_token_dispatcher_type = "alltoall"
        notes.append(ff.ALLTOALL_SEQ_NOTE[2:])


def _layout(args, problems) -> None:
    if (args.first_k_dense_replace or 0) > 0 and args.num_experts:
        pattern = ff.moe_layer_pattern(args)
        if len(pattern) == args.num_layers and not any(pattern):
            problems.append(ff.NO_MOE_LAYER)
        args.moe_layer_freq = pattern      # Megatron's 0/1 list (its own checks compare it with --num-layers)


def _rope(args, parsed, problems) -> None:
    problems.extend(ff.llama3_problems(args))
    rope_type = getattr(args, "rope_type", None)      # Megatron-LM core_v0.13 on
    problem = ff.rope_types_problem(args.rope_scaling_type, rope_type)
    if problem:
        problems.append(problem)
    if args.rope_scaling_type == "llama3":
        args.use_rope_scaling = True
    mla = args.multi_latent_attention
    yarn = args.rope_scaling_type == "yarn"
    own = [f for f, dest in ff.YARN_FLAGS if dest in ("beta_fast", "beta_slow",
                                                       "rope_scaling_original_max_position_embeddings")
           and getattr(args, dest) is not None]
    if own and not (yarn or rope_type == "yarn" or mla):
        problems.append(ff.yarn_flags_problem(own))
    if yarn and args.use_rope_scaling and args.rope_scaling_type != "llama3":
        problems.append(ff.YARN_AND_LLAMA3)
    if yarn and not mla:
        problems.append("--rope-scaling-type yarn without multi-latent attention: Megatron-LM's GPT builder has no "
                        "YaRN position embedding for standard attention (its --position-embedding-type has no yarn); "
                        f"{BUILTIN_TRAINER} runs it, or add --multi-latent-attention")
    if yarn and mla:
        if hasattr(args, "rope_type"):        # Megatron's --rope-type (core_v0.13 on; core_v0.12's MLA: YaRN)
            args.rope_type = "yarn"
        if _given(args, parsed, "rope_scaling_factor") and _given(args, parsed, "rotary_scaling_factor") and \
                args.rope_scaling_factor != args.rotary_scaling_factor:
            problems.append(f"--rope-scaling-factor {args.rope_scaling_factor:g} and --rotary-scaling-factor "
                            f"{args.rotary_scaling_factor:g} both set YaRN's factor: give one")
        elif not _given(args, parsed, "rotary_scaling_factor"):
            args.rotary_scaling_factor = args.rope_scaling_factor    # MindSpeed-LLM's spelling of the factor
    if mla:
        _mla_yarn_fields(args, problems)


def _mla_yarn_fields(args, problems) -> None:
    """core_transformer_config_from_args copies every args attribute named like an MLATransformerConfig
    field: YaRN's settings that only MindSpeed-LLM spells (--beta-fast, --beta-slow, the original context)
    become those fields, and where not given, the fields' own defaults (never None)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    fields = {f.name: f.default for f in dataclasses.fields(MLATransformerConfig)}
    for dest in ("beta_fast", "beta_slow"):
        if dest in fields and getattr(args, dest) is None:
            setattr(args, dest, fields[dest])
    original = args.rope_scaling_original_max_position_embeddings
    if "original_max_position_embeddings" in fields:      # core_v0.13 on
        args.original_max_position_embeddings = original if original is not None \
            else fields["original_max_position_embeddings"]
    elif original is not None and original != args.max_position_embeddings:
        # core_v0.12's MLATransformerConfig takes YaRN's original context from its max_position_embeddings
        problems.append(f"--rope-scaling-original-max-position-embeddings {original}: Megatron-Core "
                        f"{_core_version()}'s multi-latent attention takes YaRN's original context from "
                        f"--max-position-embeddings ({args.max_position_embeddings}): give the same value, or use "
                        "Megatron-LM core_v0.16.1")


def _core_version() -> str:
    from mindspeed.versions import megatron_version
    return megatron_version()


def after_checks(args) -> None:
    """--n-shared-experts N as Megatron's shared experts' size, once an FFN size is known (given, or derived
    by Megatron's checks: Megatron's arguments dump then shows None, its model gets the size)."""
    if args.n_shared_experts and args.num_experts \
            and args.moe_shared_expert_intermediate_size is None:
        args.moe_shared_expert_intermediate_size = ff.shared_expert_size(args)
