"""Megatron-style command line for GPT pretraining (shared by the torch and mindspore trainers).

Megatron-LM's own `megatron/training/arguments.py` is not on PyPI, so this parser carries the
subset of its flags the trainers use, with Megatron's names and defaults. MindSpeed's own flags are
added by `mindspeed.flags.mindspeed_flags.add_mindspeed_args` (it skips options defined here).

Every flag here is acted on by the trainers. Megatron flags that need what MindSpeed does not ship
(Transformer Engine, cuDNN fused attention, legacy models, other tokenizers) are accepted so that
Megatron's scripts parse, and refused in `validate_args` with the reason and what to use instead.

--backend/--ai-framework/--device/--optimization-level are MindSpeed's flags (dest of --device:
`mindspeed_device`). `build_parser()` never reads sys.argv; `parse_args(argv)` parses, fills derived values and
validates the values that can be checked without a process group (`validate_args`).
"""
from __future__ import annotations

import argparse
import os
from typing import Sequence

from mindspeed.errors import ArgumentError, OneLineParser
from mindspeed.flags.checks import TOKENIZER_TYPES, cross_flag_problems, no_effect_notes, resolve_hf_alias
from mindspeed.flags.family_flags import add_family_args, derive_family_args, family_problems
from mindspeed.flags.mindspeed_flags import add_mindspeed_args, refuse_unknown, resolve_backend_name, shared_parser
from mindspeed.megatron_defaults import DISTRIBUTED_TIMEOUT_MINUTES, padded_vocab_size  # noqa: F401 (re-exported)


CHECKPOINT_TRACKER = "latest_checkpointed_iteration.txt"   # in both trainers' checkpoint roots


def _network(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="default: 4*hidden, or 8/3*hidden rounded down to 64 with --swiglu (as Megatron-LM)")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", default="rope", choices=["rope", "learned_absolute", "none", "alibi"],
                   help="alibi: per-head linear attention biases (features/fused/alibi.py), no embedding")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="Megatron alias for --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.1 RoPE frequency scaling (Megatron-Core's: low/high frequency factors 1/4, "
                        "original context 8192)")
    g.add_argument("--rope-scaling-factor", type=float, default=None,
                   help="with --use-rope-scaling (default 8) or --rope-scaling-type yarn|llama3")
    g.add_argument("--normalization", default="RMSNorm", choices=["RMSNorm", "LayerNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true", default=True,
                   help="SwiGLU MLP (default on; --no-swiglu for GELU)")
    g.add_argument("--no-swiglu", action="store_false", dest="swiglu")
    # both options share one dest; argparse takes the first one's default, so state it there
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear", default=False,
                   help="no bias in linear layers (default)")
    g.add_argument("--add-bias-linear", action="store_true", dest="add_bias_linear", default=False)
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the fused q/k/v projection only (Qwen2); other linears follow --add-bias-linear")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="embedding and output rows instead of the tokenizer's vocabulary padded to a multiple of "
                        "--make-vocab-size-divisible-by x TP (MindSpeed-LLM's; at least the vocabulary, divisible "
                        "by TP)")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--num-experts", type=int, default=None, help="MoE experts per layer (None = dense)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", "--moe-intermediate-size", dest="moe_ffn_hidden_size", type=int,
                   default=None, help="each expert's FFN size (--moe-intermediate-size: MindSpeed-LLM 2.1.0's spelling)")
    g.add_argument("--moe-token-dispatcher-type", default="alltoall", choices=["allgather", "alltoall", "alltoall_seq"],
                   help="alltoall_seq (Megatron 0.12's) runs as alltoall, which replaced it in Megatron-Core 0.16")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="MoE: shared experts' total FFN size (Megatron-Core's SharedExpertMLP)")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="MoE: overlap the shared experts with the token dispatch (alltoall dispatcher)")


