"""The model-family options of MindSpeed-LLM's recipes (flags/family_flags.py) as support-matrix rows:
Megatron-Core's own modules run each on the torch backend; each `unsupported` entry says what the
MindSpore trainer's GPT lacks. Their values are the host parser's; the rows only read them, in the
spelling a user typed (the trainers derive Megatron-Core's values from them after the gate).
"""
from __future__ import annotations

from mindspeed.features.base import FeatureConfigError
from mindspeed.features.host_flags import NUM_EXPERTS, host
from mindspeed.features.megatron_options import MS, TORCH, option, refused_with_context_parallelism

MOE_EXAMPLE = ("--num-experts", "4", "--moe-ffn-hidden-size", "64")


def _lacks(what: str) -> dict:
    return {"mindspore": f"{MS}'s GPT has no {what} (MindSpore's side of the model families is its own work)"}


option("qk-layernorm", (host("--qk-layernorm", False),), lambda a: a.qk_layernorm,
       "per-head RMSNorm/LayerNorm of queries and keys (Qwen3, DeepSeek-V3)", {}, "", ("--qk-layernorm",))
option("yarn-rope", (host("--rope-scaling-type"), host("--rope-type")),
       lambda a: a.rope_scaling_type == "yarn" or a.rope_type == "yarn",
       "YaRN RoPE scaling (Megatron-Core's YarnRotaryEmbedding): frequencies interpolated beyond the original "
       "context, attention scaled by mscale", {}, "",
       ("--rope-scaling-type", "yarn", "--rope-scaling-factor", "4", "--rope-scaling-original-max-position-embeddings",
        "32"))
option("llama3-rope", (host("--rope-scaling-type"),), lambda a: a.rope_scaling_type == "llama3",
       "MindSpeed-LLM's spelling of Llama-3.1's RoPE scaling (--use-rope-scaling)", {}, "",
       ("--rope-scaling-type", "llama3", "--rope-scaling-factor", "8"))
RouterOptions = option(
    "moe-router-options",
    (host("--moe-router-load-balancing-type", "aux_loss"), host("--moe-router-score-function", "softmax"),
     host("--moe-router-enable-expert-bias", False), host("--moe-router-num-groups"),
     host("--moe-router-topk-scaling-factor"), host("--moe-router-pre-softmax", False), host("--moe-router-dtype"),
     host("--seq-aux", False)),
    lambda a: (a.moe_router_load_balancing_type != "aux_loss" or a.moe_router_score_function != "softmax"
               or a.moe_router_enable_expert_bias or a.moe_router_num_groups is not None
               or a.moe_router_topk_scaling_factor is not None or a.moe_router_pre_softmax
               or a.moe_router_dtype is not None or a.seq_aux),
    "Megatron-Core's router options: sigmoid scores, expert bias (aux-loss-free balancing), group-limited top-k, "
    "scaled weights, pre-softmax, sequence/global aux loss, router precision",
    {}, "",
    MOE_EXAMPLE + ("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--norm-topk-prob",
                   "--moe-router-load-balancing-type", "none", "--moe-router-topk-scaling-factor", "2.5"),
    depends=("moe",))
RouterOptions.examples = {"mindspore": MOE_EXAMPLE + ("--moe-router-load-balancing-type", "noaux_tc", "--norm-topk-prob",
                                                      "--seq-aux", "--moe-aux-loss-coeff", "0.01",
                                                      "--moe-router-topk-scaling-factor", "2.5")}


def _router_on_mindspore(self, args) -> None:
    """What the MindSpore trainer's router (training/mindspore/moe.py) does not do, refused in one line."""
    if args.backend != "mindspore" or not self.enabled(args):
        return
    kind = args.moe_router_load_balancing_type
    lacking = [what for what, given in (
        (f"--moe-router-load-balancing-type {kind}", kind in ("global_aux_loss", "sinkhorn")),
        ("--moe-router-dtype fp64", args.moe_router_dtype == "fp64")) if given]
    if lacking:
        raise FeatureConfigError(f"{'; '.join(lacking)}: {MS}'s MoE router has none (its softmax/sigmoid scores, "
                                 "expert bias, groups, scaling, pre-softmax, aux_loss, seq_aux_loss and none run); "
                                 f"drop it, or {TORCH}")
    if (args.moe_router_enable_expert_bias or kind == "noaux_tc") and (args.pipeline_model_parallel_size or 1) > 1:
        raise FeatureConfigError(f"an expert bias (--moe-router-enable-expert-bias, noaux_tc) with "
                                 f"--pipeline-model-parallel-size > 1: {MS}'s pipeline reruns forwards out of "
                                 f"micro-batch order, so its tokens per expert are not counted yet; use PP 1, or {TORCH}")


RouterOptions.validate = _router_on_mindspore
option("moe-layer-layout", (host("--moe-layer-freq", 1), host("--first-k-dense-replace")),
       lambda a: a.moe_layer_freq not in (1, -1) or (a.first_k_dense_replace or 0) > 0,
       "dense and MoE layers mixed (--moe-layer-freq, MindSpeed-LLM's --first-k-dense-replace)", {}, "",
       MOE_EXAMPLE + ("--first-k-dense-replace", "1"), depends=("moe",))
Mtp = option(
    "mtp", (host("--mtp-num-layers"), host("--mtp-loss-scaling-factor", 0.1)), lambda a: bool(a.mtp_num_layers),
    "multi-token prediction (Megatron-Core's MTP block): extra layers predict later tokens; their losses "
    "weighted into training (on MindSpore training/mindspore/mtp.py)", {}, "",
    ("--mtp-num-layers", "1", "--untie-embeddings-and-output-weights"))


