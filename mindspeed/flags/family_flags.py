"""The model-family flags of MindSpeed-LLM's recipes (Llama-3/3.1, Qwen2.5, Qwen3, Qwen3-MoE, Mixtral,
DeepSeek-V3) for the built-in trainers' parser: q/k norms, RoPE scaling (llama3, yarn), multi-latent
attention, multi-token prediction, the MoE router's options and layer layout, and the run switches
those recipes pass.

Megatron-Core 0.16.1's own modules do the work (training/model.py maps the values to its
TransformerConfig); both spellings of a setting land in one dest here — Megatron's
(`--moe-router-num-groups`, `--qk-head-dim`) and MindSpeed-LLM's (`--n-group`, `--qk-nope-head-dim`,
its 2.1.0 names) — and `derive_family_args` turns MindSpeed-LLM's combined options (`--rope-scaling-type`,
`--first-k-dense-replace`, `--n-shared-experts`, `--seq-aux`, its balancing types) into Megatron-Core's
values. What Megatron-Core cannot express is refused in `family_problems`, one line each.
"""
from __future__ import annotations

import argparse
import ast
import os

# MindSpeed-LLM's load-balancing types -> (Megatron-Core's type, what else it sets)
LLM_BALANCING = {
    "noaux_tc": "none",        # DeepSeek-V3: sigmoid scores, expert bias, group-limited top-k, no aux loss
    "softmax_topk": "none",    # softmax over all experts, then top-k (Megatron-Core's pre-softmax routing)
}
MCORE_BALANCING = ["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]
UNSUPPORTED_BALANCING = {
    "group_limited_greedy": "DeepSeek-V2's per-group maximum; Megatron-Core's group-limited routing sums the "
                            "top scores of each group: use --moe-router-load-balancing-type aux_loss (or none) "
                            "with --moe-router-num-groups/--moe-router-group-topk",
    "pai_megatron_aux_loss": "PAI-Megatron's auxiliary loss is not in Megatron-Core: use aux_loss",
    "sparsemixer_topk": "SparseMixer's top-2 estimator is not in Megatron-Core: use aux_loss",
}


def moe_layer_freq(text: str):
    """Megatron's --moe-layer-freq: an int N (every N-th layer is MoE; MindSpeed-LLM's -1: every layer), or a
    list of 0/1 per layer written as Megatron writes it, e.g. "([0]*3+[1]*29)" — read without eval()."""
    try:
        return int(text)
    except ValueError:
        pass

    def value(node):
        if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and e.value in (0, 1) for e in node.elts):
            return [e.value for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError
    try:
        pattern = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not isinstance(pattern, list) or not pattern:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer or a 0/1 list such as \"([0]*3+[1]*29)\"")
    return pattern


def add_family_args(parser: argparse.ArgumentParser) -> None:
    _attention(parser)
    _rope_scaling(parser)
    _router(parser)
    _moe_layout(parser)
    _mtp(parser)
    _run_switches(parser)
    _recipe_launch(parser)


def _attention(parser) -> None:
    g = parser.add_argument_group("attention variants (Megatron-Core's q/k norms and multi-latent attention)")
    g.add_argument("--qk-layernorm", action="store_true", help="normalize queries and keys per head (Qwen3)")
    g.add_argument("--multi-latent-attention", "--multi-head-latent-attention", dest="multi_latent_attention",
                   action="store_true", help="DeepSeek's multi-latent attention (MindSpeed-LLM 2.1.0's spelling too)")
    g.add_argument("--q-lora-rank", type=int, default=None, help="MLA: query low-rank size (None: full-rank)")
    g.add_argument("--kv-lora-rank", type=int, default=32, help="MLA: key/value low-rank size")
    g.add_argument("--qk-head-dim", "--qk-nope-head-dim", dest="qk_head_dim", type=int, default=128,
                   help="MLA: the q/k head size without the positional part")
    g.add_argument("--qk-pos-emb-head-dim", "--qk-rope-head-dim", dest="qk_pos_emb_head_dim", type=int, default=64,
                   help="MLA: the q/k head size that carries RoPE")
    g.add_argument("--v-head-dim", type=int, default=128, help="MLA: the value head size")
    g.add_argument("--mla-fa-without-pad", action="store_true",
                   help="MLA: flash attention takes v's head size as it is (never padded to q's here)")


