"""Megatron's interleaved 1F1B (virtual pipeline, --num-layers-per-virtual-pipeline-stage) for the
MindSpore trainer, on two stages.

Each stage holds `chunks` model chunks; chunk c of stage r is virtual stage v = c x PP + r
(GPTConfig.chunk_layers), so every activation and gradient crosses to the other stage. Each stage
runs its forwards and backwards in Megatron-Core's order (schedules.py: the schedule table in groups
of PP micro-batches, warmup (PP - rank - 1) x 2 + (chunks - 1) x PP, then one forward and one
backward in turn; `megatron_order`), which needs the number of micro-batches to be a multiple of
PP, as Megatron-Core's own check does.

The transfers are pipeline.py's exchanges, which both stages make together (MindSpore 2.10 has no
point-to-point transfer on CPU). `exchange_plan` lines the two stages' orders up into ticks, the
same on both stages: in a tick each stage runs its next step if what it needs has arrived, then the
stages exchange what those steps made (a forward's activation or a backward's input gradient: one
tensor a stage at most, so one exchange a tick, none when neither stage sends). As in pipeline.py,
a forward keeps only its input, and the backward runs the chunk's forward again under
mindspore.vjp (PyNative keeps one pending backward graph per function); the last virtual stage
runs its backward with its forward (the loss is there), and sends the gradient at its backward's
place in the order.
"""
from __future__ import annotations

from mindspore import ops

from mindspeed.features.parallel.megatron_parallel import interleaved_micro_batch_problem
from mindspeed.training.mindspore.optimizer import accumulate
from mindspeed.training.mindspore.pipeline import TwoStagePipeline


def megatron_order(rank: int, pp: int, chunks: int, n: int) -> list:
    """Stage `rank`'s steps, ("F" or "B", chunk, micro-batch), in Megatron-Core's interleaved order."""
    table = [(mb, c) for first in range(0, n, pp) for c in range(chunks) for mb in range(first, first + pp)]
    total = n * chunks
    warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)
    forward = lambda k: ("F", table[k][1], table[k][0])
    backward = lambda k: ("B", chunks - 1 - table[k][1], table[k][0])
    steps = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [forward(warmup + k), backward(k)]
    return steps + [backward(k) for k in range(total - warmup, total)]


def exchange_plan(pp: int, chunks: int, n: int) -> list:
    """The ticks both stages follow: each a list over stages of (step or None, what it sends or None);
    what is sent is named by what it is for: ("in", virtual stage, micro-batch) the input of a forward
    (an activation), ("dout", virtual stage, micro-batch) the output gradient of a backward."""
    last = pp * chunks - 1
    orders = [megatron_order(r, pp, chunks, n) for r in range(pp)]
    done, arrived = [0] * pp, [set() for _ in range(pp)]
    ticks = []
    while any(done[r] < len(orders[r]) for r in range(pp)):
        tick = []
        for r in range(pp):
            step = orders[r][done[r]] if done[r] < len(orders[r]) else None
            if step is not None:
                kind, chunk, mb = step
                v = chunk * pp + r
                need = ("in", v, mb) if kind == "F" and v > 0 else ("dout", v, mb) if kind == "B" and v < last else None
                if need is not None and need not in arrived[r]:
                    step = None
            if step is None:
                tick.append((None, None))
                continue
            done[r] += 1
            sent = (("in", v + 1, mb) if v < last else None) if kind == "F" else (("dout", v - 1, mb) if v > 0 else None)
            tick.append((step, sent))
        if all(step is None for step, _ in tick):
            raise RuntimeError(f"interleaved schedule stalls (PP {pp}, {chunks} chunks, {n} micro-batches)")
        for _, sent in tick:
            if sent is not None:
                arrived[sent[1] % pp].add(sent)
        ticks.append(tick)
    return ticks


class InterleavedPipeline(TwoStagePipeline):
    """TwoStagePipeline's exchanges, with `model.cfg.virtual_chunks` model chunks per stage."""

    def __init__(self, backend, ps, model, variable_lengths: bool = False, extras: tuple = ()):
        super().__init__(backend, ps, model, variable_lengths, extras)
        self.chunks = model.cfg.virtual_chunks
        self._plans = {}

    def _virtual(self, chunk: int) -> int:
        return chunk * self.ps.pp_size + self.ps.pp_rank

    def train(self, micro_batches: list, loss_scale=None) -> tuple:
        """As TwoStagePipeline.train, in the interleaved order."""
        n, b = len(micro_batches), micro_batches[0]["tokens"].shape[0]
        pp, me, last = self.ps.pp_size, self.ps.pp_rank, self.ps.pp_size * self.chunks - 1
        problem = interleaved_micro_batch_problem(n, pp)
        if problem:
            raise ValueError(problem)
        if n not in self._plans:
            self._plans[n] = exchange_plan(pp, self.chunks, n)
        self._grads, self._losses, self._n, self._scale = None, [], n, loss_scale
        inbox, kept, sends = {}, {}, {}     # received tensors; forward inputs; the last stage's input gradients
        for tick in self._plans[n]:
            (step, _), (_, theirs) = tick[me], tick[self.peer]
            mine = None
            if step is not None:
                kind, chunk, m = step
                mine = self._run(kind, chunk, micro_batches[m], m, inbox, kept, sends, self._virtual(chunk) == last)
            if mine is not None or theirs is not None:
                received = self._exchange(mine, b)
                if theirs is not None:
                    inbox[theirs] = received
        return self._grads, self._losses

    def _run(self, kind, chunk, mb, m, inbox, kept, sends, last: bool):
        """One step; returns what it sends (None: nothing)."""
        v = self._virtual(chunk)
        if kind == "F":
            hidden = inbox.pop(("in", v, m)) if v > 0 else None
            if last:       # the loss is here: its backward now, the gradient sent at the backward's place
                sends[m] = self._backward(hidden, mb, chunk, None)
                return None
            kept[(chunk, m)] = hidden
            return self._stage(hidden, mb, chunk)     # no graph kept
        if last:
            return sends.pop(m)
        d_hidden = self._backward(kept.pop((chunk, m)), mb, chunk, inbox.pop(("dout", v, m)))
        return d_hidden if v > 0 else None

    def _backward(self, hidden, mb, chunk, d_output):
        """The chunk's forward under vjp, then its backward from d_output (None: from the loss) ->
        the gradient of its input; the weight gradients are accumulated."""
        out, vjp_fn = self._forward(hidden, mb, chunk)
        if d_output is None:
            self._losses.append(out)
            d_output = ops.ones_like(out) if self._scale is None else ops.ones_like(out) * self._scale
        (d_hidden,), g = vjp_fn(d_output)
        self._grads = accumulate(self._grads, g, self._n)
        return d_hidden

    def evaluate(self, micro_batches: list) -> list:
        """Forward only, each micro-batch through the virtual stages in turn -> the losses on the last stage."""
        pp, last, losses = self.ps.pp_size, self.ps.pp_size * self.chunks - 1, []
        for mb in micro_batches:
            b, hidden = mb["tokens"].shape[0], None
            for v in range(last + 1):
                out = None
                if v % pp == self.ps.pp_rank:
                    out = self._stage(hidden, mb, v // pp)
                    if v == last:
                        losses.append(out)
                if v < last:
                    hidden = self._exchange(out, b)
        return losses
