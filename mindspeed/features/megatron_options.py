"""Megatron's model and training options that some backend's trainer cannot run, as support-matrix
rows, so that the matrix is the one gate: `python -m mindspeed check`, `mindspeed.adapt` and each
trainer refuse them in the same line, before any work.

These flags belong to the host's parser (the built-in trainers' Megatron-style parser, or
Megatron-LM's own); MindSpeed only reads their values. On the torch backend Megatron-Core runs
every one of them; each `unsupported` entry says why another backend cannot, and what to use.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError
from mindspeed.features.context_parallel.feature import MASK_TYPE
from mindspeed.features.fused.features import FlashAttention
from mindspeed.features.host_flags import BF16, NUM_EXPERTS, host, until_given
from mindspeed.features.registry import all_features, register
from mindspeed.megatron_defaults import DISTRIBUTED_TIMEOUT_MINUTES

MS = "the MindSpore trainer"
TORCH = "use --backend torch"


class MegatronOption(Feature):
    """A Megatron option, on when `is_on(args)` says so (the host's defaults count as off)."""
    category = "option"
    optimization_level = 0
    is_on: Callable = staticmethod(lambda args: False)

    def enabled(self, args) -> bool:
        try:
            # a flag absent from the namespace (--num-experts, --bf16 until the host's args are given:
            # flags/mindspeed_flags) reads as its default, so that one flag of several still turns it on
            return bool(self.is_on(SimpleNamespace(**{**{fl.dest: fl.default for fl in self.flags}, **vars(args)})))
        except AttributeError:     # the host's parser has no such flag (e.g. a user's own script)
            return False


def option(option_id: str, flags: tuple, is_on: Callable, description: str, unsupported: dict,
           alternatives: str, example: tuple, example_world: int = 1, depends: tuple = (),
           emulated: dict | None = None, requires: tuple = ()) -> type:
    cls = type(option_id.title().replace("-", ""), (MegatronOption,), dict(
        id=option_id, flags=flags, is_on=staticmethod(is_on), description=description,
        unsupported=unsupported, alternatives=alternatives, example=example,
        example_world=example_world, depends=depends, emulated=emulated or {}, requires=requires))
    return register(cls)


option("fp16", (host("--fp16", False), host("--loss-scale"), host("--initial-loss-scale"), host("--min-loss-scale"),
                host("--loss-scale-window"), host("--hysteresis")),
       lambda a: a.fp16, "fp16 training with fp32 master weights and (dynamic) loss scaling", {}, "",
       ("--fp16", "--initial-loss-scale", "65536"))
Bf16 = option("bf16", (BF16,), lambda a: a.bf16, "bf16 training with fp32 master weights",
              {}, "", ("--bf16",))
Bf16.requires = (Cap.BF16_COMPUTE,)     # MindSpore/CPU: bf16 storage, ops without a bf16 kernel in fp32
option("sgd-optimizer", (host("--optimizer", "adam"), host("--sgd-momentum", 0.9)), lambda a: a.optimizer == "sgd",
       "Megatron's SGD optimizer (momentum, L2 weight decay) instead of Adam", {}, "",
       ("--optimizer", "sgd"))
# Megatron-Core 0.16.1's Muon (megatron/core/optimizer/muon.py) is built on the emerging-optimizers
# package, whose one release (0.3.0) requires Python >= 3.12: this project pins Python 3.11
MUON_NEEDS = ("Megatron-Core's Muon needs the emerging-optimizers package, whose one release (0.3.0) requires "
              "Python >= 3.12 (this install pins 3.11)")
option("muon-optimizer", (host("--optimizer", "adam"), host("--muon-momentum", 0.9),
                          host("--muon-no-split-qkv", True, dest="muon_split_qkv"), host("--muon-use-nesterov", False),
                          host("--muon-scale-mode", "spectral"), host("--muon-fp32-matmul-prec", "medium"),
                          host("--muon-num-ns-steps", 5), host("--muon-tp-mode", "blockwise"),
                          host("--muon-extra-scale-factor", 1.0)),
       lambda a: "muon" in a.optimizer,
       "Muon (dist_muon: layer-wise distributed): Newton-Schulz orthogonalised momentum for 2-D weight "
       "matrices, Adam for embeddings, output layer, norms and biases",
       {"torch": MUON_NEEDS, "mindspore": f"{MS} has no Muon optimizer"}, "--optimizer adam or sgd",
       ("--optimizer", "muon"))
option("selective-recompute", (host("--recompute-granularity"),),
       lambda a: a.recompute_granularity == "selective",
       "recompute only the attention core in backward", {}, "",
       ("--recompute-granularity", "selective"))
option("recompute-layer-groups", (host("--recompute-method"), host("--recompute-num-layers")),
       lambda a: a.recompute_granularity == "full"
       and (a.recompute_method == "block" or (a.recompute_num_layers or 1) != 1),
       "full recompute of groups of layers (uniform N > 1) or of the first N layers (block)", {}, "",
       ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"))
Moe = option("moe", (NUM_EXPERTS,), lambda a: bool(a.num_experts), "Megatron-Core mixture of experts",
             {}, "", ("--num-experts", "4", "--moe-aux-loss-coeff", "0.01"))
option("qkv-bias", (host("--add-qkv-bias", False),), lambda a: a.add_qkv_bias,
       "biases on the fused q/k/v projection (Qwen2)", {}, "", ("--add-qkv-bias",))
option("rope-scaling", (host("--use-rope-scaling", False), host("--rope-scaling-factor")),
       lambda a: a.use_rope_scaling, "Llama 3.1 RoPE frequency scaling", {}, "", ("--use-rope-scaling",))
UnevenPipelineStages = option("uneven-pipeline-stages", (host("--decoder-first-pipeline-num-layers"),
                                  host("--decoder-last-pipeline-num-layers")),
       lambda a: a.decoder_first_pipeline_num_layers is not None or a.decoder_last_pipeline_num_layers is not None,
       "a different number of layers on the first/last pipeline stage", {}, "",
       ("--num-layers", "3", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
        "--untie-embeddings-and-output-weights"),
       example_world=2)
UnevenPipelineStages.requires = (Cap.SEND_RECV, Cap.PIPELINE_PARALLEL)     # the stages exchange activations
option("layernorm", (host("--normalization", "RMSNorm"),), lambda a: a.normalization != "RMSNorm",
       "LayerNorm instead of RMSNorm", {}, "", ("--normalization", "LayerNorm"))
option("gelu-mlp", (host("--no-swiglu", True, dest="swiglu"),), lambda a: not a.swiglu,
       "GELU MLP instead of SwiGLU", {}, "", ("--no-swiglu",))
Dropout = option("dropout", (host("--hidden-dropout", 0.0), host("--attention-dropout", 0.0)),
       lambda a: bool(a.hidden_dropout or a.attention_dropout), "dropout in attention and after layers",
       {}, "", ("--hidden-dropout", "0.1", "--attention-dropout", "0.1"))
option("learned-position-embedding", (host("--position-embedding-type", "rope"),),
       lambda a: a.position_embedding_type not in ("rope", "alibi"), "learned absolute (or no) position embeddings", {}, "",
       ("--position-embedding-type", "learned_absolute"))
option("batch-size-rampup", (host("--rampup-batch-size"),), lambda a: bool(a.rampup_batch_size),
       "global batch size ramp-up", {}, "", ("--rampup-batch-size", "2", "2", "8", "--global-batch-size", "4"))
option("data-blend", (host("--data-path"),), lambda a: len(a.data_path or []) > 1,
       "a weighted blend of several datasets", {}, "", ("--data-path", "1", "DATA", "1", "DATA", "--split", "90,5,5"))
EodReset = option("eod-reset", (host("--reset-position-ids", False), host("--reset-attention-mask", False)),
       lambda a: a.reset_position_ids or a.reset_attention_mask,
       "packed documents: positions and attention restart after each end-of-document token (flash "
       "attention and CP: per-document lengths, TND, no [s, s] mask; MindSpore: a dense [s, s] mask)",
       {}, "", ("--reset-position-ids", "--reset-attention-mask"))
option("eod-mask-loss", (host("--eod-mask-loss", False),), lambda a: a.eod_mask_loss,
       "no loss on end-of-document tokens", {}, "", ("--eod-mask-loss",))


def _documents_as_general_mask(feature, args) -> bool:
    """--reset-attention-mask under CP with --attention-mask-type general: the documents' dense mask is
    the batch's own mask, which the context-parallel attention takes over the whole sequence."""
    return (feature.id == "eod-reset" and args.attention_mask_type == "general" and not args.reset_position_ids
            and (args.pipeline_model_parallel_size or 1) == 1)


def _mindspore_whole_sequence_only(what: str):
    """validate: on the MindSpore trainer, `what` runs without context parallelism only, and without
    pipeline parallelism unless every stage can build it from its micro-batch (the documents' mask)."""
    def validate(self, args) -> None:
        if args.backend != "mindspore" or not self.enabled(args):
            return
        if self.id == "eod-reset" and args.neat_pack:
            raise FeatureConfigError(f"--neat-pack: {MS} separates documents by end-of-document tokens only "
                                     f"(not by neat-packed sample numbers); preprocess without --neat-pack, or {TORCH}")
        if (args.context_parallel_size or 1) > 1 and not _documents_as_general_mask(self, args):
            general = (" (--reset-attention-mask alone goes through it with --attention-mask-type general)"
                       if self.id == "eod-reset" else "")
            raise FeatureConfigError(f"{self.trigger(args)} with --context-parallel-size > 1: {MS}'s "
                                     f"context-parallel attention takes no {what}{general}; drop one, or {TORCH}")
        # packed documents: every stage builds its document mask and positions from the micro-batch it has
        if (args.pipeline_model_parallel_size or 1) > 1 and self.id != "eod-reset":
            raise FeatureConfigError(f"{self.trigger(args)} with --pipeline-model-parallel-size > 1: {MS}'s "
                                     f"pipeline stages exchange no {what}; drop one, or {TORCH}")
    return validate


Dropout.validate = _mindspore_whole_sequence_only("dropout masks")
EodReset.validate = _mindspore_whole_sequence_only("document mask or positions")
option("overlap-grad-reduce", (host("--overlap-grad-reduce", False),), lambda a: a.overlap_grad_reduce,
       "gradient all-reduce in buckets, overlapped with the backward pass",
       {}, "", ("--overlap-grad-reduce",), example_world=2,
       emulated={"mindspore": f"{MS} reduces the same gradients over the same groups once the backward pass "
                                  "ends (one flat buffer: each element's sum is the buckets' sum), not overlapped: "
                                  "MindSpore 2.10's grad function returns every gradient at once, with no per-"
                                  "parameter hook to start a bucket's reduction early"})
option("overlap-param-gather", (host("--overlap-param-gather", False),), lambda a: a.overlap_param_gather,
       "distributed optimizer's parameter all-gather overlapped with the forward pass",
       {}, "", ("--use-distributed-optimizer", "--overlap-param-gather"), example_world=2,
       emulated={"mindspore": f"{MS}'s distributed optimizer all-gathers the same updated parameters right "
                                  "after the update, not overlapped with the next forward (its forward is one "
                                  "traced call: no per-layer point to wait for a bucket's gather)"})
option("wsd-lr-schedule", (host("--lr-decay-style", "cosine"), host("--lr-wsd-decay-iters"),
                            host("--lr-wsd-decay-style", "exponential")), lambda a: a.lr_decay_style == "WSD",
       "warmup-stable-decay learning-rate schedule", {}, "",
       ("--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2", "--lr-wsd-decay-style", "cosine"))
option("gloo-distributed-backend", (host("--distributed-backend"),), lambda a: a.distributed_backend == "gloo",
       "the host's CPU collective library (torch.distributed's gloo) instead of the device's",
       {"mindspore/ascend": f"{MS} starts HCCL on Ascend and has no path that runs its collectives through "
                            "the host's library (MCCL) for device tensors"},
       "drop --distributed-backend (HCCL)", ("--distributed-backend", "gloo"),
       emulated={"mindspore/cpu": "MindSpore's CPU collectives (MCCL, shared memory within a host) play gloo's "
                                  "part: the host's collective library, which this trainer uses on CPU anyway"})
option("distributed-timeout", (host("--distributed-timeout-minutes", DISTRIBUTED_TIMEOUT_MINUTES),),
       lambda a: a.distributed_timeout_minutes != DISTRIBUTED_TIMEOUT_MINUTES,
       f"a collective timeout other than {DISTRIBUTED_TIMEOUT_MINUTES} minutes (on MindSpore/CPU: its shared-memory collectives' wait; "
       "MINDSPEED_MS_SHM_TIMEOUT, in seconds, overrides it)",
       {"mindspore/ascend": f"{MS} does not pass it to HCCL, which takes its timeout from HCCL_EXEC_TIMEOUT "
                            "when MindSpore 2.10's communication init runs, before the trainer reads its flags"},
       "set HCCL_EXEC_TIMEOUT (seconds) in the environment", ("--distributed-timeout-minutes", "20"))
option("data-cache-path", (host("--data-cache-path"),), lambda a: a.data_cache_path is not None,
       "where the dataset's sample index files are written and read back by the next run (on MindSpore: "
       "each split's per-epoch shuffle order)", {}, "", ("--data-cache-path", "CACHE"))
option("tokenizer-model", (host("--tokenizer-model"),), lambda a: a.tokenizer_model is not None,
       "a Hugging Face / SentencePiece tokenizer model file", {}, "",
       ("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "TOKENIZER"))
GeneralMask = option(
    "general-attention-mask", (MASK_TYPE,), lambda a: a.attention_mask_type == "general",
    "context-parallel attention with the batch's own mask (not the implicit causal one)", {}, "",
    ("--attention-mask-type", "general", "--context-parallel-size", "2",
     "--context-parallel-algo", "megatron_cp_algo"), example_world=2)


def _general_mask_without_cp(self, args) -> str:
    if (args.context_parallel_size or 1) == 1:
        return "at --context-parallel-size 1 there is no context-parallel attention (Megatron's own mask is used)"
    return ""


GeneralMask.inert = _general_mask_without_cp
# packed documents take the dense mask under "general" (Session.packed_documents): a run at CP 1
# must not, as without the flag
GeneralMask.inert_host_flags = {MASK_TYPE.dest: MASK_TYPE.default}
GeneralMask.inert_example = ("--attention-mask-type", "general")
FlashAttnBand = option(
    "flash-attn-band", FlashAttention.flags[1:],
    lambda a: (a.sparse_mode, a.pre_tockens, a.next_tockens) != (0, 65536, 0),
    "flash attention's sparse modes and band (--sparse-mode, --pre-tockens, --next-tockens)", {}, "",
    ("--use-flash-attn", "--sparse-mode", "4", "--pre-tockens", "8"), depends=("flash-attn",))
FlashAttnBand.requires = FlashAttention.requires     # the band is the flash kernel's: its level


def refused_with_context_parallelism(why: str):
    """A row's validate(): refuse the option at --context-parallel-size > 1, saying `why`."""
    def validate(self, args) -> None:
        if (args.context_parallel_size or 1) > 1:
            raise FeatureConfigError(why)
    return validate


# the context-parallel attention of either trainer takes the causal mask or the batch's own one;
# flash attention defers to it under CP, so a band would be dropped without a word
FlashAttnBand.validate = refused_with_context_parallelism(
    "--sparse-mode/--pre-tockens/--next-tockens with context parallelism: the context-parallel attention is "
    "causal only (or --attention-mask-type general's batch mask), never a band; drop the band flags, or "
    "--context-parallel-size 1")
VariableSeqLengths = option("variable-seq-lengths", (host("--variable-seq-lengths", False),), lambda a: a.variable_seq_lengths,
       "pipeline stages exchange tensor shapes first; instruction micro-batches as long as their longest sample",
       {}, "",
       ("--variable-seq-lengths", "--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"),
       example_world=2)
VariableSeqLengths.requires = (Cap.SEND_RECV,)     # the stages exchange shapes, then activations
option("moe-shared-experts", (host("--moe-shared-expert-intermediate-size"),),
       lambda a: bool(a.moe_shared_expert_intermediate_size),
       "MoE shared experts beside the routed ones (Megatron-Core's SharedExpertMLP)", {}, "",
       ("--num-experts", "4", "--moe-shared-expert-intermediate-size", "128"), depends=("moe",))
option("moe-shared-expert-overlap", (host("--moe-shared-expert-overlap", False),), lambda a: a.moe_shared_expert_overlap,
       "MoE shared experts computed while the tokens are dispatched (on MindSpore's CPU collectives: "
       "before the dispatch, in that order, without overlap)", {},
       "drop --moe-shared-expert-overlap (the shared experts still run)",
       ("--num-experts", "4", "--moe-shared-expert-intermediate-size", "128", "--moe-shared-expert-overlap"),
       depends=("moe-shared-experts",), requires=(Cap.ASYNC_COMM,))


def _another_refused_on_mindspore(moe, args) -> bool:
    return any(f is not moe and ("mindspore" not in f.backends or f.unsupported.get("mindspore"))
               and f.enabled(args) for f in all_features())


def _moe_on_mindspore(self, args) -> None:
    """What the MindSpore trainer's MoE layer (training/mindspore/moe.py) does not do, refused in one line."""
    if args.backend != "mindspore" or not until_given(args, NUM_EXPERTS):
        return
    if _another_refused_on_mindspore(self, args):     # the matrix refuses the run, naming that feature
        return
    tp, cp, pp = (args.tensor_model_parallel_size or 1, args.context_parallel_size or 1,
                  args.pipeline_model_parallel_size or 1)
    extend = bool(args.moe_tp_extend_ep)      # whole experts over TP x EP (moe-tp-extend-ep)
    ep = args.expert_model_parallel_size or 1
    sharded = tp > 1 and not extend     # every expert split over TP (Megatron-Core's expert TP = TP)
    limits = [(cp > 1, "runs at context parallel size 1"),
              (sharded and not args.sequence_parallel,
               "needs --sequence-parallel at tensor parallel size > 1 (as Megatron-Core's MoE layer in training)"),
              (sharded and (ep > 1 or pp > 1),
               "splits every expert over the tensor-parallel ranks at --expert-model-parallel-size 1 and "
               "--pipeline-model-parallel-size 1 only: drop those, or add --moe-tp-extend-ep (whole experts "
               "over the TP x EP ranks)"),
              (sharded and bool(args.moe_shared_expert_intermediate_size or args.moe_token_dispatcher_type == "allgather"),
               "splits experts over TP with the alltoall dispatcher and no shared experts: drop "
               "--moe-shared-expert-intermediate-size and --moe-token-dispatcher-type allgather, or add "
               "--moe-tp-extend-ep"),
              (pp > 1 and (ep > 1 or extend),
               "splits no experts over the ranks of a pipeline stage: at --pipeline-model-parallel-size > 1 "
               "use --expert-model-parallel-size 1 (each stage holds its layers' experts whole)"),
              (extend and bool(args.moe_shared_expert_intermediate_size),
               "splits no shared experts over the tensor-parallel ranks: drop "
               "--moe-shared-expert-intermediate-size with --moe-tp-extend-ep"),
              (args.moe_token_dispatcher_type == "allgather"
               and (args.moe_permutation_async_comm or args.use_fused_moe_token_permute_and_unpermute),
               "permutes the allgather dispatcher's tokens on the host, synchronously: drop "
               "--moe-permutation-async-comm and --use-fused-moe-token-permute-and-unpermute, or use "
               "--moe-token-dispatcher-type alltoall"),
              (bool(args.add_bias_linear), "has no linear biases: drop --add-bias-linear"),
              (bool(args.recompute_activation_function),
               "does not recompute the experts' activation: drop --recompute-activation-function")]
    problems = [why for hit, why in limits if hit]
    if problems:
        raise FeatureConfigError(f"--num-experts on {MS}: its MoE layer " + "; ".join(problems)
                                 + f" (or {TORCH})")


Moe.validate = _moe_on_mindspore
