"""Megatron-Core hook of --recompute-in-advance / --recompute-in-bubble (torch backend): the
recomputation of a micro-batch's checkpointed layers runs while its stage waits for that
micro-batch's output gradient (the pipeline bubble), not after the gradient has arrived.

Three patches:
* megatron.core.tensor_parallel.checkpoint (what TransformerBlock's full recompute calls): inside a
  pipeline schedule's forward_step it runs EarlyCheckpoint, which keeps its inputs and RNG states as
  Megatron's CheckpointFunction does and files a handle under the current micro-batch; outside one
  it is Megatron's own checkpoint;
* schedules.forward_step opens the micro-batch's group of handles;
* P2PCommunicator.send_forward_recv_backward / recv_backward post the receive of the gradient
  (Megatron's own p2p op, not waited on), rebuild the oldest micro-batch's layers (1F1B runs the
  backwards in forward order), then wait. Backward finds them rebuilt and only differentiates.

Every event goes to `record` (forward, recompute, gradient arrived, backward: per micro-batch), the
schedule's own account that the tests read. The rebuild reruns the same ops from the same inputs
and RNG states as CheckpointFunction.backward: the losses are those of the plain run.
"""
from __future__ import annotations

import functools

CHECKPOINT = "megatron.core.tensor_parallel.checkpoint"
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
P2P = "megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator"


class BubbleRecompute:
    """Micro-batches' pending rebuilds and the schedule's record. Provided as part
    "recompute_in_bubble"."""

    def __init__(self):
        self.record: list[tuple[str, int]] = []     # (event, micro-batch): F, R (rebuild), G (gradient in), B
        self.pending: list[tuple[int, list]] = []   # (micro-batch, its handles) awaiting backward, forward order
        self.open: list | None = None               # the handles of the forward_step running now
        self.forwards = 0

    def rebuild_oldest(self) -> None:
        for microbatch, handles in self.pending:
            if any(h.waiting for h in handles):
                for handle in handles:
                    handle.rebuild()
                self.record.append(("R", microbatch))
                return

    def forward_step(self, original, *args, **kwargs):
        import torch
        if not torch.is_grad_enabled():             # evaluation: no backward will follow
            return original(*args, **kwargs)
        handles: list = []
        self.open = handles
        try:
            out = original(*args, **kwargs)
        finally:
            self.open = None
        self.record.append(("F", self.forwards))
        self.pending.append((self.forwards, handles))
        self.forwards += 1
        return out

    def backward_step(self, original, *args, **kwargs):
        microbatch, handles = self.pending.pop(0)   # 1F1B: backwards in forward order
        if any(h.waiting for h in handles):
            self.record.append(("R", microbatch))     # no bubble before it (the last stage): in backward
        self.record.append(("B", microbatch))
        return original(*args, **kwargs)

    def checkpoint(self, original, function, distribute_saved_activations, *args):
        if self.open is None or distribute_saved_activations:
            return original(function, distribute_saved_activations, *args)
        handle = _Rebuild(function)
        self.open.append(handle)
        return _early_checkpoint_function().apply(handle, *args)

    def receive_gradient(self, communicator, output_tensors, tensor_shapes, send: bool):
        """send_forward_recv_backward (send=True) / recv_backward of a non-last stage, single tensor."""
        import torch
        from megatron.core.pipeline_parallel import p2p_communication as p2p
        config = communicator.config
        grad = torch.empty(tensor_shapes, requires_grad=True, dtype=config.pipeline_dtype,
                           device=torch.cuda.current_device())     # as Megatron's receive buffers
        ops = p2p._batched_p2p_ops if config.batch_p2p_comm else p2p._p2p_ops
        reqs = ops(tensor_send_prev=None, tensor_recv_prev=None, tensor_send_next=None, tensor_recv_next=grad,
                   group=communicator.pp_group, prev_pipeline_rank=communicator.prev_rank,
                   next_pipeline_rank=communicator.next_rank)
        if send:
            communicator.send_forward(output_tensors, False)
        self.rebuild_oldest()                           # the gradient is on its way: the bubble
        for req in reqs if isinstance(reqs, list) else reqs.values():
            req.wait()
        self.record.append(("G", self.pending[0][0] if self.pending else -1))
        return grad


