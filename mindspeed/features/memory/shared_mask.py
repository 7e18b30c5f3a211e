"""Shared attention mask (always on, torch backend; no flag, as in upstream MindSpeed): where the
attention mask is the plain causal one, every layer and every micro-batch gets one cached mask
object instead of a fresh [s, s] tensor per layer (Megatron's default mask, built in each
softmax call when no mask is passed) or per micro-batch (the data loader's stacked per-sample
masks). The values are the same, so losses are bit for bit those of per-layer / per-micro-batch
masks; what goes away is the allocation per micro-batch and the per-layer copies saved for
backward (masked_fill_ keeps its mask).

Plain causal: no --reset-attention-mask (eod-reset masks differ per sample), no --neat-pack, no
context parallelism (a CP algorithm cuts the batch its own way). Nothing may write into the
shared mask; Megatron only reads it (attention_mask_func fills the scores, not the mask).

The masks are held by a SharedMasks owned by whoever builds the run's batches (the trainer's
BatchReader, Megatron-LM's batch hook), and each carries a mark that is_shared reads, so the
attention needs no registry to recognise one.
"""
from __future__ import annotations

import functools

import torch

MARK = "_mindspeed_shared_causal_mask"     # attribute a shared mask carries (is_shared)


class SharedMasks:
    """One [1, 1, seq, seq] bool causal mask (True above the diagonal, hidden) per (seq, device)."""

    def __init__(self):
        self._masks: dict = {}

    def causal_mask(self, seq: int, device) -> torch.Tensor:
        """The one causal mask of `seq` tokens on `device`."""
        key = (seq, str(torch.device(device)))
        mask = self._masks.get(key)
        if mask is None:
            mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1).view(1, 1, seq, seq)
            setattr(mask, MARK, True)
            self._masks[key] = mask
        return mask

    def share_batch_mask(self, batch: dict) -> dict:
        """A batch whose plain causal [b, 1, s, s] mask is replaced by the shared one (same values)."""
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and not is_shared(mask):
            batch["attention_mask"] = self.causal_mask(mask.shape[-1], mask.device)
        return batch


def is_shared(mask) -> bool:
    """Whether `mask` is a shared causal mask (made by a SharedMasks)."""
    return isinstance(mask, torch.Tensor) and getattr(mask, MARK, False)


def plain_causal(args) -> bool:
    """Whether the run's masks are all the plain causal one (see the module's note)."""
    return not (args.reset_attention_mask or args.neat_pack or (args.context_parallel_size or 1) > 1)


def _cached_default_mask(original):
    cached = functools.lru_cache(maxsize=8)(original)   # Megatron's get_default_causal_mask(sq)

    @functools.wraps(original)
    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return cached(sq)

    def cache_clear() -> None:      # cores before 0.13 cache it themselves, and their tests clear it
        cached.cache_clear()
        getattr(original, "cache_clear", lambda: None)()
    get_default_causal_mask.cache_clear = cache_clear
    get_default_causal_mask.cache_info = cached.cache_info
    return get_default_causal_mask


def install(patcher) -> None:
    """Both trainers (the built-in one shares its batches' masks in training/data.py)."""
    patcher.wrap("megatron.core.transformer.utils.get_default_causal_mask", _cached_default_mask,
                 reason="shared attention mask: one causal mask per sequence length for every layer",
                 aliases="megatron")


def install_megatron_lm(patcher) -> None:
    """Megatron-LM's pretrain_gpt.py: its batches' masks (bound before the script imports the name), shared
    through masks of this patch's own."""
    patcher.wrap("megatron.training.utils.get_batch_on_this_tp_rank",
                 functools.partial(_sharing_tp_batches, masks=SharedMasks()),
                 reason="shared attention mask: Megatron-LM's plain causal batch masks become one object",
                 aliases="megatron")


def _sharing_tp_batches(original, masks: SharedMasks):
    @functools.wraps(original)
    def get_batch_on_this_tp_rank(*a, **kw):
        batch = original(*a, **kw)
        from megatron.training import get_args
        args = get_args()
        if isinstance(batch, dict) and plain_causal(args) and not args.is_instruction_dataset:
            masks.share_batch_mask(batch)
        return batch
    return get_batch_on_this_tp_rank
