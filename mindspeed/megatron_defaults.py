"""Megatron flag defaults that several layers compare against (the trainers' parser, the flag
checks, the support matrix's rows, the MindSpore trainer): one value, framework-free."""

DISTRIBUTED_TIMEOUT_MINUTES = 10      # --distributed-timeout-minutes


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocab so each TP shard of the embedding has the same size."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple
