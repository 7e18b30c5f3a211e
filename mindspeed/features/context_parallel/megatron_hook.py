"""Torch-backend hook: route Megatron-Core's local core attention to the CP logic.

Megatron-Core 0.16's DotProductAttention refuses context_parallel_size > 1 (only TE's attention
does CP). With CP on, its __init__ is built with a CP-free copy of the config and its forward
calls context_parallel_attention; with CP off both behave exactly as before. RoPE's per-rank
slice follows sharding.local_positions (Megatron's own assumes the 2P-chunk ring layout), and
the hybrid subgroups are created right after initialize_model_parallel, when every rank is there.
"""
from __future__ import annotations

import copy

from mindspeed.features import documents
from mindspeed.features.context_parallel import sharding
from mindspeed.features.context_parallel.attention import context_parallel_attention
from mindspeed.features.context_parallel.groups import build_cp_groups

DPA = "megatron.core.transformer.dot_product_attention.DotProductAttention"
_groups = {}      # id(Megatron CP group) -> CPGroups


class CPOptions:
    def __init__(self, args, fused_merge: bool = False):
        self.fused_merge = fused_merge      # --use-fused-ring-attention-update, as applied
        self.algo = args.context_parallel_algo
        self.ulysses_degree = getattr(args, "ulysses_degree_in_cp", None)
        self.window_size = getattr(args, "cp_window_size", 1) or 1
        self.overlap = bool(getattr(args, "use_cp_send_recv_overlap", False))
        self.mask_type = getattr(args, "attention_mask_type", "causal") or "causal"


def _all_cp_ranks(parallel_state):
    """Every CP group's global ranks (hybrid creates subgroups of each, on every rank)."""
    import torch
    import torch.distributed as dist
    mine = torch.tensor(parallel_state.get_context_parallel_global_ranks(), dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return sorted({tuple(t.tolist()) for t in gathered})


def cp_groups(options: CPOptions):
    from megatron.core import parallel_state
    group = parallel_state.get_context_parallel_group()
    if id(group) not in _groups:
        all_ranks = _all_cp_ranks(parallel_state) if options.algo == "hybrid_cp_algo" else None
        _groups.clear()
        _groups[id(group)] = build_cp_groups(options.algo, group=group, all_cp_ranks=all_ranks,
                                             ulysses_degree=options.ulysses_degree,
                                             window_size=options.window_size, overlap=options.overlap,
                                             fused_merge=options.fused_merge)
    return _groups[id(group)]


def install(patcher, options: CPOptions) -> None:
    from megatron.core import parallel_state

    def wrap_init(original):
        def __init__(self, config, *args, **kwargs):
            if config.context_parallel_size == 1:
                return original(self, config, *args, **kwargs)
            cp_free = copy.copy(config)
            cp_free.context_parallel_size = 1
            original(self, cp_free, *args, **kwargs)
            self.config = config
        return __init__

    def wrap_forward(original):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if self.config.context_parallel_size == 1:
                if documents.carries_ends(attention_mask):   # Megatron's attention would take it for a mask
                    raise NotImplementedError("--reset-attention-mask at context-parallel size 1 takes the "
                                              "documents through --use-flash-attn; add it")
                return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                                packed_seq_params)
            if packed_seq_params is not None or attention_bias is not None:
                raise NotImplementedError("context parallelism: packed sequences and attention bias are "
                                          "not supported by MindSpeed's CP attention")
            from megatron.core.transformer.enums import AttnMaskType
            general = options.mask_type == "general"
            causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
            if general and attention_mask is None:
                raise ValueError("--attention-mask-type general needs an attention mask in the batch")
            s, b, heads, head_dim = query.shape
            sk, _, kv_heads, _ = key.shape
            scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
            docs = None if general else documents.ends_in(attention_mask)    # EOD reset: the micro-batch's documents
            out = context_parallel_attention(
                query.reshape(s, b, heads * head_dim), key.reshape(sk, b, kv_heads * head_dim),
                value.reshape(sk, b, kv_heads * head_dim), cp_groups(options), head_num=heads,
                causal=causal and not general, mask=attention_mask if general else None, scale=scale,
                dropout_p=self.attention_dropout.p if self.training else 0.0, documents=docs)
            return out
        return forward

    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group=None):
        if cp_group is None:   # core 0.12 passes no group: Megatron's CP group
            size, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        else:
            size, rank = cp_group.size(), cp_group.rank()
        positions = sharding.local_positions(pos_emb.shape[seq_dim], options.algo, size, rank,
                                             options.ulysses_degree)
        import torch
        return pos_emb.index_select(seq_dim, torch.tensor(positions, device=pos_emb.device))

    def wrap_initialize(original):
        def initialize_model_parallel(*args, **kwargs):
            result = original(*args, **kwargs)
            _groups.clear()              # groups of an earlier initialize are gone
            if parallel_state.get_context_parallel_world_size() > 1:
                cp_groups(options)       # subgroups now, while every rank is here
            return result
        return initialize_model_parallel

    why = "context parallelism (MindSpeed CP attention)"
    patcher.wrap(DPA + ".__init__", wrap_init, reason=why)
    patcher.wrap(DPA + ".forward", wrap_forward, reason=why)
    patcher.replace("megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank",
                    pos_emb_on_this_cp_rank, reason=why + ": RoPE slice per CP sharding", aliases="megatron")
    patcher.wrap("megatron.core.parallel_state.initialize_model_parallel", wrap_initialize,
                 reason=why + ": hybrid subgroups")
