"""--reuse-fp32-param on Megatron-Core's Float16OptimizerWithFloat16Params (--bf16): each bf16
parameter and its fp32 master copy share one 4-byte-per-element buffer, so the separate 2-byte bf16
copy is gone (6 bytes per bf16 parameter become 4).

The buffer has two layouts (`Folded`, shared with the distributed optimizer at data-parallel size 1,
reuse_fp32_param_distrib.py). Between updates ("bf16 layout") it holds [bf16 param | residual]: the
first half is the model's parameter (contiguous, what forward and backward read), the second half
the low 16 bits the bf16 value dropped. For the update ("fp32 layout") the halves are interleaved
back into the fp32 master (little-endian: low half first), which the torch optimizer updates in
place; the update's copy of the masters to the model's parameters becomes the split back. The
interleaving is in place, a block of at most FOLD_CHUNK pairs at a time (`fold`): no temporary
copy of a whole parameter.

The split rounds as upstream MindSpeed does: 0x8000 is added to the fp32 bit pattern, so the high
half is the master rounded to nearest with ties away from zero, and the low half keeps what is needed
to subtract it again: the master round-trips bit for bit. Megatron's own copy rounds ties to even, so
a bf16 parameter can differ in its last bit where a master's low 16 bits are exactly 0x8000 (no
32-bit encoding can give round-to-nearest-even bf16 and a lossless master: an even bf16 value has
65,537 fp32 values rounding to it). The masters are the same as without the flag until such a tie
first changes a forward pass.

Outside the update every reader of the masters gets fp32 values: state_dict/sharded_state_dict
(checkpoints) are given exact fp32 copies, load_state_dict runs in the fp32 layout and splits
again, and _copy_model_params_to_main_params (Megatron's reload_model_params after a model-only
load) clears the residuals, so the masters equal the loaded bf16 parameters as they would without
the flag.
"""
from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager

import torch

OPTIMIZER = "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params"
ROUND = 0x8000
RESIDUAL_ZERO = -0x8000          # 0x8000 as int16: the low half of an exact bf16 value, rounded
FOLD_CHUNK = 1 << 22             # pairs (un)interleaved at once: bounds fold's temporaries to 16 MiB
ATTACHED = weakref.WeakSet()     # every live SharedMasters / SharedShards (masters_readable for a params norm)


# -- the bit arithmetic: an fp32 master is (low half, high half) after adding 0x8000 -----------------

