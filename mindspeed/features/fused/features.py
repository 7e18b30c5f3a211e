"""The fused-kernel features (optimization level 1), one per flag. Framework-free: each
feature's Megatron-Core hook lives in its own module, imported only when the feature is applied
on the torch backend (the mindspore backend's native trainer reads the same flags itself)."""
from __future__ import annotations

from mindspeed.backends.base import Cap
from mindspeed.features.base import Feature, FeatureConfigError, Flag, switch
from mindspeed.features.registry import register

SPARSE_MODES = (0, 1, 2, 3, 4)   # as flash_attention.band_arguments


class _FusedFeature(Feature):
    category = "fused"
    optimization_level = 1

    @property
    def example(self) -> tuple:
        return (self.flags[0].name,) + self.companions
    companions: tuple = ()     # flags the feature needs beside its own (e.g. an MoE model)

    def apply(self, ctx, args) -> None:
        if ctx.backend_name == "torch":
            self.megatron_hook().install(ctx, args)

    @staticmethod
    def megatron_hook():
        """The module whose install(ctx, args) routes Megatron-Core to the kernel; imported only
        here, on the torch backend (it imports Megatron-Core and torch)."""
        raise NotImplementedError


@register
class FusedRmsNorm(_FusedFeature):
    id = "fused-rmsnorm"
    description = "RMSNorm through the fused rms_norm kernel (npu_rms_norm; fused C++ on cpu)"
    flags = (switch("--use-fused-rmsnorm", "use the fused RMSNorm kernel"),)
    requires = (Cap.RMS_NORM,)
    kernels = ("rms_norm",)

    @staticmethod
    def megatron_hook():
        from mindspeed.features.fused import rms_norm
        return rms_norm


@register
class FusedSwiglu(_FusedFeature):
    id = "fused-swiglu"
    description = "SwiGLU activation through the fused swiglu kernel (npu_swiglu; fused C++ on cpu)"
    flags = (switch("--use-fused-swiglu", "use the fused SwiGLU kernel"),)
    requires = (Cap.SWIGLU,)
    kernels = ("swiglu",)

    @staticmethod
    def megatron_hook():
        from mindspeed.features.fused import swiglu
        return swiglu


@register
class FusedRotaryPosEmb(_FusedFeature):
    id = "fused-rotary-pos-emb"
    description = "rotary position embedding through the fused rope kernel (npu_rotary_position_embedding)"
    flags = (switch("--use-fused-rotary-pos-emb", "use the fused rotary position embedding kernel"),)
    requires = (Cap.ROPE,)
    kernels = ("rope",)
    inert_example = ("--use-fused-rotary-pos-emb", "--multi-latent-attention", "--q-lora-rank", "32",
                     "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16")

    def inert(self, args) -> str:
        if args.multi_latent_attention:
            return ("every attention layer is multi-latent attention, whose decoupled RoPE (one rotated key "
                    "part shared by all heads) runs Megatron-Core's own rotation")
        return ""

    @staticmethod
    def megatron_hook():
        from mindspeed.features.fused import rotary_pos_emb
        return rotary_pos_emb


@register
class FlashAttention(_FusedFeature):
    id = "flash-attn"
    description = ("attention through the fused attention kernel (npu_fusion_attention; on cpu block-causal "
                   "GEMMs for causal self-attention up to 1024 tokens, torch's CPU flash kernel otherwise): "
                   "sparse modes, band, general masks, GQA")
    flags = (
        switch("--use-flash-attn", "use the fused flash-attention kernel"),
        Flag("--sparse-mode", dict(type=int, default=0,
                                   help="0 layer mask, 1 given mask only, 2 causal, 3 bottom-right causal, 4 band")),
        Flag("--pre-tockens", dict(type=int, default=65536, help="band (sparse mode 4): keys before the query")),
        Flag("--next-tockens", dict(type=int, default=0, help="band (sparse mode 4): keys after the query")),
    )
    requires = (Cap.FLASH_ATTENTION,)
    kernels = ("attention",)

    @staticmethod
    def megatron_hook():
        from mindspeed.features.fused import flash_attention
        return flash_attention

    def validate(self, args) -> None:
        mode = args.sparse_mode
        if mode not in SPARSE_MODES:
            raise FeatureConfigError(f"--sparse-mode {mode} is not supported; choose one of "
                                     f"{', '.join(map(str, SPARSE_MODES))}")
        pre, nxt = args.pre_tockens, args.next_tockens
        if mode == 4 and pre + nxt < 0:
            raise FeatureConfigError(f"--pre-tockens {pre} and --next-tockens {nxt} leave an empty band "
                                     "(need pre + next >= 0)")


