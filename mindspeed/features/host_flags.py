"""Host (Megatron) flags as features declare them: `host(name, default)`, the parser's option that
MindSpeed only reads, and the two the plan's namespace holds only once the host's args are given.

The plan fills every other host flag a feature reads (flags/mindspeed_flags.fill_host_defaults).
--num-experts and --bf16 stay absent until given: --moe-grouped-gemm's check (features/fused) tells
a namespace without the host's args from a dense model or an fp32 run. Read them with until_given.
"""
from __future__ import annotations

from mindspeed.features.base import Flag


def host(name: str, default=None, dest: str | None = None) -> Flag:
    """A host-parser flag; `default` is the host's, kept here to name what the user changed and to
    fill a namespace without it."""
    kwargs = {"default": default}
    if dest:
        kwargs["dest"] = dest
    return Flag(name, kwargs, megatron=True, host=True)


NUM_EXPERTS = host("--num-experts")
BF16 = host("--bf16", False)
ABSENT_UNTIL_GIVEN = (NUM_EXPERTS.dest, BF16.dest)


def until_given(args, fl: Flag):
    """The value of NUM_EXPERTS or BF16, or its default where the host's args were not given."""
    return getattr(args, fl.dest, fl.default)     # absent until given (see the module's note)
