"""The MoE router's settings the MindSpore trainer's layer reads (moe.route, moe.load_balancing_loss):
Megatron-Core's router fields of the same names, from the flags (GPTConfig.from_args)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterSettings:
    score_function: str = "softmax"          # --moe-router-score-function: softmax | sigmoid
    pre_softmax: bool = False                # --moe-router-pre-softmax (MindSpeed-LLM's softmax_topk)
    num_groups: int | None = None            # --moe-router-num-groups: experts in this many equal groups ...
    group_topk: int | None = None            # --moe-router-group-topk: ... of which a token's top-k take this many
    scaling_factor: float | None = None      # --moe-router-topk-scaling-factor: times the top-k weights
    load_balancing: str = "aux_loss"         # aux_loss | seq_aux_loss (--seq-aux) | none
    fp32: bool = False                       # --moe-router-dtype fp32: the gating in fp32 whatever the weights
    expert_bias: bool = False                # --moe-router-enable-expert-bias (noaux_tc): expert_bias.py
    bias_update_rate: float = 1e-3           # --moe-router-bias-update-rate: the bias's step per update

    @classmethod
    def from_args(cls, args) -> "RouterSettings":
        return cls(score_function=args.moe_router_score_function, pre_softmax=bool(args.moe_router_pre_softmax),
                   num_groups=args.moe_router_num_groups, group_topk=args.moe_router_group_topk,
                   scaling_factor=args.moe_router_topk_scaling_factor,
                   load_balancing=args.moe_router_load_balancing_type, fp32=args.moe_router_dtype == "fp32",
                   expert_bias=bool(args.moe_router_enable_expert_bias),
                   bias_update_rate=args.moe_router_bias_update_rate)


SOFTMAX_TOPK = RouterSettings()             # Megatron-Core's default router