def _mtp_on_mindspore(self, args) -> None:
    """What the MindSpore trainer's MTP (training/mindspore/mtp.py: PP, TP and CP 1, no dropout; its
    layer MoE when the decoder's last is, at any EP size) does not do, refused in one line."""
    if args.backend != "mindspore" or not self.enabled(args):
        return
    lacking = [what for what, given in (
        ("--pipeline-model-parallel-size > 1", (args.pipeline_model_parallel_size or 1) > 1),
        ("--tensor-model-parallel-size > 1", (args.tensor_model_parallel_size or 1) > 1),
        ("--context-parallel-size > 1", (args.context_parallel_size or 1) > 1),
        ("--hidden-dropout/--attention-dropout > 0", bool(args.hidden_dropout or args.attention_dropout)),
        # its MTP layers place RoPE and a learned table at the rolled sequence positions, not per document
        ("--reset-position-ids", bool(args.reset_position_ids)))
        if given]
    if lacking:
        raise FeatureConfigError(f"--mtp-num-layers with {', '.join(lacking)}: {MS}'s MTP runs at PP, TP and CP 1, "
                                 f"with dense or MoE layers, no dropout and one position sequence per sample; drop those, or {TORCH}")


Mtp.validate = _mtp_on_mindspore
NoSaveOptim = option(
    "no-save-optim", (host("--no-save-optim", False),), lambda a: a.no_save_optim,
    "checkpoints without optimizer state (resumed with --no-load-optim; a resume that asks for the state is "
    "refused in one line, by either trainer)", {}, "", ("--no-save-optim",))
option("manual-gc", (host("--manual-gc", False), host("--manual-gc-interval", 0)), lambda a: a.manual_gc,
       "Python's garbage collector at fixed steps only (training/manual_gc.py)", {}, "",
       ("--manual-gc", "--manual-gc-interval", "1"))
MoePermuteFusion = option(
    "moe-permute-fusion", (host("--moe-permute-fusion", False),), lambda a: a.moe_permute_fusion,
    "Transformer Engine's fused MoE token permutation", {}, "", MOE_EXAMPLE + ("--moe-permute-fusion",),
    depends=("moe",))
MoePermuteFusion.inert = lambda self, args: (
    "Megatron-Core fuses the permutation with Transformer Engine only, which MindSpeed does not use; the "
    "unfused permutation moves the same tokens (MindSpeed's own: --use-fused-moe-token-permute-and-unpermute)")
# Megatron-Core's TransformerConfig imports Transformer Engine's permutation when the flag is on (Megatron-LM's args)
MoePermuteFusion.inert_host_flags = {"moe_permute_fusion": False}
NoSharedStorage = option(
    "no-shared-storage", (host("--no-shared-storage", False),), lambda a: a.no_shared_storage,
    "MindSpeed-LLM's switch for nodes without a shared filesystem", {}, "", ("--no-shared-storage",))
NoSharedStorage.inert = lambda self, args: (
    "each rank writes its own checkpoint shards and one node reads them back; across nodes, save to a shared "
    "filesystem")
MtpMemEfficientLogits = option(
    "mtp-mem-efficient-logits", (host("--mtp-mem-efficient-logits", False),), lambda a: a.mtp_mem_efficient_logits,
    "MindSpeed-LLM's memory saver for the MTP logits", {}, "",
    ("--mtp-num-layers", "1", "--untie-embeddings-and-output-weights", "--mtp-mem-efficient-logits"))
MtpMemEfficientLogits.inert = lambda self, args: (
    "Megatron-Core's MTP computes each MTP layer's logits and loss in turn, freeing the last before the next")

option("expert-tensor-parallel", (host("--expert-tensor-parallel-size"), NUM_EXPERTS,
                                  host("--tensor-model-parallel-size", 1)),
       # Megatron's default (None, or Megatron-LM's 1 at TP 1) is the attention's TP: only another size is the option
       lambda a: bool(a.num_experts) and a.expert_tensor_parallel_size not in (None, a.tensor_model_parallel_size or 1),
       "a tensor-parallel size inside the experts other than the attention's (Megatron-Core's expert TP)",
       _lacks("expert tensor-parallel size of its own (--moe-tp-extend-ep spreads whole experts)"), TORCH,
       # Megatron-Core: MoE at TP > 1 needs sequence parallelism
       MOE_EXAMPLE + ("--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"),
       example_world=2)
MultiLatentAttention = option(
    "multi-latent-attention", (host("--multi-latent-attention", False),), lambda a: a.multi_latent_attention,
    "DeepSeek's multi-latent attention (Megatron-Core's MLA; without Transformer Engine through "
    "backends/torch/mla_standin.py; on MindSpore training/mindspore/mla.py)", {}, "",
    ("--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
     "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"))


_mla_with_cp = refused_with_context_parallelism(
    "--multi-latent-attention with --context-parallel-size > 1: MindSpeed's context-parallel attention takes one "
    "head size for q, k and v, and MLA's v has its own; drop --context-parallel-size (or MLA)")
MLA_TP_ON_MINDSPORE = (f"--multi-latent-attention with --tensor-model-parallel-size > 1 on {MS}: its MLA splits "
                       f"no heads over TP yet (training/mindspore/mla.py runs TP 1); use TP 1, or {TORCH}")


def _mla_where_it_runs(self, args) -> None:
    """CP > 1 on either trainer; TP > 1 on the MindSpore trainer's MLA."""
    _mla_with_cp(self, args)
    if args.backend == "mindspore" and self.enabled(args) and (args.tensor_model_parallel_size or 1) > 1:
        raise FeatureConfigError(MLA_TP_ON_MINDSPORE)


MultiLatentAttention.validate = _mla_where_it_runs
