"""The reference the --reuse-fp32-param tests compare against, written from the rounding's definition.

The flag keeps each bf16 parameter as the high half of its fp32 master after adding 0x8000: the
nearest bf16 value, ties away from zero. Megatron's own copy of the masters to the model rounds ties
to even, so the two differ wherever a master's low 16 bits are exactly 0x8000 above an even bf16
value. Which masters land there depends on the gradients, and those on the CPU's kernels (AVX-512
BF16 dot products or AVX2's fp32 ones): on one machine the first such tie may come at update 1, on
another at update 5. The tests therefore compare the flag bit for bit with Megatron's optimizers
whose copy rounds ties away from zero (`megatron_copies_round_ties_away`), and with plain Megatron
only up to the first update that leaves such a tie (`differing_ties`)."""
from __future__ import annotations

from contextlib import contextmanager

import torch


def round_ties_away(master: torch.Tensor) -> torch.Tensor:
    """The bf16 value nearest each fp32 element, ties away from zero: of the two bf16 neighbours (the
    bit pattern truncated, and one bf16 step further from zero), the far one when the dropped low 16
    bits are at least half a step."""
    bits = master.detach().reshape(-1).view(torch.int32)
    toward_zero = bits & -0x10000
    away = toward_zero + 0x10000
    return torch.where((bits & 0xFFFF) >= 0x8000, away, toward_zero).view(torch.float32).bfloat16()


def differing_ties(masters) -> int:
    """Masters whose bf16 values differ between ties-away and ties-to-even rounding: low 16 bits
    exactly 0x8000 above an even (last bit 0) truncated bf16 value."""
    count = 0
    for master in masters:
        bits = master.detach().reshape(-1).view(torch.int32)
        count += int((((bits & 0xFFFF) == 0x8000) & ((bits & 0x10000) == 0)).sum())
    return count


@contextmanager
def megatron_copies_round_ties_away():
    """Megatron's Float16 and distributed optimizers whose copy of the masters to the model's bf16
    parameters rounds ties away from zero: Megatron's copy runs, then each bf16 parameter (or, with
    the distributed optimizer, this rank's shard of the bucket) is rewritten from its master. An
    instance that replaces the method (--reuse-fp32-param does) is not affected."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    float16_copy = Float16OptimizerWithFloat16Params._copy_main_params_to_model_params
    distributed_copy = DistributedOptimizer._copy_main_params_to_model_params

    @torch.no_grad()
    def float16(self):
        float16_copy(self)
        for models, mains in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model, main in zip(models, mains):
                model.data.copy_(round_ties_away(main).view(model.shape))

    @torch.no_grad()
    def distributed(self):
        distributed_copy(self)
        for models, mains in zip(self.model_float16_groups, self.shard_fp32_from_float16_groups):
            for model, main in zip(models, mains):
                world = self._get_model_param_range_map(model)["gbuf_world_in_bucket"]
                gbuf, _, bucket = self.model_param_gbuf_map[model]
                data = self.buffers[gbuf].buckets[bucket].param_data.view(-1)
                data[world.start:world.end].copy_(round_ties_away(main))

    Float16OptimizerWithFloat16Params._copy_main_params_to_model_params = float16
    DistributedOptimizer._copy_main_params_to_model_params = distributed
    try:
        yield
    finally:
        Float16OptimizerWithFloat16Params._copy_main_params_to_model_params = float16_copy
        DistributedOptimizer._copy_main_params_to_model_params = distributed_copy


def losses_before_a_differing_tie(ties_after_each_update) -> int:
    """How many leading losses the two roundings must give bit for bit: loss k is computed from the
    parameters after k updates, so those before the first update that left a differing tie."""
    for update, ties in enumerate(ties_after_each_update, start=1):
        if ties:
            return update
    return len(ties_after_each_update)


def largest_gap(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