@register
class FusedRingAttentionUpdate(_FusedFeature):
    id = "fused-ring-attention-update"
    description = "ring attention's online-softmax merge through the fused ring_attention_update kernel"
    flags = (switch("--use-fused-ring-attention-update", "use the fused ring-attention update kernel"),)
    requires = (Cap.RING_ATTENTION_UPDATE,)
    kernels = ("ring_attention_update",)

    def apply(self, ctx, args) -> None:
        """Nothing to patch: the context-parallel feature builds its ring with the fused merge when
        the session applies this feature (ApplyContext.applies, Session.applied)."""


@register
class GradientAccumulationFusion(_FusedFeature):
    id = "gradient-accumulation-fusion"
    description = "weight gradients added into fp32 main_grad by the fused matmul_add_fp32 kernel"
    flags = (Flag("--gradient-accumulation-fusion", dict(action="store_true", default=False,
                                                         help="fuse the wgrad GEMM with main_grad accumulation"),
                  megatron=True),)
    requires = (Cap.MATMUL_ADD_FP32,)
    kernels = ("matmul_add_fp32",)
    # torch: Megatron-Core's linears' main_grad; mindspore: the trainer's decoder linears (main_grad.py)
    alternatives = "leave it off: weight gradients are then accumulated by Megatron's DDP (or the MindSpore trainer)"

    @staticmethod
    def megatron_hook():
        from mindspeed.features.fused import gradient_accumulation_fusion
        return gradient_accumulation_fusion

    def validate(self, args) -> None:
        if args.backend == "mindspore" and args.use_ascend_coc:
            raise FeatureConfigError("--gradient-accumulation-fusion on the MindSpore trainer fuses its own linears' "
                                     "weight gradients, not --use-ascend-coc's: drop one of them")


@register
class MoeGroupedGemm(_FusedFeature):
    id = "moe-grouped-gemm"
    description = "MoE experts as one grouped GEMM through the gmm kernel (npu_gmm)"
    flags = (Flag("--moe-grouped-gemm", dict(action="store_true", default=False,
                                             help="run MoE experts with grouped GEMM"), megatron=True),
             switch("--gemm-gradient-accumulation-fusion",
                    "with --moe-grouped-gemm: add expert weight gradients straight into main_grad"))
    requires = (Cap.GMM, Cap.MOE)
    kernels = ("gmm",)
    alternatives = "leave it off: experts then run as separate MLPs"
    companions = ("--num-experts", "4", "--bf16")
    # the MindSpore trainer's grouped experts (training/mindspore/moe.py) run in its own precision
    examples = {"mindspore": ("--moe-grouped-gemm", "--num-experts", "4")}

    @staticmethod
    def megatron_hook():
        from mindspeed.features.fused import grouped_gemm
        return grouped_gemm

    def validate(self, args) -> None:
        # num_experts is the host's (Megatron's) flag: checked when the host's args are given
        if hasattr(args, "num_experts") and not args.num_experts:
            raise FeatureConfigError("--moe-grouped-gemm needs an MoE model (--num-experts)")
        # --gemm-gradient-accumulation-fusion: on MindSpore the trainer's grouped experts' fp32 main
        # grads (training/mindspore/main_grad.py)
        on_mindspore = args.backend == "mindspore"
        # Megatron-Core's GroupedMLP asserts it
        if not on_mindspore and hasattr(args, "bf16") and not args.bf16:
            raise FeatureConfigError("--moe-grouped-gemm needs --bf16 (Megatron-Core's GroupedMLP runs in bf16 only)")


@register
class FusedMoeTokenPermute(_FusedFeature):
    id = "fused-moe-token-permute-and-unpermute"
    description = "MoE token permute/unpermute through the fused moe_permute/moe_unpermute kernels"
    flags = (switch("--use-fused-moe-token-permute-and-unpermute", "use the fused MoE token permutation kernels"),)
    requires = (Cap.MOE_PERMUTE, Cap.MOE)
    kernels = ("moe_permute", "moe_unpermute")
    alternatives = "leave it off: Megatron's own permutation runs"
    companions = ("--num-experts", "4")

    @staticmethod
    def megatron_hook():
        from mindspeed.features.fused import moe_token_permute
        return moe_token_permute
