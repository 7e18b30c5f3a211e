"""Which keys each query may see in the trainer's self-attention: causal, or the band the flash
attention flags ask for (--sparse-mode, --pre-tockens, --next-tockens), as the attention kernel's
keywords (causal, pre_tokens, next_tokens).

The mapping is the torch feature's own (features/fused/flash_attention.band_arguments) for a causal
GPT layer whose queries and keys are one sequence. Sparse mode 1 ('the given mask only') keeps the
causal keyword: the mask a batch gives is Megatron's causal one, or the documents' mask, which
holds it (eod.py)."""
from __future__ import annotations

from mindspeed.features.fused.flash_attention import band_arguments

CAUSAL = (("causal", True),)


def band_keywords(args, features=()) -> tuple:
    """(keyword, value) pairs for the attention kernel; features: ids of the applied features."""
    if "flash-attn" not in features:
        return CAUSAL
    mode = args.sparse_mode
    if mode == 1:
        return CAUSAL
    seq = args.seq_length
    band = band_arguments(mode, True, seq, seq, args.pre_tockens, args.next_tockens)
    return tuple(sorted(band.items()))