def _implementation(parser: argparse.ArgumentParser) -> None:
    """Megatron's kernel/implementation switches. The --no-*-fusion flags allow a fusion to be
    off; which fused paths run is decided by MindSpeed's --use-* flags (see model.py)."""
    g = parser.add_argument_group("implementation")
    g.add_argument("--transformer-impl", default="local", choices=["local", "transformer_engine"],
                   help="local: Megatron-Core's own layers (the only one here; Transformer Engine is refused)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "local", "unfused", "flash", "fused"],
                   help="auto/local/unfused: Megatron-Core's DotProductAttention (flash with --use-flash-attn); "
                        "flash: MindSpeed's flash-attention kernel; fused (cuDNN) is refused")
    g.add_argument("--use-mcore-models", action="store_true", dest="deprecated_use_mcore_models",
                   help="deprecated in Megatron: Megatron-Core models are always used")
    g.add_argument("--use-legacy-models", action="store_true", help="refused: only Megatron-Core models exist here")
    g.add_argument("--no-masked-softmax-fusion", action="store_false", dest="masked_softmax_fusion",
                   help="never use the fused scale-mask-softmax kernel (used by default where installed)")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="attention masking and softmax in fp32 for fp16/bf16 models")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="scale Q.K^T by 1/layer-number (fp16 range); forces softmax in fp32")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion",
                   help="the GELU MLP is never fused here (Megatron's fusion is torch.compile'd)")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion",
                   help="contradicts --use-fused-swiglu")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion",
                   help="bias-dropout-add is never fused here")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion",
                   help="contradicts --use-fused-rotary-pos-emb")
    g.add_argument("--no-persist-layer-norm", action="store_true",
                   help="Apex's persistent LayerNorm is never used here")
    # shares its dest with MindSpeed's --gradient-accumulation-fusion feature flag (off by default)
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   default=False, help="undo --gradient-accumulation-fusion (off unless that is given)")


def _muon(g) -> None:
    """Megatron-LM's Muon flags (its names, defaults and choices)."""
    g.add_argument("--muon-momentum", type=float, default=0.9)
    g.add_argument("--muon-no-split-qkv", action="store_false", default=True, dest="muon_split_qkv")
    g.add_argument("--muon-use-nesterov", action="store_true")
    g.add_argument("--muon-scale-mode", default="spectral", choices=["spectral", "unit_rms_norm", "shape_scaling"])
    g.add_argument("--muon-fp32-matmul-prec", default="medium", choices=["low", "medium", "high"])
    g.add_argument("--muon-num-ns-steps", type=int, default=5)
    g.add_argument("--muon-tp-mode", default="blockwise", choices=["blockwise", "duplicated", "distributed"])
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0)


def _training(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch-size * data-parallel size")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT over SAMPLES samples")
    g.add_argument("--train-iters", type=int, default=600)
    g.add_argument("--seed", type=int, default=1234)
    # muon / dist_muon parse as Megatron-LM's do; the support matrix refuses them (megatron_options)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "muon", "dist_muon"])
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-decay-style", default="cosine",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="WSD: iterations of the final decay (default: a tenth of the decay iterations)")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"], help="WSD: shape of the final decay")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    _muon(g)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    # fp16 loss scaling; None = not given (Megatron's defaults are filled in for --fp16)
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=None, help="dynamic loss scale start (2**32)")
    g.add_argument("--min-loss-scale", type=float, default=None, help="dynamic loss scale floor (1.0)")
    g.add_argument("--loss-scale-window", type=float, default=None, help="steps between scale raises (1000)")
    g.add_argument("--hysteresis", type=int, default=None, help="overflows tolerated before lowering (2)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="gradients are always accumulated and reduced in fp32 here")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic algorithms, fixed thread count: bitwise-repeatable runs")
    g.add_argument("--exit-interval", type=int, default=None, help="stop after this many iterations")
    g.add_argument("--exit-duration-in-mins", type=int, default=None,
                   help="save and stop after the step that passes this many minutes since the start")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal (to any rank): finish the step, save the iteration, exit 0")
    g.add_argument("--exit-signal", default="SIGTERM", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"],
                   help="the signal --exit-signal-handler acts on")


def _parallel(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first pipeline stage (the others split the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last pipeline stage (the others split the rest evenly)")
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help="Megatron-Core's layout of every (virtual) pipeline stage, e.g. E|t|tt|tL: E embedding, "
                        "t transformer layer, m MTP layer, L loss, | the next virtual stage")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--variable-seq-lengths", action="store_true",
                   help="pipeline stages exchange tensor shapes before each micro-batch")
    g.add_argument("--distributed-backend", default=None, choices=["gloo", "nccl", "hccl"],
                   help="nccl/hccl (or none): the device's collective library (gloo on cpu, nccl on "
                        "cuda, hccl on npu); gloo: gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=DISTRIBUTED_TIMEOUT_MINUTES,
                   help="how long a rank waits in a collective for the others (fractions allowed: 0.5)")


