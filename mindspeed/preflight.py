"""The trainer's refusals, before anything is launched: one process, no process group.

    python -m mindspeed.preflight [--preflight-world-size N] <pretrain_gpt.py's arguments>

does what tests_extend/example/pretrain_gpt.py does before any work (parse_args, then the support
matrix gate `mindspeed.adaptor_core.plan`, which applies nothing) and exits 2 with its one
`error: ...` line on stderr when the run would be refused, 0 otherwise (3 after printing --help:
nothing to launch). The launch scripts
(train_distributed.sh, train_distributed_ms.sh) run it before torchrun/msrun, so a refused flag
stops the launch with that line instead of a launcher's traceback.

The world size is the launch's (processes per node x nodes): --preflight-world-size N (leading
arguments), else $MINDSPEED_PREFLIGHT_WORLD_SIZE, else $WORLD_SIZE as parse_args reads it.
Imports stay light: megatron.core is never imported, MindSpore only when --backend mindspore
(the gate resolves its device).
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

from mindspeed import adaptor_core
from mindspeed.adaptor_core import MindSpeedConfigError
from mindspeed.backends import BackendUnavailableError
from mindspeed.errors import ArgumentError, report
from mindspeed.flags.trainer_flags import parse_args

WORLD_SIZE_OPTION = "--preflight-world-size"
WORLD_SIZE_ENV = "MINDSPEED_PREFLIGHT_WORLD_SIZE"
REFUSED, HELP_SHOWN = 2, 3     # exit codes besides 0 (the run would start)


class PreflightUsageError(ValueError):
    """The preflight's own option is wrong (not the trainer's flags)."""


def refusal_errors() -> tuple[type[BaseException], ...]:
    """What the trainer reports as a one-line `error:` before work (pretrain_gpt.py's user errors
    that can come from parsing and the gate). The MindSpore trainer's TrainerConfigError is
    included when its module is loaded (importing it imports MindSpore)."""
    errors: tuple[type[BaseException], ...] = (ArgumentError, MindSpeedConfigError, BackendUnavailableError)
    trainer = sys.modules.get("mindspeed.training.mindspore.trainer")
    if trainer is not None:
        errors += (trainer.TrainerConfigError,)
    return errors


def refusal(argv: Sequence[str], world_size: int | None = None) -> str | None:
    """The trainer's one-line refusal of `argv` at `world_size` processes, or None if it would start."""
    try:
        args = parse_args(list(argv), world_size=world_size)
        adaptor_core.plan(args)
    except Exception as err:
        if not isinstance(err, refusal_errors()):   # looked up now: the gate may have loaded the trainer
            raise
        return " ".join(str(err).split())
    return None


def split_world_size(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """(world size, the trainer's argv) from the preflight's command line."""
    argv = list(argv)
    value = os.environ.get(WORLD_SIZE_ENV) or None
    if argv and argv[0].split("=", 1)[0] == WORLD_SIZE_OPTION:
        if "=" in argv[0]:
            value, argv = argv[0].split("=", 1)[1], argv[1:]
        elif len(argv) > 1:
            value, argv = argv[1], argv[2:]
        else:
            raise PreflightUsageError(f"{WORLD_SIZE_OPTION} needs a value")
    if value is None:
        return None, argv
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise PreflightUsageError(f"{WORLD_SIZE_OPTION} / {WORLD_SIZE_ENV} must be a positive integer "
                                  f"(got {value!r})")
    return size, argv


def main(argv: Sequence[str] | None = None) -> int:
    try:
        world_size, trainer_argv = split_world_size(sys.argv[1:] if argv is None else argv)
        message = refusal(trainer_argv, world_size)
    except PreflightUsageError as err:
        message = f"preflight: {err}"
    except SystemExit as done:       # argparse's --help: printed here, once
        if done.code not in (0, None):
            raise
        return HELP_SHOWN
    if message is None:
        return 0
    report(message)
    return REFUSED


if __name__ == "__main__":
    sys.exit(main())
