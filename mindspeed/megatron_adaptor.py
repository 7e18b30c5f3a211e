"""`import mindspeed.megatron_adaptor`: one line that adapts Megatron to this machine.

Parses only MindSpeed's flags from sys.argv (parse_known_args; Megatron's flags are left alone),
refuses unsupported requests with a clear message before any process group or model exists,
then applies the device shim and the enabled features. Programmatic users call
mindspeed.adapt(args) instead and nothing reads sys.argv.
"""
import sys

from mindspeed.adaptor_core import MindSpeedConfigError, apply_plan, plan

try:
    STATE = apply_plan(plan(sys.argv[1:]))
except MindSpeedConfigError as _exc:
    raise SystemExit(str(_exc)) from None
