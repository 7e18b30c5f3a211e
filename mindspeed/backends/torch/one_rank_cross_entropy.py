"""Megatron-Core's vocab-parallel cross entropy over one tensor-parallel rank is torch's own.

`vocab_parallel_cross_entropy` is a Python autograd Function that splits the softmax into the
steps a vocabulary spread over ranks needs (the max, the target's logit and the sum of
exponentials, each all-reduced) and saves the softmax for its own backward: about ten torch ops
forward and four backward. Over one rank there is nothing to reduce, and torch's fused
`cross_entropy` computes the same loss and gradient (within rounding: the same log-sum-exp in a
different order; in fp32, as Megatron's, whatever the logits' dtype). Label smoothing keeps
Megatron's Function: Megatron scales the smoothing by V / (V - 1), torch does not.
"""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core import parallel_state

SITE = "megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy"


def _wrap_cross_entropy(original):
    def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
        if label_smoothing or parallel_state.get_tensor_model_parallel_world_size() != 1:
            return original(vocab_parallel_logits, target, label_smoothing)
        vocab = vocab_parallel_logits.size(-1)
        # in fp32 whatever the logits' dtype, as Megatron's Function computes it
        logits = vocab_parallel_logits.float().reshape(-1, vocab)
        losses = F.cross_entropy(logits, target.reshape(-1), reduction="none")
        return losses.view(target.shape)
    vocab_parallel_cross_entropy.__name__ = original.__name__
    return vocab_parallel_cross_entropy


def apply_one_rank_cross_entropy(patcher) -> None:
    import megatron.core.tensor_parallel.cross_entropy  # noqa: F401  (the site's module)
    patcher.wrap(SITE, _wrap_cross_entropy, reason="cross entropy over one rank's whole vocabulary is torch's own",
                 aliases="megatron")
