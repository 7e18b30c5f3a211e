"""Dropout's keep masks for the MindSpore GPT (--hidden-dropout, --attention-dropout), drawn in numpy
per training micro-batch and fed to the model as tensors.

Where Megatron-Core drops: the embedding output and each layer's bias-dropout-add (after attention,
after the MLP) with --hidden-dropout, the attention probabilities with --attention-dropout; inverted
scaling (kept values x 1/(1-p)); nothing in evaluation. Megatron's RNG rules across tensor-parallel
ranks (tensor_parallel/random.py): the hidden stream is replicated over TP without sequence
parallelism, so its masks are the same on every TP rank (drawn without the TP rank); with sequence
parallelism each rank drops its own slice (here: its slice of the one full-sequence mask); the
attention probabilities belong to each rank's own heads (Megatron's model-parallel RNG), so their
masks are drawn per TP rank. As in Megatron, data-parallel ranks share the stream (their data differ).

Why masks as inputs rather than MindSpore's stateful dropout op: a mask is a function of (seed,
iteration, micro-batch, TP rank) only, so a recomputed forward (--recompute-*) drops exactly the
values the first forward dropped (what Megatron gets by saving and restoring its RNG states), and a
traced graph takes them as arguments.
"""
from __future__ import annotations

import numpy as np

_HIDDEN, _PROBS = 0, 1      # stream ids in the seed


def keep_mask(rng: np.random.Generator, shape: tuple, p: float) -> np.ndarray:
    """Inverted-dropout factors: 0 where dropped (probability p), 1/(1-p) where kept."""
    return (rng.random(shape, dtype=np.float32) >= np.float32(p)).astype(np.float32) / np.float32(1.0 - p)


class DropoutMasks:
    def __init__(self, cfg, ps, seed: int, layers: int):
        self.cfg, self.ps, self.seed, self.layers = cfg, ps, int(seed), layers
        self.heads_local = cfg.num_attention_heads // ps.tp_size

    @property
    def on(self) -> bool:
        return self.cfg.hidden_dropout > 0 or self.cfg.attention_dropout > 0

    def draw(self, iteration: int, micro: int, batch_size: int) -> dict:
        """{"hidden_keep": [1 + 2L, s_local, b, h], "probs_keep": [L, b, n_local, s, s]}, each only
        when its probability is > 0, for micro-batch `micro` of training step `iteration`."""
        cfg, ps, s, b = self.cfg, self.ps, self.cfg.seq_length, batch_size
        out = {}
        if cfg.hidden_dropout > 0:
            rng = np.random.default_rng([self.seed, iteration, micro, _HIDDEN])
            full = keep_mask(rng, (1 + 2 * self.layers, s, b, cfg.hidden_size), cfg.hidden_dropout)
            if ps.sequence_parallel and ps.tp_size > 1:
                local = s // ps.tp_size
                full = full[:, ps.tp_rank * local:(ps.tp_rank + 1) * local]
            out["hidden_keep"] = np.ascontiguousarray(full)
        if cfg.attention_dropout > 0:
            rng = np.random.default_rng([self.seed, iteration, micro, _PROBS, ps.tp_rank])
            out["probs_keep"] = keep_mask(rng, (self.layers, b, self.heads_local, s, s), cfg.attention_dropout)
        return out