class _Rebuild:
    """One checkpointed call: its function, inputs and RNG states; `outputs` once rebuilt."""

    def __init__(self, function):
        self.function, self.inputs, self.rng_states, self.outputs, self.detached = function, None, None, None, None

    @property
    def waiting(self) -> bool:
        """Forward done, not rebuilt yet, backward not run yet."""
        return self.outputs is None and self.inputs is not None

    def rebuild(self) -> None:
        import torch
        from megatron.core.tensor_parallel import random as mrandom
        if not self.waiting:
            return
        mrandom._set_checkpointing()
        with mrandom._fork_rng():
            mrandom._set_all_rng_states(*self.rng_states)
            self.detached = mrandom.detach_variable(self.inputs)
            with torch.enable_grad():
                outputs = self.function(*self.detached)
        mrandom._unset_checkpointing()
        self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs


@functools.lru_cache(maxsize=None)
def _early_checkpoint_function():
    """Megatron's CheckpointFunction with the rebuild split out (built once torch is imported)."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    class EarlyCheckpoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, handle, *args):
            mrandom._set_checkpointing()
            handle.rng_states = mrandom._get_all_rng_states()
            with torch.no_grad():
                outputs = handle.function(*args)
            ctx.save_for_backward(*args)            # kept for backward (and counted as saved)
            handle.inputs = args
            ctx.handle = handle
            mrandom._unset_checkpointing()
            return outputs

        @staticmethod
        def backward(ctx, *grads):
            handle = ctx.handle
            handle.inputs = ctx.saved_tensors
            handle.rebuild()
            mrandom._set_checkpointing()
            pairs = [(o, g) for o, g in zip(handle.outputs, grads) if torch.is_tensor(o) and o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            inputs_grad = tuple(t.grad if isinstance(t, torch.Tensor) else t for t in handle.detached)
            mrandom._unset_checkpointing()
            handle.inputs = handle.outputs = handle.detached = None
            return (None,) + inputs_grad
    return EarlyCheckpoint


def _wrap_receive(controller, send: bool):
    def wrap(original):
        @functools.wraps(original)
        def receive(self, tensors_or_shapes, *args, **kwargs):
            is_last_stage = args[-1] if args else kwargs["is_last_stage"]
            shapes = args[0] if send else tensors_or_shapes
            single = not isinstance(shapes, list) or len(shapes) == 1
            if is_last_stage or not single or self.config.use_ring_exchange_p2p:
                return original(self, tensors_or_shapes, *args, **kwargs)
            shape = shapes[0] if isinstance(shapes, list) else shapes
            output = tensors_or_shapes[0] if send and isinstance(tensors_or_shapes, list) else tensors_or_shapes
            grad = controller.receive_gradient(self, output if send else None, shape, send)
            return [grad] if isinstance(shapes, list) else grad
        return receive
    return wrap


def _stage_checkpoints(_config):
    from megatron.core import parallel_state as ps
    return None if ps.is_pipeline_last_stage() else True


def checkpoint_every_layer(patcher) -> None:
    """--recompute-in-bubble: every stage but the last runs Megatron's full recompute on all its
    layers (block method), set after TransformerConfig's own checks."""
    from mindspeed.features.fused import config_fields
    values = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": None}
    for field, value in values.items():
        config_fields.override(patcher, field, lambda config, v=value: (
            None if _stage_checkpoints(config) is None else (config.num_layers if v is None else v)),
            "--recompute-in-bubble: checkpoint the layers of the stages that wait for gradients")


def install(patcher) -> BubbleRecompute:
    controller = BubbleRecompute()
    reason = "--recompute-in-advance / --recompute-in-bubble"
    patcher.wrap(CHECKPOINT, lambda original: functools.partial(controller.checkpoint, original), reason=reason)
    patcher.wrap(f"{SCHEDULES}.forward_step", lambda original: functools.partial(controller.forward_step, original),
                 reason=reason)
    patcher.wrap(f"{SCHEDULES}.backward_step",
                 lambda original: functools.partial(controller.backward_step, original), reason=reason)
    patcher.wrap(f"{P2P}.send_forward_recv_backward", _wrap_receive(controller, True), reason=reason)
    patcher.wrap(f"{P2P}.recv_backward", _wrap_receive(controller, False), reason=reason)
    return controller
