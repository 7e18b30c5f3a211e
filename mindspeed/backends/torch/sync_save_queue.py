"""Megatron-Core's synchronous checkpoint save, without the helper processes it starts for nothing.

dist_checkpointing's torch_dist writer hands each save's write results back through a queue that
it makes, once per process, as a `multiprocessing` Manager from the *spawn* context: a fresh
Python process, which imports torch to unpickle the results it relays. An asynchronous save
needs that (its writer runs in another process); a synchronous one
(`AsyncSaveShardedStrategy.save`) does not. Megatron-Core 0.16's `save` runs the request in the
calling process (`async_save`, then the request's `execute_sync`); 0.12's hands the same request
to its AsyncCallsQueue, which forks a process to write and waits for it. Both become 0.16's
form — the request's own `execute_sync`, which Megatron documents as equivalent to the
asynchronous call — with the results in an in-process queue. Asynchronous saves (`async_save`,
Megatron-LM's `--async-save`) keep Megatron's Manager. Applied by the cpu device shim, where it
was measured (docs/performance.md).
"""
from __future__ import annotations

import queue

SYNC_SAVE = "megatron.core.dist_checkpointing.strategies.base.AsyncSaveShardedStrategy.save"


def _in_process_save(writer):
    """A replacement of the synchronous save that writes in this process, with `writer`'s
    (Megatron's filesystem_async module) results queue an in-process one for the call."""
    def wrap(_megatron_save):
        def save(self, sharded_state_dict, checkpoint_dir):
            megatron_queue = writer._get_write_results_queue
            # the writer takes its queue while the request is prepared (async_save) and reads it back
            # in the request's finalize step: both run in this call, on this thread
            writer._get_write_results_queue = queue.Queue
            try:
                request = self.async_save(sharded_state_dict, checkpoint_dir)
            finally:
                writer._get_write_results_queue = megatron_queue
            request.execute_sync()
        return save
    return wrap


def apply_in_process_results_queue(patcher) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if not callable(getattr(filesystem_async, "_get_write_results_queue", None)):
        return      # a Megatron-Core without the Manager queue: nothing to avoid
    patcher.wrap(SYNC_SAVE, _in_process_save(filesystem_async),
                 reason="a synchronous save runs its request in this process (execute_sync) with its write "
                        "results in an in-process queue (no spawned Manager, no forked writer)")
