"""Packed documents in the MindSpore trainer's batches: Megatron-Core's
_get_ltor_masks_and_position_ids semantics (its GPTDataset applies them on the torch side), in numpy.

--eod-mask-loss: no loss where the input token is the end-of-document token.
--reset-position-ids: positions restart at 0 after each EOD token (they feed the learned position
table; Megatron-Core's RoPE ignores position ids, and so does this model's).
--reset-attention-mask: a token attends to its own document only (the EOD closes a document), as a
dense [b, 1, s, s] mask (True = masked out) on top of the causal one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EodRules:
    eod: int
    mask_loss: bool = False
    reset_positions: bool = False
    reset_attention: bool = False

    @classmethod
    def from_args(cls, args, eod: int | None) -> "EodRules | None":
        """The rules the flags ask for, or None when none is on."""
        flags = (bool(args.eod_mask_loss), bool(args.reset_position_ids), bool(args.reset_attention_mask))
        if not any(flags):
            return None
        if eod is None:
            raise ValueError("--eod-mask-loss / --reset-position-ids / --reset-attention-mask need the "
                             "tokenizer's end-of-document id, and this data has none")
        return cls(int(eod), *flags)

    def apply(self, batch: dict) -> dict:
        """batch (tokens [b, s], labels, loss_mask) -> the same with the loss mask zero on EOD tokens,
        and `position_ids` [b, s] / `attention_mask` [b, 1, s, s] when their flag is on."""
        tokens = batch["tokens"]
        out = dict(batch)
        is_eod = tokens == self.eod
        if self.mask_loss:
            out["loss_mask"] = np.where(is_eod, np.float32(0), batch["loss_mask"]).astype(np.float32)
        # document number of each token: the EOD token still belongs to the document it closes
        doc = np.concatenate([np.zeros_like(is_eod[:, :1], np.int32), np.cumsum(is_eod, 1, dtype=np.int32)[:, :-1]], 1)
        if self.reset_positions:
            s = tokens.shape[1]
            index = np.broadcast_to(np.arange(s, dtype=np.int32), tokens.shape)
            # where each token's document starts: the index after the last EOD before it
            starts = np.maximum.accumulate(np.where(np.concatenate(
                [np.ones_like(is_eod[:, :1]), is_eod[:, :-1]], 1), index, 0), axis=1)
            out["position_ids"] = (index - starts).astype(np.int32)
        if self.reset_attention:
            s = tokens.shape[1]
            future = np.triu(np.ones((s, s), bool), 1)
            out["attention_mask"] = (future | (doc[:, :, None] != doc[:, None, :]))[:, None]
        return out
