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


class CPOptions:
    """What the hooks of one run share: its flags, its backend, and the CPGroups built over Megatron's
    CP group (`groups`: id(Megatron CP group) -> CPGroups)."""

    def __init__(self, args, backend, fused_merge: bool = False):
        self.backend = backend
        self.groups = {}
        self.fused_merge = fused_merge      # --use-fused-ring-attention-update, as applied
        self.algo = args.context_parallel_algo
        self.ulysses_degree = args.ulysses_degree_in_cp
        self.window_size = args.cp_window_size or 1
        self.overlap = bool(args.use_cp_send_recv_overlap)
        self.mask_type = args.attention_mask_type or "causal"


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
    group, groups = parallel_state.get_context_parallel_group(), options.groups
    if id(group) not in groups:
        all_ranks = _all_cp_ranks(parallel_state) if options.algo == "hybrid_cp_algo" else None
        groups.clear()
        groups[id(group)] = build_cp_groups(options.algo, backend=options.backend, group=group,
                                            all_cp_ranks=all_ranks, ulysses_degree=options.ulysses_degree,
                                            window_size=options.window_size, overlap=options.overlap,
                                            fused_merge=options.fused_merge)
    return groups[id(group)]


def _wrap_init(original):
    """DotProductAttention.__init__ with a CP-free copy of the config (Megatron-Core refuses CP there)."""
    def __init__(self, config, *args, **kwargs):
        if config.context_parallel_size == 1:
            return original(self, config, *args, **kwargs)
        cp_free = copy.copy(config)
        cp_free.context_parallel_size = 1
        original(self, cp_free, *args, **kwargs)
        self.config = config
    return __init__


def _cp1_forward(original, self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                 packed_seq_params):
    """At CP 1: Megatron's own attention, unless the mask is a batch's document ends."""
    if documents.carries_ends(attention_mask):   # Megatron's attention would take it for a mask
        raise NotImplementedError("--reset-attention-mask at context-parallel size 1 takes the "
                                  "documents through --use-flash-attn; add it")
    return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)


def _cp_attention(self, options: CPOptions, query, key, value, attention_mask, attn_mask_type):
    """MindSpeed's CP attention over Megatron's [s, b, heads, dim] query/key/value."""
    from megatron.core.transformer.enums import AttnMaskType
    general = options.mask_type == "general"
    causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
    if general and attention_mask is None:
        raise ValueError("--attention-mask-type general needs an attention mask in the batch")
    s, b, heads, head_dim = query.shape
    sk, _, kv_heads, _ = key.shape
    scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
    docs = None if general else documents.ends_in(attention_mask)    # EOD reset: the micro-batch's documents
    return context_parallel_attention(
        query.reshape(s, b, heads * head_dim), key.reshape(sk, b, kv_heads * head_dim),
        value.reshape(sk, b, kv_heads * head_dim), cp_groups(options), head_num=heads,
        causal=causal and not general, mask=attention_mask if general else None, scale=scale,
        dropout_p=self.attention_dropout.p if self.training else 0.0, documents=docs)


def _wrap_forward(options: CPOptions):
    def wrap(original):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if self.config.context_parallel_size == 1:
                return _cp1_forward(original, self, query, key, value, attention_mask, attn_mask_type,
                                    attention_bias, packed_seq_params)
            if packed_seq_params is not None or attention_bias is not None:
                raise NotImplementedError("context parallelism: packed sequences and attention bias are "
                                          "not supported by MindSpeed's CP attention")
            return _cp_attention(self, options, query, key, value, attention_mask, attn_mask_type)
        return forward
    return wrap


def _pos_emb_on_this_cp_rank(options: CPOptions):
    """RoPE's slice for this CP rank, as sharding.local_positions lays the sequence out."""
    from megatron.core import parallel_state

    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group=None):
        if cp_group is None:   # core 0.12 passes no group: Megatron's CP group
            size, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
        else:
            size, rank = cp_group.size(), cp_group.rank()
        positions = sharding.local_positions(pos_emb.shape[seq_dim], options.algo, size, rank,
                                             options.ulysses_degree)
        import torch
        return pos_emb.index_select(seq_dim, torch.tensor(positions, device=pos_emb.device))
    return pos_emb_on_this_cp_rank


def _wrap_initialize(options: CPOptions):
    from megatron.core import parallel_state

    def wrap(original):
        def initialize_model_parallel(*args, **kwargs):
            result = original(*args, **kwargs)
            options.groups.clear()       # groups of an earlier initialize are gone
            if parallel_state.get_context_parallel_world_size() > 1:
                cp_groups(options)       # subgroups now, while every rank is here
            return result
        return initialize_model_parallel
    return wrap


def install(patcher, options: CPOptions) -> None:
    why = "context parallelism (MindSpeed CP attention)"
    patcher.wrap(DPA + ".__init__", _wrap_init, reason=why)
    patcher.wrap(DPA + ".forward", _wrap_forward(options), reason=why)
    patcher.replace("megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank",
                    _pos_emb_on_this_cp_rank(options), reason=why + ": RoPE slice per CP sharding", aliases="megatron")
    patcher.wrap("megatron.core.parallel_state.initialize_model_parallel", _wrap_initialize(options),
                 reason=why + ": hybrid subgroups")
