"""MindSpeed: acceleration and portability layer for Megatron-Core training.

`mindspeed.adapt(args)` applies the device shim and the features enabled in `args` (an argv
list, an argparse Namespace such as Megatron's args, or None for defaults) and returns the run's
Session (mindspeed/session.py); with `specs_from_session=True` the caller builds Megatron-Core's
layer spec from it (the built-in trainers) instead of the features patching Megatron's spec
providers. `import mindspeed.megatron_adaptor` does the same from sys.argv. Importing `mindspeed`
itself patches nothing and imports no framework.
"""
__version__ = "0.1.0"


def adapt(args=None, *, specs_from_session: bool = False):
    from mindspeed import deferred_compile
    from mindspeed.adaptor_core import apply_plan, plan, set_host_flags, unadapt  # cycle: adaptor_core imports mindspeed
    from mindspeed.patching import GLOBAL_PATCHES
    p = plan(args)    # a refused plan leaves the previous adaptation as it was
    unadapt()         # the previous adaptation goes first here, not in apply_plan: the deferral below stays
    deferred_compile.install(GLOBAL_PATCHES)   # before apply_plan imports Megatron (~4 s of each rank's start)
    state = apply_plan(p, specs_from_session=specs_from_session)
    set_host_flags(state.plan, args)
    return state


def unadapt() -> None:
    from mindspeed.adaptor_core import unadapt as _unadapt  # cycle (see adapt)
    _unadapt()
