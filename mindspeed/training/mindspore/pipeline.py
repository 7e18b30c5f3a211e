"""Megatron's 1F1B pipeline schedule for the MindSpore trainer, on two stages.

Each stage runs its slice of the GPT (GPTModel.stage_forward); stage 1 returns the gradient of
its input activation (mindspore.vjp), stage 0 runs its backward from it. Stage 0 keeps only its
micro-batches between its forward and its backward and runs the forward again under vjp when
the gradient arrives (stage 0's layers recomputed, as full recompute would): PyNative keeps one
pending backward graph per function, and a second forward under vjp before the first one's
backward, which 1F1B's warmup does, made the first backward fail or silently use the wrong graph
(measured on 2.10).

MindSpore 2.10 has no point-to-point transfer on CPU (measured under msrun: mint.distributed.send
looks up a group "hccl_world_group" that does not exist there, batch_isend_irecv and comm_func's
isend have no CPU kernel), so MsComm.send_recv is a collective exchange both stages must call
together. With two stages 1F1B lines up into such exchanges (n micro-batches, n + 1 exchanges):

    stage 0:  F0 | x(y0)   | F1 x(y1, dy0) B0 | ... | F(n-1) x(y(n-1), dy(n-2)) B(n-2) | x(dy(n-1)) B(n-1)
    stage 1:     | x(-> x0) | F0 B0 x(dx0, x1) | ... | F(n-2) B(n-2) x(dx(n-2), x(n-1))  | F(n-1) B(n-1) x(dx(n-1))

where x(...) is one exchange: stage 0 sends its forward output and receives a gradient while
stage 1 sends its input gradient and receives the next input (Megatron's send_forward_recv_backward
paired with send_backward_recv_forward); warmup is PP - rank - 1 forwards, as in Megatron.

--variable-seq-lengths (micro-batches of their own lengths): as Megatron's stages communicate
tensor shapes first, each exchange starts with one of the two tensors' sequence lengths; then both
send theirs padded to the longer (the exchange takes one shape) and each keeps the peer's length.

--reset-attention-mask / --reset-position-ids: every stage has the micro-batch, so each builds its
layers' document mask (and the first stage its per-sample positions) from it; only activations travel.
"""
from __future__ import annotations

from collections import deque

import mindspore as ms
from mindspore import ops

from mindspeed.training.mindspore.model import Extras
from mindspeed.training.mindspore.optimizer import accumulate


def _inputs(mb: dict) -> tuple:
    return ms.Tensor(mb["tokens"]), ms.Tensor(mb["labels"]), ms.Tensor(mb["loss_mask"])


def _extras(mb: dict, names: tuple) -> Extras:
    """The Extras `names` of micro-batch mb (the documents' mask, per-sample positions) as tensors."""
    of_batch = {"attention_mask": mb.get("attention_mask"), "embed_positions": mb.get("position_ids")}
    return Extras(**{name: ms.Tensor(of_batch[name]) for name in names})