def _rope_scaling(parser) -> None:
    g = parser.add_argument_group("RoPE scaling (Llama-3.1's and YaRN)")
    g.add_argument("--rope-scaling-type", default=None, choices=["llama3", "yarn"],
                   help="MindSpeed-LLM's: llama3 (with --rope-scaling-factor, --low/--high-freq-factor, "
                        "--original-max-position-embeddings) or yarn (with --rope-scaling-factor, --beta-fast, ...)")
    g.add_argument("--rope-type", default=None, choices=["rope", "yarn"],
                   help="Megatron's: yarn = YaRN scaling by --rotary-scaling-factor, --mscale, --mscale-all-dim")
    g.add_argument("--rotary-scaling-factor", type=float, default=None, help="Megatron's YaRN factor (--rope-type yarn)")
    g.add_argument("--mscale", "--rope-scaling-mscale", dest="mscale", type=float, default=None,
                   help="YaRN attention scale (default 1.0)")
    g.add_argument("--mscale-all-dim", "--rope-scaling-mscale-all-dim", dest="mscale_all_dim", type=float,
                   default=None, help="YaRN attention scale over all dims (default 0.0)")
    g.add_argument("--beta-fast", "--rope-scaling-beta-fast", dest="beta_fast", type=float, default=None,
                   help="YaRN: rotations above which frequencies are kept (default 32)")
    g.add_argument("--beta-slow", "--rope-scaling-beta-slow", dest="beta_slow", type=float, default=None,
                   help="YaRN: rotations below which frequencies are interpolated (default 1)")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=None,
                   help="YaRN: the context length the model was pretrained at (default 4096)")
    g.add_argument("--original-max-position-embeddings", type=float, default=None,
                   help="llama3 scaling: the original context (Llama-3.1: 8192)")
    g.add_argument("--low-freq-factor", type=float, default=None, help="llama3 scaling (Llama-3.1: 1)")
    g.add_argument("--high-freq-factor", type=float, default=None, help="llama3 scaling (Llama-3.1: 4)")


def _router(parser) -> None:
    g = parser.add_argument_group("MoE router (Megatron-Core's TopKRouter)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=MCORE_BALANCING + list(LLM_BALANCING) + list(UNSUPPORTED_BALANCING),
                   help="Megatron-Core's types; MindSpeed-LLM's noaux_tc and softmax_topk map onto them")
    g.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias on the routing scores, updated each step "
                        "(sigmoid scores)")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-num-groups", "--n-group", dest="moe_router_num_groups", type=int, default=None,
                   help="group-limited routing: expert groups")
    g.add_argument("--moe-router-group-topk", "--topk-group", dest="moe_router_group_topk", type=int, default=None,
                   help="group-limited routing: groups each token may use")
    g.add_argument("--moe-router-topk-scaling-factor", "--routed-scaling-factor",
                   dest="moe_router_topk_scaling_factor", type=float, default=None,
                   help="multiply the routed experts' weights (DeepSeek-V3: 2.5)")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (weights not renormalized)")
    g.add_argument("--norm-topk-prob", action="store_true",
                   help="MindSpeed-LLM's: the top-k weights sum to 1 (Megatron-Core's default routing)")
    g.add_argument("--seq-aux", action="store_true",
                   help="MindSpeed-LLM's: the auxiliary loss per sequence (Megatron-Core's seq_aux_loss)")
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"],
                   help="the router's scores in this precision")
    g.add_argument("--router-gating-in-fp32", dest="moe_router_dtype", action="store_const", const="fp32",
                   help="MindSpeed-LLM 2.1.0's spelling of --moe-router-dtype fp32")


