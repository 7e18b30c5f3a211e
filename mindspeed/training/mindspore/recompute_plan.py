"""Which layers the MindSpore GPT recomputes in backward, and in which chunks: Megatron-Core's
--recompute-granularity full with --recompute-method uniform (consecutive groups of
--recompute-num-layers layers, each group recomputed as one chunk: only its input is kept) or block
(the first --recompute-num-layers layers, each on its own; the rest keep their activations).
Selective granularity recomputes inside each layer (the attention core) and keeps whole layers.
"""
from __future__ import annotations


def layer_chunks(layers: list, method: str | None, num_layers: int | None) -> list[tuple[list, bool]]:
    """[(layers of one chunk, recomputed?)] in order; `layers` are the ones this model runs
    (noop layers left out), so groups and blocks count computing layers."""
    if method == "uniform":
        n = max(int(num_layers or 1), 1)
        return [(layers[start:start + n], True) for start in range(0, len(layers), n)]
    if method == "block":
        return [([layer], pos < int(num_layers or 0)) for pos, layer in enumerate(layers)]
    return [([layer], False) for layer in layers]
