"""Fault injection (first on PYTHONPATH in the kill-during-save tests; Python imports this module
at start-up in every process of the job): the first process about to do MINDSPEED_TEST_PAUSE_AT
(`<audit event>:<text of its path>`, e.g. `open:iter_0000008/__1_` for a torch_dist shard file)
creates the file MINDSPEED_TEST_PAUSED, writes its pid there and waits forever, inside the real
save, until the test kills the job. Once that file exists nothing pauses, so the same command,
run again, goes through."""
import os
import sys
import time

_EVENT, _, _TEXT = os.environ.get("MINDSPEED_TEST_PAUSE_AT", "").partition(":")
_MARK = os.environ.get("MINDSPEED_TEST_PAUSED", "")


def _pause_here(event, args):
    if event != _EVENT or not args or _TEXT not in str(args[0]):
        return
    try:
        fd = os.open(_MARK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return                       # another process paused already, or this is the run after the kill
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    while True:
        time.sleep(3600)


if _TEXT and _MARK and not os.path.exists(_MARK):
    sys.addaudithook(_pause_here)