def _moe_layout(parser) -> None:
    g = parser.add_argument_group("MoE layout")
    g.add_argument("--moe-layer-freq", type=moe_layer_freq, default=1,
                   help="every N-th layer is MoE, or a 0/1 list per layer (\"([0]*3+[1]*29)\")")
    g.add_argument("--first-k-dense-replace", type=int, default=None,
                   help="MindSpeed-LLM's: the first K layers are dense (with --moe-layer-freq)")
    g.add_argument("--n-shared-experts", type=int, default=None,
                   help="MindSpeed-LLM's: shared experts, each of --moe-ffn-hidden-size "
                        "(Megatron's --moe-shared-expert-intermediate-size = N x that)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor-parallel size inside each expert (default: --tensor-model-parallel-size)")


def _mtp(parser) -> None:
    g = parser.add_argument_group("multi-token prediction (Megatron-Core's MTP block)")
    g.add_argument("--mtp-num-layers", type=int, default=None, help="MTP layers after the decoder (DeepSeek-V3: 1)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="the MTP losses' weight in the training loss")
    g.add_argument("--mtp-mem-efficient-logits", action="store_true",
                   help="MindSpeed-LLM's memory saver for the MTP logits: the same loss, computed as Megatron-Core does")


def _run_switches(parser) -> None:
    g = parser.add_argument_group("run switches of MindSpeed-LLM's recipes")
    g.add_argument("--no-save-optim", action="store_true",
                   help="checkpoints without optimizer state (resume them with --no-load-optim)")
    g.add_argument("--no-save-rng", action="store_true",
                   help="checkpoints without RNG state (--ckpt-format torch saves it; torch_dist and the MindSpore "
                        "trainer's never do)")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector runs every --manual-gc-interval steps, not when it likes")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="steps between collections with --manual-gc (0: only at evaluation and checkpoints)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false", help="a nan/inf loss does not stop the run")
    g.add_argument("--no-shared-storage", action="store_true",
                   help="MindSpeed-LLM's: each node saves to its own disk (one node here: no effect)")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="Megatron's fused token permutation (Transformer Engine's kernel)")


# MindSpeed-LLM's layer specs and the flags that express each on Megatron-Core's own local spec
KNOWN_SPECS = {"mindspeed_llm.tasks.models.spec.qwen3_spec": ("--qk-layernorm", "qk_layernorm"),
               "mindspeed_llm.tasks.models.spec.deepseek_spec": ("--multi-latent-attention", "multi_latent_attention")}


def _recipe_launch(parser) -> None:
    g = parser.add_argument_group("MindSpeed-LLM launch options")
    g.add_argument("--spec", nargs=2, default=None, metavar=("MODULE", "NAME"),
                   help="a layer spec: MindSpeed-LLM's qwen3_spec/deepseek_spec are Megatron-Core's local spec with "
                        "the flags that say so (--qk-layernorm; --multi-latent-attention)")
    g.add_argument("--handler-name", default=None, help="preprocessing's (python -m mindspeed.data): no effect here")
    g.add_argument("--workers", type=int, default=None, help="preprocessing's (python -m mindspeed.data): no effect here")
    g.add_argument("--enable-hf2mg-convert", action="store_true",
                   help="MindSpeed-LLM's: the run first converts the Hugging Face model --load names (convert_ckpt.py's "
                        "conversion, for this run's sizes and --ckpt-format) and loads the result (torch trainer)")
    g.add_argument("--model-type-hf", default=None,
                   help="with --enable-hf2mg-convert (convert_ckpt.py's flag; default: from config.json's model_type)")
    g.add_argument("--mg-save-dir", default=None,
                   help="with --enable-hf2mg-convert: where the converted checkpoint goes (default "
                        "<load>/megatron_cache_tp<T>pp<P>ep<E>)")


