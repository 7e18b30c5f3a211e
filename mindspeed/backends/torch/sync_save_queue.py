"""Megatron-Core's synchronous checkpoint save, without the helper process it starts for nothing.

dist_checkpointing's torch_dist writer hands each save's write results back through a queue that
it makes, once per process, as a `multiprocessing` Manager from the *spawn* context: a fresh
Python process, which imports torch to unpickle the results it relays. An asynchronous save
needs that (its writer runs in another process); a synchronous one
(`AsyncSaveShardedStrategy.save`: `async_save`, then `execute_sync` in the calling process)
puts the results and reads them back in the same process. For those saves the results go
through an in-process queue instead; asynchronous saves (`async_save`, Megatron-LM's
`--async-save`) keep Megatron's Manager. Applied by the cpu device shim, where it was measured
(docs/performance.md).
"""
from __future__ import annotations

import queue

SYNC_SAVE = "megatron.core.dist_checkpointing.strategies.base.AsyncSaveShardedStrategy.save"


def _in_process_results(writer):
    """A wrapper of the synchronous save under which `writer` (Megatron's filesystem_async module)
    makes an in-process queue for the save's results."""
    def wrap(original):
        def save(self, sharded_state_dict, checkpoint_dir):
            megatron_queue = writer._get_write_results_queue
            # the save's whole write (results put, then read back) runs in this call, on this thread
            writer._get_write_results_queue = queue.Queue
            try:
                return original(self, sharded_state_dict, checkpoint_dir)
            finally:
                writer._get_write_results_queue = megatron_queue
        return save
    return wrap


def _saves_in_this_process(strategy_base) -> bool:
    """Megatron-Core 0.16's synchronous save runs its request here (`execute_sync`); 0.12's hands it
    to its AsyncCallsQueue, which writes in a forked process: an in-process queue would never see
    that process's results ("results_queue should not be empty")."""
    import inspect
    return "execute_sync" in inspect.getsource(strategy_base.AsyncSaveShardedStrategy.save)


def apply_in_process_results_queue(patcher) -> None:
    from megatron.core.dist_checkpointing.strategies import base, filesystem_async
    if not callable(getattr(filesystem_async, "_get_write_results_queue", None)):
        return      # a Megatron-Core without the Manager queue: nothing to avoid
    if not _saves_in_this_process(base):
        return
    patcher.wrap(SYNC_SAVE, _in_process_results(filesystem_async),
                 reason="a synchronous save's write results stay in this process (no spawned Manager)")
