"""A collective that a rank never joined (it hangs, is stopped, or died), said in one line: which
collective, over which ranks, and which rank is missing.

torch.distributed's gloo raises `Timed out waiting <ms> for recv/send operation to complete` after
the process group's timeout (`--distributed-timeout-minutes`), and `Connection closed by peer` once
a peer has exited; neither names the collective or the peer. The collective is the torch.distributed
call the traceback went through (its `group` names the ranks). The missing rank: in a group of two,
the other one; in a larger group, the ranks that do not answer a roll call in the job's store
within a few seconds (every rank still running reaches its own timeout about when this one did)."""
from __future__ import annotations

import datetime
import os
import re
import time

import torch
from torch.distributed import distributed_c10d as c10d

from mindspeed.errors import CollectiveTimeout

SETUP_MINUTES = 10          # the least a rank waits for the others while the groups are set up
TIMED_OUT = "Timed out waiting"
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
ROLL_CALL_S = 10.0
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def set_every_group(minutes: float) -> None:
    """`minutes` as the timeout of every process group this rank belongs to (they were created with
    the longer setup timeout). Where torch lacks the setter, they keep that one."""
    set_timeout = getattr(c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        return
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            set_timeout(datetime.timedelta(minutes=minutes), group)


def one_line_error(err: BaseException, timeout_minutes: float) -> CollectiveTimeout | None:
    """The CollectiveTimeout for `err`, or None when it is not a collective's timeout or lost peer."""
    text = str(err)
    timed_out = TIMED_OUT in text
    if not isinstance(err, RuntimeError) or not (timed_out or any(sign in text for sign in PEER_GONE)):
        return None
    if not torch.distributed.is_initialized():
        return None
    name, group = _collective(err.__traceback__)
    me = torch.distributed.get_rank()
    ranks = torch.distributed.get_process_group_ranks(group) if group is not None else \
        list(range(torch.distributed.get_world_size()))
    others = [r for r in ranks if r != me]
    missing = others if len(others) == 1 else roll_call(c10d._get_default_store(), ranks, me) if timed_out else None
    who = f"rank {missing[0]}" if missing and len(missing) == 1 else \
        f"ranks {missing}" if missing else f"one of ranks {others}"
    if timed_out:
        return CollectiveTimeout(f"rank {me}: {name} over ranks {ranks} timed out after "
                                 f"{timeout_minutes * 60:g} s (--distributed-timeout-minutes {timeout_minutes:g}): "
                                 f"{who} never joined it (hung, stopped or much slower); stopping")
    return CollectiveTimeout(f"rank {me}: {name} over ranks {ranks} failed: {who} left it (exited or died); "
                             "stopping")


def setup_error(err: BaseException, setup_minutes: float) -> CollectiveTimeout | None:
    """The CollectiveTimeout for a setup rendezvous that ended before every process joined it (a rank
    that never started or hangs before its setup, or one pointed at another MASTER_ADDR/MASTER_PORT);
    None for any other error."""
    if not isinstance(err, RuntimeError) or "Timed out" not in str(err):    # the store's or a collective's
        return None
    joined = re.search(r"(\d+)/(\d+) clients joined", str(err))
    count = f": {joined.group(1)} of {joined.group(2)} processes joined" if joined else ""
    return CollectiveTimeout(f"rank {os.environ.get('RANK', '0')}: the job's processes did not all join its setup "
                             f"within {setup_minutes * 60:g} s{count} (a rank that never started or hangs before its "
                             "setup, or one given another MASTER_ADDR/MASTER_PORT); stopping")


def _collective(tb) -> tuple[str, object]:
    """(name, process group) of the outermost torch.distributed call in the traceback `tb`; for a
    collective started asynchronously and waited for elsewhere, the function that waited."""
    name, group, waiter = None, None, None
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if code.co_filename.endswith(_C10D) and not code.co_name.startswith("_") and name is None:
            name, group = code.co_name, frame.f_locals.get("group")
        elif f"{os.sep}torch{os.sep}" not in code.co_filename:
            waiter = code.co_name
        tb = tb.tb_next
    if name is None:
        return f"a collective waited for in {waiter or 'an unknown function'}", None
    return f"torch.distributed.{name}", group


def roll_call(store, ranks: list[int], me: int, wait_s: float = ROLL_CALL_S) -> list[int] | None:
    """The ranks of `ranks` that do not mark themselves present in the job's `store` (torch's
    default store: it has no public getter) within `wait_s`; None when the store does not answer
    (its host may be the missing rank)."""
    prefix = f"mindspeed/collective_timeout/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    try:
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        store.set(f"{prefix}{me}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            present = {r for r in ranks if store.check([f"{prefix}{r}"])}
            if len(present) == len(ranks) or time.monotonic() > deadline:
                return sorted(set(ranks) - present) or None
            time.sleep(0.2)
    except Exception:   # the store's host is gone or stopped too: no roll call
        return None