def join(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """(low, high) bf16 halves -> int32 bit patterns of the fp32 masters (a new tensor)."""
    bits = torch.stack((low, high), dim=1).view(torch.int32).view(-1)
    return bits.sub_(ROUND)


def split(values: torch.Tensor) -> torch.Tensor:
    """fp32 values -> their (low, high) bf16 halves as an [n, 2] tensor (a new one): the high half the
    value rounded to nearest, ties away from zero."""
    bits = values.detach().reshape(-1).float().clone().view(torch.int32).add_(ROUND)
    return bits.view(torch.bfloat16).view(-1, 2)


class Halves:
    """Masters held as `high` (the bf16 parameters) and `residual` (their low halves), read and written
    as exact fp32 values whatever else the storage holds."""
    high: torch.Tensor
    residual: torch.Tensor

    @torch.no_grad()
    def read(self, s: int, e: int) -> torch.Tensor:
        return join(self.residual[s:e], self.high[s:e]).view(torch.float32)

    @torch.no_grad()
    def write(self, s: int, e: int, values: torch.Tensor) -> None:
        halves = split(values)
        self.residual[s:e].copy_(halves[:, 0])
        self.high[s:e].copy_(halves[:, 1])

    @torch.no_grad()
    def clear_residual(self) -> None:
        """Masters := the bf16 values exactly."""
        self.residual.view(torch.int16).fill_(RESIDUAL_ZERO)


# -- the two layouts of one buffer, switched in place -------------------------------------------

def _swap(x: torch.Tensor, y: torch.Tensor, chunk: int) -> None:
    for s in range(0, x.numel(), chunk):
        t = x[s:s + chunk].clone()
        x[s:s + chunk].copy_(y[s:s + chunk])
        y[s:s + chunk].copy_(t)


def _move(buffer: torch.Tensor, src: int, dst: int, n: int, chunk: int) -> None:
    """buffer[dst:dst+n] := buffer[src:src+n] (overlapping), a chunk at a time, in the direction that
    reads each chunk before it is overwritten."""
    starts = range(0, n, chunk)
    for s in (reversed(starts) if dst > src else starts):
        e = min(s + chunk, n)
        buffer[dst + s:dst + e].copy_(buffer[src + s:src + e].clone())


def fold(buffer: torch.Tensor, chunk: int = FOLD_CHUNK) -> None:
    """[high halves (L) | low halves (L)] -> L (low, high) pairs, in place. Above `chunk` pairs: swap
    the middle quarters ([h' h'' | r' r''] -> [h' r' | h'' r'']) and fold each half (an odd L first
    moves one pair out front), so no temporary exceeds `chunk` pairs."""
    n = buffer.numel() // 2
    if n <= chunk:
        buffer.copy_(torch.stack((buffer[n:], buffer[:n]), dim=1).view(-1))
    elif n % 2:
        low = buffer[n:n + 1].clone()                 # [h0 h.. | r0 r..] -> [r0 h0 | h.. | r..]
        _move(buffer, 0, 1, n, chunk)
        buffer[:1].copy_(low)
        fold(buffer[2:], chunk)
    else:
        _swap(buffer[n // 2:n], buffer[n:n + n // 2], chunk)
        fold(buffer[:n], chunk)
        fold(buffer[n:], chunk)


def unfold(buffer: torch.Tensor, chunk: int = FOLD_CHUNK) -> None:
    """The inverse of fold: L (low, high) pairs -> [high halves | low halves], in place."""
    n = buffer.numel() // 2
    if n <= chunk:
        pairs = buffer.view(n, 2)
        buffer.copy_(torch.cat((pairs[:, 1], pairs[:, 0])))
    elif n % 2:
        unfold(buffer[2:], chunk)
        low = buffer[:1].clone()
        _move(buffer, 1, 0, n, chunk)
        buffer[n:n + 1].copy_(low)
    else:
        unfold(buffer[:n], chunk)
        unfold(buffer[n:], chunk)
        _swap(buffer[n // 2:n], buffer[n:n + n // 2], chunk)


class Folded(Halves):
    """A 2n-element bf16 buffer holding n bf16 parameters and their fp32 masters: [high | residual]
    between updates (bf16 layout), n fp32 masters (`fp32`, valid in the fp32 layout) for the update."""

    def __init__(self, buffer: torch.Tensor, chunk: int | None = None):
        n = buffer.numel() // 2
        assert buffer.dtype == torch.bfloat16 and buffer.dim() == 1 and buffer.numel() == 2 * n
        self.buffer, self.n, self.chunk = buffer, n, chunk or FOLD_CHUNK
        self.high, self.residual = buffer[:n], buffer[n:]
        self.fp32 = buffer.view(torch.float32)

    @torch.no_grad()
    def to_fp32(self) -> None:
        fold(self.buffer, self.chunk)
        self.buffer.view(torch.int32).sub_(ROUND)

    @torch.no_grad()
    def to_bf16(self) -> None:
        self.buffer.view(torch.int32).add_(ROUND)
        unfold(self.buffer, self.chunk)


class SharedMasters:
    """The shared buffers of one Float16 optimizer: (model param, master, Folded) per bf16 param."""

    def __init__(self, opt):
        self.opt = opt
        self.pairs = []
        with torch.no_grad():
            for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for model, main in zip(models, mains):
                    if model.dtype != torch.bfloat16:
                        continue
                    n = main.numel()
                    folded = Folded(torch.empty(2 * n, dtype=torch.bfloat16, device=main.device))
                    folded.write(0, n, main)
                    main.data = folded.fp32.view(main.shape)
                    model.data = folded.high.view(model.shape)
                    self.pairs.append((model, main, folded))
        self.fp32 = False

    # -- the two layouts ------------------------------------------------------------------
    def to_fp32(self) -> None:
        if not self.fp32:
            for _model, _main, folded in self.pairs:
                folded.to_fp32()
            self.fp32 = True

    def to_bf16(self) -> None:
        if self.fp32:
            for _model, _main, folded in self.pairs:
                folded.to_bf16()
            self.fp32 = False

    @torch.no_grad()
    def master_copies(self) -> dict:
        """id(master) -> an fp32 copy of it, read without changing the layout."""
        return {id(main): main.detach().clone() if self.fp32 else folded.read(0, folded.n).view(main.shape)
                for _model, main, folded in self.pairs}

    @contextmanager
    def masters_readable(self):
        """The masters (`param.main_param`, which Megatron-LM's params norm reads) hold their fp32 values
        inside: the buffers folded in place, split back (bit for bit) after; the bf16 parameters are not
        readable meanwhile."""
        with fp32_meanwhile(self):
            yield

    @torch.no_grad()
    def clear_residuals(self) -> None:
        """Masters := the bf16 parameters exactly (a model-only checkpoint load)."""
        self.to_bf16()
        for _model, _main, folded in self.pairs:
            folded.clear_residual()

    def bytes(self) -> int:
        """Storage of the bf16 parameters and their masters (each buffer once)."""
        return sum(folded.buffer.untyped_storage().nbytes() for _m, _p, folded in self.pairs)


@contextmanager
def fp32_meanwhile(shared):
    """`shared` (to_fp32 / to_bf16, its `fp32` state) in the fp32 layout for the block, back after if it was not."""
    switched = not shared.fp32
    shared.to_fp32()
    try:
        yield
    finally:
        if switched:
            shared.to_bf16()


def expand_before_step(opt, shared) -> None:
    """Mark opt as reusing (attach once) and let its inner optimizer step on fp32 masters: shared
    turns the buffers into fp32 first (the copy back to bf16 follows Megatron's own copy-out)."""
    opt.mindspeed_reuse = shared
    ATTACHED.add(shared)
    inner_step = opt.optimizer.step

    def step(closure=None):
        shared.to_fp32()
        return inner_step() if closure is None else inner_step(closure)
    opt.optimizer.step = step


def attach(opt) -> SharedMasters:
    shared = SharedMasters(opt)
    expand_before_step(opt, shared)

    def copy_main_to_model():
        shared.to_bf16()

    original_state_dict = opt.state_dict

    @functools.wraps(original_state_dict)
    def state_dict(*a, **kw):
        out = original_state_dict(*a, **kw)
        copies = shared.master_copies()
        out["fp32_from_fp16_params"] = [[copies.get(id(p), p) for p in group]
                                        for group in out["fp32_from_fp16_params"]]
        return out

    original_load = opt.load_state_dict

    @functools.wraps(original_load)
    def load_state_dict(state):
        shared.to_fp32()
        try:
            return original_load(state)
        finally:
            shared.to_bf16()

    def copy_model_to_main(state_dict=None):
        assert state_dict is None, "--reuse-fp32-param: masters from a state dict are not supported"
        shared.clear_residuals()

    opt._copy_main_params_to_model_params = copy_main_to_model
    opt._copy_model_params_to_main_params = copy_model_to_main
    opt.state_dict = state_dict
    opt.load_state_dict = load_state_dict
    return shared


def attach_after_init(patcher, optimizer_class: str, attach_fn, reason: str) -> None:
    """Wrap an optimizer class's __init__ so each new instance gets attach_fn(instance) once."""
    def wrap_init(original):
        @functools.wraps(original)
        def init(self, *a, **kw):
            original(self, *a, **kw)
            if not hasattr(self, "mindspeed_reuse"):
                attach_fn(self)
        return init

    patcher.wrap(optimizer_class + ".__init__", wrap_init, reason=reason)


def install(patcher) -> None:
    attach_after_init(patcher, OPTIMIZER, attach,
                      "--reuse-fp32-param: bf16 parameters and their fp32 masters share one buffer")


def parameter_and_master_bytes(model_chunks, optimizer) -> tuple[int, int, int]:
    """(bytes of the model's parameters, the optimizer's fp32 masters (master shards with the distributed
    optimizer) and --reuse-fp32-param's residuals, each storage counted once,
    elements of the bf16 parameters, elements of all parameters): what --reuse-fp32-param changes."""
    storages, bf16 = {}, 0
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    for p in params:
        storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
        bf16 += p.numel() if p.dtype == torch.bfloat16 else 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        masters = getattr(opt, "fp32_from_float16_groups", None) or getattr(opt, "shard_fp32_from_float16_groups", [])
        residuals = [sh.residual for sh in getattr(getattr(opt, "mindspeed_reuse", None), "buckets", {}).values()]
        for m in [m for group in masters for m in group] + residuals:
            storages[m.untyped_storage().data_ptr()] = m.untyped_storage().nbytes()
    return sum(storages.values()), bf16, sum(p.numel() for p in params)