def moe_layer_pattern(args) -> list[int] | None:
    """0/1 per layer (1: MoE) from --moe-layer-freq and --first-k-dense-replace; None for a dense model,
    and for args without the MoE family flags (a parser that does not define --moe-layer-freq)."""
    if not args.num_experts or not hasattr(args, "moe_layer_freq"):
        return None
    freq, first = args.moe_layer_freq, args.first_k_dense_replace
    if isinstance(freq, list):
        pattern = list(freq)
    else:   # Megatron's and MindSpeed-LLM's rule (i % -1 == 0: every layer)
        pattern = [1 if freq and i % freq == 0 else 0 for i in range(args.num_layers)]
    if first is not None and first > 0:
        pattern = [0 if i < first else p for i, p in enumerate(pattern)]
    return pattern


def preprocessing_notes(args) -> list[str]:
    """The one line for each preprocessing or conversion flag that has no effect in training."""
    notes = [f"> {flag} has no effect here: it is a preprocessing flag (python -m mindspeed.data reads it); "
             "training reads the dataset --data-path names"
             for flag, dest in (("--handler-name", "handler_name"), ("--workers", "workers"))
             if getattr(args, dest) is not None]
    notes.extend(f"> {flag} has no effect without --enable-hf2mg-convert"
                 for flag, dest in (("--model-type-hf", "model_type_hf"), ("--mg-save-dir", "mg_save_dir"))
                 if getattr(args, dest) is not None and not args.enable_hf2mg_convert)
    return notes


def spec_note(spec, built: str = "Megatron-Core's local spec") -> str | None:
    """The line for MindSpeed-LLM's known --spec (MODULE NAME): `built` with the flag that says so."""
    if spec and spec[0] in KNOWN_SPECS:
        return f"> --spec {' '.join(spec)}: {built} with {KNOWN_SPECS[spec[0]][0]}"
    return None


def derive_router(args) -> None:
    """MindSpeed-LLM's load-balancing types and --seq-aux as Megatron-Core's router values (one type in
    args.moe_router_load_balancing_type)."""
    kind = args.moe_router_load_balancing_type
    if kind == "noaux_tc":
        args.moe_router_score_function = "sigmoid"
        args.moe_router_enable_expert_bias = True
    if kind == "softmax_topk":
        args.moe_router_pre_softmax = True
    if kind in LLM_BALANCING:
        args.moe_router_load_balancing_type = LLM_BALANCING[kind]
    if args.seq_aux and args.moe_router_load_balancing_type in ("aux_loss", "none"):
        args.moe_router_load_balancing_type = "seq_aux_loss"


def shared_expert_size(args) -> int:
    """--n-shared-experts N as Megatron's --moe-shared-expert-intermediate-size: N experts' FFN sizes."""
    return args.n_shared_experts * (args.moe_ffn_hidden_size or args.ffn_hidden_size)


ALLTOALL_SEQ_NOTE = ("> --moe-token-dispatcher-type alltoall_seq runs as alltoall: Megatron-Core 0.16 dropped "
                     "alltoall_seq (the same tokens reach the same experts)")


def derive_family_args(args, say) -> None:
    """MindSpeed-LLM's combined options -> the Megatron-Core values training/model.py reads; `say` gets the
    one line for a flag that runs as another here, or has no effect."""
    for note in [auto_hf2mg(args), *preprocessing_notes(args)]:      # converting first: --model-type-hf counts
        if note:
            say(note)
    note = spec_note(args.spec)
    if note:
        say(note)
    derive_router(args)
    if args.num_experts and args.n_shared_experts and args.moe_shared_expert_intermediate_size is None:
        args.moe_shared_expert_intermediate_size = shared_expert_size(args)
    if args.rope_scaling_type == "llama3":
        args.use_rope_scaling = True
    yarn = args.rope_scaling_type == "yarn" or args.rope_type == "yarn"
    args.yarn = yarn
    if yarn and args.rotary_scaling_factor is None:
        args.rotary_scaling_factor = args.rope_scaling_factor     # MindSpeed-LLM's spelling of the factor
    if args.moe_token_dispatcher_type == "alltoall_seq":
        args.moe_token_dispatcher_type = "alltoall"
        say(ALLTOALL_SEQ_NOTE)


LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0}
# YaRN's settings a recipe leaves out: Megatron-Core 0.16's MLATransformerConfig defaults (the torch trainer reads
# them from there; the MindSpore trainer from here, and its parity test checks the two agree)
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                 "original_max_position_embeddings": 4096}


def yarn_settings(args) -> dict:
    """YaRN's factor and settings (Megatron-Core's names, without the yarn_ prefix), the defaults for those
    not given."""
    given = dict(beta_fast=args.beta_fast, beta_slow=args.beta_slow, mscale=args.mscale,
                 mscale_all_dim=args.mscale_all_dim,
                 original_max_position_embeddings=args.rope_scaling_original_max_position_embeddings)
    return dict(YARN_DEFAULTS, rotary_scaling_factor=args.rotary_scaling_factor,
                **{k: v for k, v in given.items() if v is not None})
YARN_FLAGS = (("--beta-fast", "beta_fast"), ("--beta-slow", "beta_slow"), ("--mscale", "mscale"),
              ("--mscale-all-dim", "mscale_all_dim"), ("--rotary-scaling-factor", "rotary_scaling_factor"),
              ("--rope-scaling-original-max-position-embeddings", "rope_scaling_original_max_position_embeddings"))
YARN_AND_LLAMA3 = "YaRN scaling and --use-rope-scaling (Llama-3.1's) both scale RoPE: give one"
NO_MOE_LAYER = "--moe-layer-freq/--first-k-dense-replace leave no MoE layer: drop --num-experts for a dense model"
SIGMOID_NORMALIZES = ("--moe-router-score-function sigmoid: Megatron-Core's router always normalizes the top-k "
                      "sigmoid weights (DeepSeek-V3's norm_topk_prob): add --norm-topk-prob")
NORM_TOPK_PRE_SOFTMAX = ("--norm-topk-prob with --moe-router-pre-softmax (or softmax_topk): renormalized pre-softmax "
                         "weights are Megatron-Core's default routing; drop both for it")


def known_spec_problem(args, spec) -> str | None:
    """MindSpeed-LLM's known --spec without the flag that expresses it."""
    flag, dest = KNOWN_SPECS.get(spec[0], (None, None)) if spec else (None, None)
    if flag is not None and not getattr(args, dest):
        return f"--spec {' '.join(spec)} is Megatron-Core's local spec with {flag}: add {flag}"
    return None


def hf_model_in(path) -> bool:
    """A Hugging Face model's directory, as MindSpeed-LLM recognises one at --load: a config.json beside
    safetensors weights."""
    try:
        names = os.listdir(path) if path else []
    except OSError:
        return False
    return "config.json" in names and any(name.endswith(".safetensors") for name in names)


def auto_hf2mg(args) -> str | None:
    """MindSpeed-LLM converts a Hugging Face model at --load without being asked (--enable-hf2mg-convert
    turned on): the same here, said in one line (None when --load holds no such model or the flag is given)."""
    if args.enable_hf2mg_convert or not hf_model_in(args.load):
        return None
    args.enable_hf2mg_convert = True
    return (f"> --load {args.load} holds a Hugging Face model (config.json, *.safetensors): converted before "
            "loading, as with --enable-hf2mg-convert (MindSpeed-LLM does the same)")


