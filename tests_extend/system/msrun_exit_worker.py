"""A job for tests_extend/system/test_msrun_fail_fast.py: each worker joins msrun's cluster; with
`die`, rank 1 then kills itself (SIGKILL, no goodbye to the scheduler) while rank 0 keeps running."""
import os
import signal
import sys
import time

from mindspore.communication import init

init()
if os.environ.get("MS_ROLE") == "MS_WORKER" and sys.argv[1:] == ["die"]:
    if os.environ["RANK_ID"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