def _data(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed-dataset prefix(es), optionally weighted: 'w1 p1 w2 p2'. "
                        "Default: the bundled Shakespeare dataset (built on first use)")
    g.add_argument("--split", default="949,50,1")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="default: the tokenizer saved next to the dataset (GPT2BPETokenizer when "
                        "--vocab-file and --merge-file are given)")
    g.add_argument("--tokenizer-model", default=None, help="HF tokenizer name or path (offline)")
    g.add_argument("--tokenizer-name-or-path", default=None,
                   help="MindSpeed-LLM's name for --tokenizer-model (--tokenizer-type PretrainedFromHF is "
                        "HuggingFaceTokenizer)")
    g.add_argument("--tokenizer-not-use-fast", action="store_true",
                   help="MindSpeed-LLM's: no effect in training (token ids are read, no text is encoded)")
    g.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    g.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer: vocabulary size before the end-of-document token")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--mock-data", action="store_true", help="random tokens (no files needed)")
    g.add_argument("--is-instruction-dataset", action="store_true",
                   help="--data-path PREFIX is an instruction dataset (an instruction --handler-name of "
                        "`python -m mindspeed.data`): one sample per conversation, no loss on the prompt")
    g.add_argument("--neat-pack", action="store_true",
                   help="with --is-instruction-dataset --reset-attention-mask: the dataset was written with "
                        "--pack --neat-pack; attention (and with --reset-position-ids, positions) stay inside "
                        "each packed conversation")


