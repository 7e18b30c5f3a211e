"""Run a test body in N real processes (torch.distributed over gloo on CPU), with a timeout so a
hung collective fails the test instead of hanging CI.

    def body(rank, world_size, *args): ...         # a module-level function
    results = run_distributed(body, world_size=2, args=(...,), timeout=120)

Each process gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, an initialised gloo process group,
and returns a picklable value; `results[rank]` holds it. Any exception in any rank fails the
call with that rank's traceback.
"""
from __future__ import annotations

import os
import pickle
import traceback

import torch.multiprocessing as mp

from mindspeed.net import free_port


class DistributedTestError(AssertionError):
    pass


def next_rendezvous(rank: int, marker: str) -> None:
    """Before each of several process groups one body runs in turn: tear down the current group and
    set MASTER_PORT to a port rank 0 picks now and hands the other ranks through the file `marker`
    (ports picked up front collided with ephemeral ports taken since by earlier groups' gloo pairs)."""
    import time

    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        with open(marker + ".tmp", "w") as f:
            f.write(str(free_port()))
        os.replace(marker + ".tmp", marker)
    deadline = time.monotonic() + 120
    while not os.path.exists(marker):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 wrote no port to {marker}")
        time.sleep(0.05)
    with open(marker) as f:
        os.environ["MASTER_PORT"] = f.read()


def _worker(rank, world_size, port, fn, args, env, queue):
    # a forked rank holds the fork server's environment: the caller's, as it is now, replaces it
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist
    # what torchrun does for processes sharing a machine: one compute thread each unless told (the
    # ranks' thread pools on two cores spun against each other: half a test's CPU time went there);
    # set here, since torch read its environment in the fork server
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except BaseException as e:  # the port was taken after it was picked: run_distributed retries
        status = "port taken" if "EADDRINUSE" in str(e) else "error"
        queue.put((rank, status, traceback.format_exc()))
        return
    try:
        from mindspeed.backends import set_backend
        set_backend("torch", "cpu")      # what a torch job on CPU adapts to; a body that adapts replaces it
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", by_value(result)))
    except BaseException:  # report everything, including assertion failures
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, args: tuple = (), timeout: float = 180,
                    env: dict | None = None, daemon: bool = True) -> list:
    """daemon=False for bodies that start processes of their own (dist_checkpointing's save does);
    the workers are still killed when one fails or the timeout passes. A rendezvous port taken
    between picking and binding it (tests run side by side) is retried with a new port, twice."""
    for attempt in range(3):
        try:
            return _run_once(fn, world_size, args, timeout, env, daemon)
        except _PortTaken:
            if attempt == 2:
                raise DistributedTestError("the rendezvous port was taken three times in a row")


def by_value(result) -> bytes:
    """A rank's result as plain pickle bytes. Put on the queue as it is, a tensor would travel as a
    handle to the rank's shared memory, served by the rank until it exits: a rank that finished and
    exited before the caller read the queue failed the test (FileNotFoundError on its socket)."""
    return pickle.dumps(result)


class _PortTaken(Exception):
    pass


def _died_silently(procs, results) -> list:
    """Ranks whose process ended without putting a result or an error on the queue."""
    dead = [(rank, p.exitcode) for rank, p in enumerate(procs) if rank not in results and p.exitcode is not None]
    return [f"--- rank {rank} ---\nthe process ended without a result (exit code {code}"
            + (f": signal {-code})" if code < 0 else ")") for rank, code in dead]


# What every rank imports, imported once in the fork server the ranks are forked from, instead of
# once per rank as a spawned process did (about 5 s of CPU each, a third of a small test's time).
# Only third-party modules: MindSpeed itself, and its patches, are imported by each rank afresh.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.transformer", "megatron.core.tensor_parallel", "megatron.core.optimizer"]


def _context():
    """The forkserver context (started on the first call of this process, then reused); a fresh
    spawn where the platform has no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _run_once(fn, world_size, args, timeout, env, daemon) -> list:
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, {**os.environ, **(env or {})}, queue),
                         daemon=daemon) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, port_taken = {}, [], False
    import queue as queue_mod
    import time
    deadline = time.monotonic() + timeout
    seen_dead = []
    while len(results) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, payload = queue.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            # a rank that died without a word (a signal, os._exit) fails now, not at the timeout; a rank
            # counts as dead once it was seen ended a second before (its last message may be in the pipe)
            dead = _died_silently(procs, results)
            if dead and dead == seen_dead:
                errors.extend(dead)
                break
            seen_dead = dead
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
        elif status == "port taken":
            port_taken = True
            errors.append(payload)
            break
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")
            break   # the other ranks may now hang in a collective: stop them
    for p in procs:
        p.join(timeout=1 if errors or len(results) < world_size else 10)
        if p.is_alive():
            p.kill()
            p.join()
    if port_taken:
        raise _PortTaken()
    if errors:
        raise DistributedTestError("distributed test failed:\n" + "\n".join(errors))
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise DistributedTestError(f"distributed test timed out after {timeout}s; ranks {missing} "
                                   f"did not finish (hung collective?)")
    return [results[r] for r in range(world_size)]
