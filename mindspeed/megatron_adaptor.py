"""`import mindspeed.megatron_adaptor`: one line that adapts Megatron to this machine.

Under Megatron-LM (`megatron.training` importable, e.g. its own pretrain_gpt.py): the device shim
is applied now and MindSpeed's flags join Megatron's own parser; the support-matrix gate and the
features run right after Megatron's validate_args (mindspeed/megatron_lm.py).
With the megatron-core wheel alone (a user's own script): MindSpeed's flags are read from sys.argv
(parse_known_args; the script's own flags are left alone unless one is within a typo of a
MindSpeed or Megatron flag), gated and applied now.
Programmatic users call mindspeed.adapt(args) instead and nothing reads sys.argv.
"""
import sys

from mindspeed import deferred_compile
from mindspeed.patching import GLOBAL_PATCHES

deferred_compile.install(GLOBAL_PATCHES)   # before mindspeed.megatron_lm, which may import Megatron

from mindspeed import megatron_lm  # noqa: E402  (after the install)
from mindspeed.adaptor_core import MindSpeedConfigError, apply_plan, plan  # noqa: E402

try:
    if megatron_lm.present():
        from mindspeed.convert.at_training import convert_load
        SESSION = megatron_lm.adapt_megatron_lm(sys.argv[1:], convert_hf=convert_load)
    else:
        # the script's own flags are its business; flags close to MindSpeed's or Megatron's are typos
        SESSION = apply_plan(plan(sys.argv[1:], unknown_flags="typos"))
except MindSpeedConfigError as _exc:
    raise SystemExit(str(_exc)) from None