def _checkpointing(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration from --load instead of the latest one")
    g.add_argument("--no-load-optim", action="store_true",
                   help="load the weights only: the optimizer starts fresh (the iteration and lr schedule go on)")
    g.add_argument("--no-load-rng", action="store_true",
                   help="keep the RNG as --seed sets it (torch_dist checkpoints hold no RNG state; a --ckpt-format "
                        "torch one's is loaded without this flag)")
    g.add_argument("--finetune", action="store_true", help="load weights only, start at iteration 0")
    g.add_argument("--ckpt-format", default="torch_dist", choices=["torch_dist", "torch"],
                   help="torch_dist: Megatron's sharded checkpoint (loads at any parallel sizes); torch: "
                        "Megatron-LM's legacy per-rank files (loads at the sizes it was saved at); --load "
                        "reads either, whatever this says")


def _logging(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--log-throughput", action="store_true",
                   help="add model TFLOP/s per device to the iteration log line")
    g.add_argument("--log-loss-file", default=None,
                   help="also write every iteration's loss (full precision) as JSON lines here")


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    """Megatron's flags only (no MindSpeed flags; see mindspeed.flags.mindspeed_flags.add_mindspeed_args)."""
    parser = OneLineParser(prog=prog, allow_abbrev=False,
                           description="GPT pretraining on Megatron-Core with MindSpeed")
    for add in (_network, _implementation, _training, _parallel, _data, _checkpointing, _logging, add_family_args):
        add(parser)
    return parser


def _full_parser() -> argparse.ArgumentParser:
    return shared_parser("pretrain_gpt.py", lambda: add_mindspeed_args(build_parser()))


def parse_args(argv: Sequence[str] | None = None, *, world_size: int | None = None) -> argparse.Namespace:
    """Parse argv (sys.argv[1:] when None), derive defaults and validate."""
    parser = _full_parser()
    args, extras = parser.parse_known_args(argv)
    refuse_unknown(parser, extras)
    derive_args(args, world_size)
    validate_args(args)
    return args


def backend_name(args) -> str:
    """--backend / --ai-framework come from MindSpeed's flags (mindspeed.flags.mindspeed_flags)."""
    try:
        return resolve_backend_name(args)
    except ValueError as err:
        raise ArgumentError(str(err)) from err


def derive_args(args, world_size: int | None = None) -> None:
    """Fill values Megatron derives from others (world size from WORLD_SIZE when not given)."""
    args.backend = backend_name(args)
    args.flag_notes = []      # one line each for the trainers' logs: a flag that runs as another here
    args.world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.ffn_hidden_size is None:
        if args.swiglu:   # as Megatron-LM: 2/3 of a 4h GELU MLP, rounded down to 64 (at least 64)
            args.ffn_hidden_size = max(64, int(8 * args.hidden_size / 3 / 64) * 64)
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    derive_family_args(args, args.flag_notes.append)     # after the sizes it derives from (--n-shared-experts)
    if args.kv_channels is None and args.num_attention_heads:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention or args.num_query_groups is None:
        args.num_query_groups = args.num_attention_heads if not args.group_query_attention \
            else (args.num_query_groups or args.num_attention_heads)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size \
        * args.context_parallel_size
    args.data_parallel_size = args.world_size // model_parallel if model_parallel > 0 else 0
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * max(args.data_parallel_size, 1)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_wsd_decay_iters is None and args.lr_decay_style == "WSD":
        args.lr_wsd_decay_iters = max(args.lr_decay_iters // 10, 1)
    if args.lr_warmup_fraction is not None and not args.lr_warmup_iters and 0 <= args.lr_warmup_fraction < 1:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    args.params_dtype = "bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32")
    if args.attention_backend == "flash":     # MindSpeed's flash-attention feature is the flash backend
        args.use_flash_attn = True
    if args.tokenizer_type is None and args.vocab_file and args.merge_file:
        args.tokenizer_type = "GPT2BPETokenizer"   # the one tokenizer that reads both files
    resolve_hf_alias(args)      # PretrainedFromHF --tokenizer-name-or-path: HuggingFaceTokenizer --tokenizer-model
    args.flag_notes.extend(no_effect_notes(args))
    args.load_note = None
    if _nothing_to_resume(args):
        args.load_note = (f"> --load {args.load}: no checkpoint yet in this --save directory; "
                          "starting from iteration 0")
        args.load = None


def _nothing_to_resume(args) -> bool:
    """Megatron's auto-resume idiom, --save X --load X, on its first run: X holds no checkpoint yet.
    (A --load anywhere else must hold one: a mistyped path is refused, not trained from scratch.)"""
    if not args.load or not args.save or args.ckpt_step is not None:
        return False
    same = os.path.realpath(args.load) == os.path.realpath(args.save)
    return same and not os.path.isfile(os.path.join(args.load, CHECKPOINT_TRACKER))


def _positive(args, names) -> list[str]:
    return [f"--{n.replace('_', '-')} must be a positive integer (got {getattr(args, n)})"
            for n in names if getattr(args, n) is None or getattr(args, n) < 1]


def _pipeline_split_problems(args, pp: int) -> list[str]:
    """Even stages, or Megatron's uneven first/last stage with the other stages even."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    if args.num_layer_list or args.pipeline_num_transformer_layers or args.pipeline_model_parallel_layout:
        return []           # each stage's layers given: the uneven-pipeline-layers / unaligned-pipeline features check them
    if first is None and last is None:
        return [] if args.num_layers % pp == 0 else [
            f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}"]
    given = [n for n in (first, last) if n is not None]
    if pp < 2 or min(given) < 1 or args.num_layers_per_virtual_pipeline_stage is not None:
        return ["--decoder-first/last-pipeline-num-layers need pipeline size >= 2, at least one layer, "
                "and no virtual pipeline"]
    rest, middle = args.num_layers - sum(given), pp - len(given)
    if rest < 0 or (middle == 0 and rest) or (middle and (rest < middle or rest % middle)):
        return [f"--num-layers {args.num_layers} minus the first/last stage layers ({sum(given)}) does not "
                f"split evenly into the other {middle} pipeline stage(s)"]
    return []


POSITIVE = ["num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters",
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size", "log_interval", "eval_interval"]


def validate_args(args) -> None:
    """Every check that needs no process group; raise ArgumentError listing all problems."""
    problems = _positive(args, POSITIVE)
    if problems:
        raise ArgumentError("; ".join(problems))
    for check in (_model_parallel_problems, _pipeline_problems, _sequence_problems, _training_problems,
                  _expert_problems, _run_problems, cross_flag_problems, family_problems):
        problems.extend(check(args))
    if problems:
        raise ArgumentError("; ".join(problems))    # one line, every problem


def _model_parallel_problems(args) -> list[str]:
    """The world and the model's sizes split over the tensor/pipeline/context-parallel ranks."""
    problems = []
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ws = args.world_size
    if ws % (tp * pp * cp):
        problems.append(f"world size {ws} is not divisible by tensor ({tp}) x pipeline ({pp}) x "
                        f"context ({cp}) parallel sizes = {tp * pp * cp}")
    if args.hidden_size % args.num_attention_heads:
        problems.append(f"--hidden-size {args.hidden_size} is not divisible by "
                        f"--num-attention-heads {args.num_attention_heads}")
    for flag, count in (("--num-attention-heads", args.num_attention_heads),
                        ("--num-query-groups", args.num_query_groups), ("--ffn-hidden-size", args.ffn_hidden_size)):
        if count % tp:
            problems.append(f"{flag} {count} is not divisible by --tensor-model-parallel-size {tp}")
    return problems


def _pipeline_problems(args) -> list[str]:
    pp = args.pipeline_model_parallel_size
    problems = _pipeline_split_problems(args, pp)
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if pp < 2 or (args.num_layers // pp) % args.num_layers_per_virtual_pipeline_stage:
            problems.append("--num-layers-per-virtual-pipeline-stage needs pipeline size >= 2 and "
                            "must divide the layers of each pipeline stage")
    return problems


def _sequence_problems(args) -> list[str]:
    problems = []
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if args.sequence_parallel and args.seq_length % tp:
        problems.append(f"--seq-length {args.seq_length} is not divisible by "
                        f"--tensor-model-parallel-size {tp} (needed by --sequence-parallel)")
    if args.seq_length % (2 * cp) and cp > 1:
        problems.append(f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size {cp}")
    return problems


def _training_problems(args) -> list[str]:
    """Batch sizes, warmup and precision."""
    problems = []
    if args.data_parallel_size >= 1 and \
            args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        problems.append(f"--global-batch-size {args.global_batch_size} is not divisible by "
                        f"micro-batch-size x data-parallel size = "
                        f"{args.micro_batch_size} x {args.data_parallel_size}")
    if args.lr_warmup_iters and args.lr_warmup_iters >= args.lr_decay_iters:
        problems.append(f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than the decay iterations "
                        f"({args.lr_decay_iters}, from --lr-decay-iters or --train-iters)")
    if args.bf16 and args.fp16:
        problems.append("--bf16 and --fp16 cannot both be set")
    return problems


def _expert_problems(args) -> list[str]:
    if args.num_experts is not None and args.num_experts % args.expert_model_parallel_size:
        return [f"--num-experts {args.num_experts} is not divisible by "
                f"--expert-model-parallel-size {args.expert_model_parallel_size}"]
    if args.num_experts is None and args.expert_model_parallel_size > 1:
        return ["--expert-model-parallel-size > 1 needs --num-experts"]
    return []


def _run_problems(args) -> list[str]:
    """Recompute, checkpoint, optimizer-overlap and warmup options."""
    problems = []
    if args.recompute_method is not None and args.recompute_granularity != "full":
        problems.append("--recompute-method needs --recompute-granularity full")
    if args.load is not None and not os.path.exists(args.load):
        problems.append(f"--load path {args.load!r} does not exist")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        problems.append("--overlap-param-gather needs --use-distributed-optimizer")
    if args.save_interval is not None and args.save_interval < 1:
        problems.append("--save-interval must be positive")
    problems.extend(_warmup_fraction_problems(args))
    if args.ckpt_format == "torch" and args.backend == "mindspore":
        problems.append("--ckpt-format torch (Megatron-LM's per-rank files) is written by --backend torch: the "
                        "MindSpore trainer writes its neutral checkpoint; drop the flag")
    return problems


def _warmup_fraction_problems(args) -> list[str]:
    if args.lr_warmup_fraction is None:
        return []
    if not 0 <= args.lr_warmup_fraction < 1:   # nan fails both
        return [f"--lr-warmup-fraction must be in [0, 1) (got {args.lr_warmup_fraction})"]
    if args.lr_warmup_iters != int(args.lr_warmup_fraction * args.lr_decay_iters):
        return ["--lr-warmup-fraction and --lr-warmup-iters both set the warmup: give only one"]
    return []