def hf2mg_problem(args) -> str | None:
    """--enable-hf2mg-convert: the torch trainer and Megatron-LM's pretrain_gpt.py convert --load's model first."""
    if not args.enable_hf2mg_convert:
        return None
    if args.backend == "mindspore":
        return ("--enable-hf2mg-convert converts for the torch trainer: on MindSpore convert first (python "
                "convert_ckpt.py --load-model-type hf --save-model-type mg ... --save-dir MG_DIR) and --load MG_DIR")
    if not args.load:
        return "--enable-hf2mg-convert converts the Hugging Face model that --load names: give --load HF_DIR"
    return None


def balancing_problem(kind) -> str | None:
    if kind in UNSUPPORTED_BALANCING:
        return f"--moe-router-load-balancing-type {kind}: {UNSUPPORTED_BALANCING[kind]}"
    return None


def llama3_problems(args) -> list[str]:
    """Llama-3.1's factors other than Megatron-Core's, or given without --rope-scaling-type llama3."""
    given = {k: getattr(args, k) for k in LLAMA3_SCALING}
    if args.rope_scaling_type == "llama3":
        other = {k: value for k, value in given.items() if value is not None and value != LLAMA3_SCALING[k]}
        if other:
            return ["--rope-scaling-type llama3 with " + ", ".join(f"--{k.replace('_', '-')} {v:g}"
                                                                   for k, v in other.items())
                    + ": Megatron-Core's Llama-3.1 scaling has low/high frequency factors 1/4 and an "
                      "original context of 8192; drop those flags (or give those values)"]
        return []
    flags = [f"--{k.replace('_', '-')}" for k, value in given.items() if value is not None]
    if flags:
        return [f"{', '.join(flags)}: only --rope-scaling-type llama3 reads them: add it or drop them"]
    return []


def yarn_flags_problem(flags) -> str:
    return (f"{', '.join(flags)}: only YaRN scaling reads them: add --rope-scaling-type yarn "
            "(or Megatron's --rope-type yarn) or drop them")


def rope_types_problem(scaling_type, rope_type) -> str | None:
    """--rope-scaling-type and Megatron's --rope-type naming different scalings."""
    if scaling_type and rope_type and (rope_type == "yarn") != (scaling_type == "yarn"):
        return f"--rope-scaling-type {scaling_type} and --rope-type {rope_type} disagree: give one"
    return None


def mla_only_problem(flags) -> str:
    return f"{', '.join(flags)}: only multi-latent attention reads them: add --multi-latent-attention or drop them"


def moe_only_problem(flags) -> str:
    return f"{', '.join(flags)} configure MoE layers: add --num-experts or drop them"