class TwoStagePipeline:
    def __init__(self, backend, ps, model, variable_lengths: bool = False, extras: tuple = ()):
        """extras: the names of the Extras each micro-batch gives the stages (no dropout masks: refused
        with PP)."""
        if ps.pp_size != 2:
            raise ValueError(f"the MindSpore 1F1B schedule runs 2 pipeline stages, not {ps.pp_size}")
        self.comm, self.ps, self.model = backend.comm, ps, model
        self.weights = model.parameters()
        self.peer = 1 - ps.pp_rank
        cfg = model.cfg
        self._seq = cfg.seq_length // (ps.tp_size if ps.sequence_parallel else 1)
        self._hidden = cfg.hidden_size
        self._dtype = model.dtype          # the activations' (fp16 with --fp16)
        self._nothing = ms.Tensor(0.0, ms.float32)     # stage 0's input: it embeds the tokens itself
        self._variable = variable_lengths
        self._extra_names = extras

    def _exchange(self, send, batch_size: int):
        """Both stages at once: `send` (None: nothing, zeros go) to the other stage; returns its tensor."""
        if self._variable:
            return self._exchange_lengths_first(send, batch_size)
        if send is None:
            send = ops.zeros((self._seq, batch_size, self._hidden), self._dtype)
        return self._swap(send)

    def _swap(self, send):
        received, handle = self.comm.send_recv(send, dst=self.peer, src=self.peer, group=self.ps.pp_group)
        handle.wait()
        return received

    def _exchange_lengths_first(self, send, batch_size: int):
        """The sequence lengths first (0: nothing to send), then the tensors padded to the longer;
        returns the peer's tensor at its own length (None when it sent nothing)."""
        mine = 0 if send is None else send.shape[0]
        theirs = int(self._swap(ms.Tensor([mine], ms.float32)).asnumpy()[0])
        longest = max(mine, theirs)
        if longest == 0:
            return None
        if longest > mine:     # MindSpore's CPU kernels take no empty tensor: pad only what is short
            pad = ops.zeros((longest - mine, batch_size, self._hidden), self._dtype)
            send = pad if send is None else ops.cat((send, pad))
        received = self._swap(send)
        return received[:theirs] if theirs else None

    def _stage(self, hidden, mb, chunk: int = 0):
        """Model chunk `chunk` of this stage on micro-batch mb (model.stage_forward)."""
        return self.model.stage_forward(hidden, *_inputs(mb), chunk, _extras(mb, self._extra_names))

    def _forward(self, hidden, mb, chunk: int = 0):
        """(output, its vjp): the loss on stage 1, the activation for stage 1 on stage 0 (of model
        chunk `chunk` with a virtual pipeline)."""
        fn = lambda h: self._stage(h, mb, chunk)
        return ms.vjp(fn, self._nothing if hidden is None else hidden, weights=self.weights)

    def _first_stage_grads(self, mb, d_output):
        """Stage 0's weight gradients for micro-batch mb, given the gradient of its output."""
        _, vjp_fn = self._forward(None, mb)
        return vjp_fn(d_output)[1]

    def train(self, micro_batches: list, loss_scale=None) -> tuple:
        """Forward and backward over the global batch's micro-batches -> (the weight gradients,
        averaged over micro-batches as Megatron does; the micro-batch losses, on the last stage).
        loss_scale (--fp16, a 0-d tensor): the backward starts from it instead of 1."""
        n, b = len(micro_batches), micro_batches[0]["tokens"].shape[0]
        grads, losses = None, []
        if self.ps.first_stage:
            pending = deque()
            for mb in micro_batches:
                out = self._stage(None, mb)     # no graph kept (see above)
                dy = self._exchange(out, b)        # first one: only sends (warmup forward)
                if pending:
                    grads = accumulate(grads, self._first_stage_grads(pending.popleft(), dy), n)
                pending.append(mb)
            dy = self._exchange(None, b)           # cooldown: the last micro-batch's gradient
            grads = accumulate(grads, self._first_stage_grads(pending.popleft(), dy), n)
        else:
            hidden = self._exchange(None, b)
            for mb in micro_batches:
                loss, vjp_fn = self._forward(hidden, mb)
                seed = ops.ones_like(loss) if loss_scale is None else ops.ones_like(loss) * loss_scale
                (d_hidden,), g = vjp_fn(seed)
                losses.append(loss)
                grads = accumulate(grads, g, n)
                hidden = self._exchange(d_hidden, b)   # the next input (unused after the last)
        return grads, losses

    def evaluate(self, micro_batches: list) -> list:
        """Forward only: each micro-batch's loss on the last stage (empty on the first)."""
        losses = []
        for mb in micro_batches:
            b = mb["tokens"].shape[0]
            if self.ps.first_stage:
                self._exchange(self._stage(None, mb), b)
            else:
                losses.append(self._stage(self._exchange(None, b), mb))
        return losses
