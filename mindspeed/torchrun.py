"""`python -m mindspeed.torchrun ...`: torchrun (`torch.distributed.run`, the same arguments) whose
stop by a signal, or by a failed worker, ends in one line instead of a traceback.

torchrun forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT to its workers (`--signals-to-handle`), waits for
them (`--shutdown-timeout`, 30 s by default, then SIGKILL) and re-raises the signal as an exception.
With `--exit-signal-handler` the workers use that time to finish their step and save; the launcher
then only has to say what happened. The exit status is the shell's for a signal, 128 + its number.
When a worker fails, torchrun stops the others with SIGTERM and kills them 30 s later (torch's own
wait on that path, whatever `--shutdown-timeout` says), then ends here in one line as well. So does a
rendezvous port that another process on this machine already listens on.

`--shutdown-timeout` came with torch 2.13's torchrun; an older one (a GPU machine's own torch) waits
a fixed 30 s instead. There the flag is dropped when it asks for those 30 s (the launch scripts'
default) and refused in one line otherwise.
"""
from __future__ import annotations

import re
import signal
import sys

import torch
from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser
from torch.distributed.run import main as torchrun_main

SHUTDOWN_FLAGS = ("--shutdown-timeout", "--shutdown_timeout")
FIXED_SHUTDOWN_S = 30        # torchrun's wait after forwarding a signal, before --shutdown-timeout


class LauncherError(ValueError):
    """A launcher argument this torch's torchrun cannot honour."""


def _flag_value(argv: list[str], at: int) -> tuple[str, int]:
    """(value, tokens used) of the option at argv[at] ("--flag value" or "--flag=value")."""
    if "=" in argv[at]:
        return argv[at].split("=", 1)[1], 1
    if at + 1 >= len(argv):
        raise LauncherError(f"{argv[at]} needs a value")
    return argv[at + 1], 2


def for_this_torchrun(argv: list[str], parser=None) -> list[str]:
    """argv as this torch's torchrun takes it: without --shutdown-timeout where torchrun lacks it and
    the value is its fixed wait. Only the launcher's own options are read (up to the script)."""
    options = (parser or get_args_parser())._option_string_actions
    if SHUTDOWN_FLAGS[0] in options:
        return list(argv)
    out, at = [], 0
    while at < len(argv):
        token = argv[at]
        name = token.split("=", 1)[0]
        if name in SHUTDOWN_FLAGS:
            value, used = _flag_value(argv, at)
            if value != str(FIXED_SHUTDOWN_S):
                raise LauncherError(
                    f"{name} {value}: this torchrun (torch {torch.__version__}) has no --shutdown-timeout and gives "
                    f"the workers a fixed {FIXED_SHUTDOWN_S} s after a signal; leave it at {FIXED_SHUTDOWN_S} "
                    "(SHUTDOWN_TIMEOUT for the launch scripts) or use torch 2.13 or later")
            at += used
            continue
        if not token.startswith("-"):        # the training script: the rest is its own
            return out + argv[at:]
        takes_value = name in options and options[name].nargs != 0 and "=" not in token
        out += argv[at:at + (2 if takes_value else 1)]
        at += 2 if takes_value else 1
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        argv = for_this_torchrun(sys.argv[1:] if argv is None else argv)
    except LauncherError as err:
        print(f"torchrun: {err}", file=sys.stderr)
        return 2
    try:
        torchrun_main(argv)
    except SignalException as stop:
        name = signal.Signals(stop.sigval).name
        print(f"torchrun: stopped by {name}: forwarded to the workers, which have exited", file=sys.stderr)
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:   # torchrun's own report is a traceback around a table
        rank, failure = failed.get_first_failure()
        how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
        print(f"torchrun: worker rank {rank} {how} (its own error line, if any, is above); the job's other "
              "workers were stopped", file=sys.stderr)
        return 1
    except DistNetworkError as err:
        if "EADDRINUSE" not in str(err):
            raise
        port = re.search(r"port: (\d+)", str(err))
        print(f"torchrun: the rendezvous port{' ' + port.group(1) if port else ''} is already in use on this "
              "machine (another job, or one still ending); give a free one (MASTER_PORT for the launch "
              "scripts, --master_port or --rdzv-endpoint for torchrun)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