def family_problems(args) -> list[str]:
    problems = []
    if args.spec is not None:
        module, name = args.spec
        if module not in KNOWN_SPECS:
            problems.append(f"--spec {module} {name}: the built-in trainer builds Megatron-Core's local spec; "
                            "MindSpeed-LLM's qwen3_spec and deepseek_spec are known (their flags: --qk-layernorm, "
                            "--multi-latent-attention); run your own spec in Megatron-LM's pretrain_gpt.py")
        elif known_spec_problem(args, args.spec):
            problems.append(known_spec_problem(args, args.spec))
    if hf2mg_problem(args):
        problems.append(hf2mg_problem(args))
    if balancing_problem(args.moe_router_load_balancing_type):
        problems.append(balancing_problem(args.moe_router_load_balancing_type))
    problems.extend(llama3_problems(args))
    yarn_flags = [f for f, dest in YARN_FLAGS if getattr(args, dest) is not None]
    if yarn_flags and not args.yarn and not args.multi_latent_attention:
        problems.append(yarn_flags_problem(yarn_flags))
    if rope_types_problem(args.rope_scaling_type, args.rope_type):
        problems.append(rope_types_problem(args.rope_scaling_type, args.rope_type))
    if args.yarn and args.use_rope_scaling:
        problems.append(YARN_AND_LLAMA3)
    if args.yarn and args.rotary_scaling_factor is None:
        problems.append("YaRN scaling needs its factor: add --rope-scaling-factor N (Megatron: --rotary-scaling-factor)")
    if args.rope_scaling_factor is not None and not (args.use_rope_scaling or args.yarn):
        problems.append(f"--rope-scaling-factor {args.rope_scaling_factor:g} acts only with --use-rope-scaling "
                        "(Llama-3.1) or --rope-scaling-type yarn|llama3: add one, or drop the factor")
    mla = args.multi_latent_attention
    mla_given = [f"--{d.replace('_', '-')}" for d, default in (("q_lora_rank", None), ("kv_lora_rank", 32),
                 ("qk_head_dim", 128), ("qk_pos_emb_head_dim", 64), ("v_head_dim", 128), ("mla_fa_without_pad", False))
                 if getattr(args, d) != default]
    if mla_given and not mla:
        problems.append(mla_only_problem(mla_given))
    moe_only = [f for f, on in (("--moe-router-score-function", args.moe_router_score_function != "softmax"),
                                ("--moe-router-enable-expert-bias", args.moe_router_enable_expert_bias),
                                ("--moe-router-num-groups", args.moe_router_num_groups is not None),
                                ("--moe-router-group-topk", args.moe_router_group_topk is not None),
                                ("--moe-router-topk-scaling-factor", args.moe_router_topk_scaling_factor is not None),
                                ("--moe-router-pre-softmax", args.moe_router_pre_softmax),
                                ("--moe-router-dtype", args.moe_router_dtype is not None),
                                ("--seq-aux", args.seq_aux), ("--first-k-dense-replace",
                                                              (args.first_k_dense_replace or 0) > 0),
                                ("--n-shared-experts", bool(args.n_shared_experts)),
                                ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size is not None))
                if on]
    if moe_only and not args.num_experts:
        problems.append(moe_only_problem(moe_only))
    if args.num_experts:
        problems.extend(_router_problems(args))
    if args.mtp_num_layers is not None and args.mtp_num_layers < 1:
        problems.append(f"--mtp-num-layers must be a positive integer (got {args.mtp_num_layers})")
    if args.manual_gc_interval and not args.manual_gc:
        problems.append("--manual-gc-interval acts only with --manual-gc: add it or drop the interval")
    if args.manual_gc_interval < 0:
        problems.append(f"--manual-gc-interval must be >= 0 (got {args.manual_gc_interval})")
    return problems


def _router_problems(args) -> list[str]:
    problems = []
    pattern = moe_layer_pattern(args)
    if len(pattern) != args.num_layers:
        problems.append(f"--moe-layer-freq gives {len(pattern)} layers, --num-layers {args.num_layers}")
    elif not any(pattern):
        problems.append(NO_MOE_LAYER)
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        problems.append("--moe-router-num-groups and --moe-router-group-topk (--n-group/--topk-group) go together")
    elif groups is not None and (args.num_experts % groups or group_topk > groups
                                 or args.moe_router_topk % group_topk
                                 or args.moe_router_topk // group_topk > args.num_experts // groups):
        problems.append(f"group-limited routing needs --num-experts {args.num_experts} divisible by "
                        f"--moe-router-num-groups {groups}, --moe-router-group-topk {group_topk} <= the groups, and "
                        f"--moe-router-topk {args.moe_router_topk} divisible by the group top-k, at most the "
                        "experts of a group per chosen group")
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        problems.append("--moe-router-enable-expert-bias balances sigmoid scores: add "
                        "--moe-router-score-function sigmoid")
    sigmoid_normalizes = args.moe_router_score_function == "sigmoid" and args.moe_router_topk > 1
    if sigmoid_normalizes and not args.norm_topk_prob:
        problems.append(SIGMOID_NORMALIZES)
    if args.norm_topk_prob and args.moe_router_pre_softmax and args.moe_router_score_function == "softmax":
        problems.append(NORM_TOPK_PRE_SOFTMAX)
    return problems
