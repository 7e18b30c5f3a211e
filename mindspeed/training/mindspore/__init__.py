"""MindSpeed's native MindSpore GPT trainer: `--backend mindspore` (launch with msrun).

`run(args)` takes the namespace of mindspeed.flags.trainer_flags.parse_args. Importing this
package does not import MindSpore; run() does (and names the install command if it is missing).
Its modules import MindSpore themselves: the package sets MindSpore's log level before any does.
"""
from __future__ import annotations

from mindspeed.backends.mindspore.device_select import import_mindspore, quiet_mindspore_logs

quiet_mindspore_logs()


def run(args) -> dict:
    import_mindspore()
    from mindspeed.training.mindspore.trainer import run as _run  # imports MindSpore: after import_mindspore()
    return _run(args)


__all__ = ["run"]
