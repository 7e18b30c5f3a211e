"""MindSpeed: acceleration and portability layer for Megatron-Core training.

`mindspeed.adapt(args)` applies the device shim and the features enabled in `args` (an argv
list, an argparse Namespace such as Megatron's args, or None for defaults) and returns the
active state; `import mindspeed.megatron_adaptor` does the same from sys.argv.
"""
__version__ = "0.1.0"

from mindspeed import deferred_compile as _deferred_compile

_deferred_compile.install()   # before any megatron import: its torch.compile decorations cost seconds per rank


def adapt(args=None):
    from mindspeed.adaptor_core import apply_plan, plan, set_host_flags  # cycle: adaptor_core imports mindspeed
    state = apply_plan(plan(args))
    set_host_flags(state.plan, args)
    return state


def unadapt() -> None:
    from mindspeed.adaptor_core import unadapt as _unadapt  # cycle (see adapt)
    _unadapt()
