"""`python -m mindspeed.torchrun ...`: torchrun (`torch.distributed.run`, the same arguments) whose
stop by a signal, or by a failed worker, ends in one line instead of a traceback.

torchrun forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT to its workers (`--signals-to-handle`), waits for
them (`--shutdown-timeout`, 30 s by default, then SIGKILL) and re-raises the signal as an exception.
With `--exit-signal-handler` the workers use that time to finish their step and save; the launcher
then only has to say what happened. The exit status is the shell's for a signal, 128 + its number.
When a worker fails, torchrun stops the others with SIGTERM and kills them 30 s later (torch's own
wait on that path, whatever `--shutdown-timeout` says), then ends here in one line as well. So does a
rendezvous port that another process on this machine already listens on.
"""
from __future__ import annotations

import re
import signal
import sys

from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main



def main(argv: list[str] | None = None) -> int:
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
