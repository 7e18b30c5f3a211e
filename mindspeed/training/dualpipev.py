"""DualPipeV's executor on the torch trainer: runs one rank's program (features/parallel/
dualpipev_schedule.py + schedule_sim.with_transfers) with Megatron-Core's model chunks, its
forward_step/backward_step, and point-to-point messages on the pipeline group.

Chunk 0 of rank r is the V's stage r, chunk 1 its stage 2PP-1-r (model.py builds them so: the
embedding on rank 0's chunk 0, the output layer and the loss on its chunk 1). Activations and
gradients travel with a tag each: the schedule pairs each channel's Sends and Recvs in order
(checked by schedule_sim.run_programs), which is what gloo needs. A deferred backward ("Bi")
computes the input gradient only (autograd restricted to the chunk's input); its "W" later walks the
same graph again for the weight gradients alone, so on a CPU it costs a second backward of the chunk:
what the schedule wins is the order, measured in slots by the benchmark, not time here.

With --moe-fb-overlap (config.overlap_moe_expert_parallel_comm) every forward and backward runs
through Megatron-Core's combined forward-backward step (the schedule plan's nodes), and each forward
followed by another micro-batch's backward runs with it as one step (schedule_sim.fb_overlapped):
one micro-batch's dispatch/combine all-to-alls under the other's attention/expert compute, as
upstream MindSpeed overlaps the V's F0-B1 and F1-B0 slots. The plan's backward computes the weight
gradients too, so nothing is deferred there.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step
from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
from megatron.core.pipeline_parallel.utils import set_streams
from megatron.core.utils import get_model_config, get_model_type

from mindspeed.features.parallel.dualpipev_schedule import Work, dualpipev_order, v_stage
from mindspeed.features.parallel.schedule_sim import Pair, Recv, Send, fb_overlapped, v_layout, with_transfers

TAGS = {"act": 1, "grad": 2}


def forward_only_order(num_microbatches: int) -> list[Work]:
    """Evaluation: every micro-batch down chunk 0, then back up chunk 1 (no backward to interleave)."""
    return [Work("F", c, m) for c in (0, 1) for m in range(num_microbatches)]


class DualPipeVSchedule:
    """Megatron-Core's forward_backward_func signature, running DualPipeV's program of this rank."""

    def __init__(self, dw_detach: bool = False):
        self.dw_detach = dw_detach

    def __call__(self, forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                 decoder_seq_length=None, forward_only=False, **_):
        run = _Run(model, data_iterator, forward_step_func, num_microbatches, forward_only,
                   (seq_length, micro_batch_size))
        order = forward_only_order(num_microbatches) if forward_only else \
            dualpipev_order(run.pp, num_microbatches, run.rank, self.dw_detach)
        program = with_transfers(v_layout(run.pp), run.rank, order)
        if run.combined:
            set_streams()
            program = fb_overlapped(program)
        for item in program:
            run.do(item)
        return run.finish()


class _Run:
    """One step's state on this rank: the chunks' saved tensors, the messages in flight."""

    def __init__(self, model, data_iterator, forward_step_func, num_microbatches, forward_only, shape):
        self.model, self.iterators, self.step_func = model, data_iterator, forward_step_func
        self.n, self.forward_only = num_microbatches, forward_only
        self.config = get_model_config(model[0])
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.pp, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.peers = dist.get_process_group_ranks(self.group)
        self.shape = (*shape, self.config.hidden_size)
        self.dtype = self.config.pipeline_dtype or self.config.params_dtype
        self.inputs, self.outputs, self.grads = {}, {}, {}   # (chunk, mb) -> tensor
        self.turn = {}                                       # mb -> chunk 0's output on the last rank
        self.sends, self.store, self.tokens = [], [], 0
        self.combined = bool(self.config.overlap_moe_expert_parallel_comm) and not forward_only

    def do(self, item) -> None:
        if isinstance(item, Recv):
            buf = torch.empty(self.shape, dtype=self.dtype, device=self._device())
            dist.recv(buf, self.peers[item.peer], group=self.group, tag=TAGS[item.what])
            self._arrived(item, buf)
        elif isinstance(item, Send):
            key = self._sender_key(item)
            tensor = (self.outputs[key] if item.what == "act" else self.grads.pop(key)).contiguous()
            self.sends.append((dist.isend(tensor, self.peers[item.peer], group=self.group,
                                          tag=TAGS[item.what]), tensor))
        elif isinstance(item, Pair):
            self._combined(*item)
        elif self.combined:
            self._combined(*((item, None) if item.kind == "F" else (None, item)))
        elif item.kind == "F":
            self._forward(item)
        else:
            getattr(self, "_" + item.kind.lower())(item)

    def _device(self):
        return next(self.model[0].parameters()).device

    def _stage(self, chunk: int) -> int:
        return v_stage(self.pp, self.rank, chunk)

    def _sender_key(self, send: Send):
        """The tensor a Send carries: the output of the stage below the receiver, or the input
        gradient of the stage above it (both held by this rank's chunk of that stage)."""
        stage = send.stage - 1 if send.what == "act" else send.stage + 1
        chunk = 0 if stage == self.rank else 1
        return (chunk, send.mb)

    def _arrived(self, recv: Recv, buf) -> None:
        chunk = 0 if recv.stage == self.rank else 1
        if recv.what == "act":
            self.inputs[(chunk, recv.mb)] = buf.requires_grad_(not self.forward_only)
        else:
            self.grads[("out", chunk, recv.mb)] = buf

    def _forward_input(self, work: Work):
        key = (work.chunk, work.mb)
        if self._stage(work.chunk) == self.pp:     # the V's turn: chunk 0's output on this rank, as a new leaf
            self.inputs[key] = self.turn.pop(work.mb).detach().requires_grad_(not self.forward_only)
        return self.inputs.get(key)

    def _forward(self, work: Work) -> None:
        output, tokens = forward_step(
            self.step_func, self.iterators[work.chunk], self.model[work.chunk], self.n, self._forward_input(work),
            self.store, self.config, parallel_state.get_context_parallel_world_size(),
            is_first_microbatch=work.mb == 0, current_microbatch=work.mb,
            is_last_stage=self._stage(work.chunk) == 2 * self.pp - 1)
        self._forward_done(work, output, tokens)

    def _forward_done(self, work: Work, output, tokens) -> None:
        key = (work.chunk, work.mb)
        self.tokens += int(tokens)
        self.outputs[key] = output
        if self._stage(work.chunk) == self.pp - 1:
            self.turn[work.mb] = output
        if self.forward_only:
            self.inputs.pop(key, None)

    def _combined(self, f: Work | None, b: Work | None) -> None:
        """Megatron-Core's combined step: f's forward and b's backward (either may be None) through
        their schedule plans, each one's all-to-alls under the other's compute."""
        f_input = self._forward_input(f) if f else None
        b_key = b and (b.chunk, b.mb)
        b_tensors = (self.inputs.pop(b_key, None), self.outputs.pop(b_key), self._output_grad(b)) if b else \
            (None, None, None)
        output, tokens, in_grad = combined_forward_backward_step(
            self.step_func, f and self.iterators[f.chunk], f and self.model[f.chunk], self.n, f_input, self.store,
            b and self.model[b.chunk], *b_tensors, self.config, f_model_chunk_id=f and f.chunk,
            is_first_microbatch=bool(f) and f.mb == 0, current_microbatch=f and f.mb)
        if f:
            self._forward_done(f, output, tokens)
        if b:
            self._keep_input_grad(b, in_grad)

    def _output_grad(self, work: Work):
        """The gradient of the chunk's output: received, the turn's (chunk 1's input gradient on the
        last rank), or None for the loss."""
        stage = self._stage(work.chunk)
        if stage == 2 * self.pp - 1:
            return None
        if stage == self.pp - 1:
            return self.grads.pop((1, work.mb))
        return self.grads.pop(("out", work.chunk, work.mb))

    def _b(self, work: Work) -> None:
        key = (work.chunk, work.mb)
        grad = backward_step(self.inputs.pop(key, None), self.outputs.pop(key), self._output_grad(work),
                             get_model_type(self.model[work.chunk]), self.config)
        self._keep_input_grad(work, grad)

    def _bi(self, work: Work) -> None:
        """The input gradient only; the output and its gradient stay for the W."""
        key = (work.chunk, work.mb)
        output, grad_out = self.outputs[key], self._output_grad(work)
        if grad_out is None:            # the loss, scaled as Megatron's backward_step does (kept for the W)
            if self.config.grad_scale_func is not None:
                output = self.outputs[key] = self.config.grad_scale_func(output)
            grad_out = torch.ones_like(output)
        self.grads[("w", work.chunk, work.mb)] = grad_out
        source = self.inputs.pop(key, None)
        if source is not None:
            (in_grad,) = torch.autograd.grad(output, source, grad_out, retain_graph=True)
            self._keep_input_grad(work, in_grad)

    def _w(self, work: Work) -> None:
        key = (work.chunk, work.mb)
        params = [p for p in self.model[work.chunk].parameters() if p.requires_grad]
        torch.autograd.backward(self.outputs.pop(key), self.grads.pop(("w", work.chunk, work.mb)), inputs=params)

    def _keep_input_grad(self, work: Work, grad) -> None:
        if grad is not None:
            self.grads[(work.chunk, work.mb)] = grad

    def finish(self) -> list:
        for handle, _ in self.sends:
            handle.wait()
        if not self.forward_only and self.config.finalize_model_grads_func is not None:
            tokens = torch.tensor(self.tokens, device=self._device()) if self.config.calculate_per_token_loss \
                else None
            self.config.finalize_model_grads_func(self.model, tokens)
        return self.store
