"""--reuse-fp32-param on Megatron-Core's Float16OptimizerWithFloat16Params (--bf16): each bf16
parameter and its fp32 master copy share one 4-byte-per-element buffer, so the separate 2-byte bf16
copy is gone (6 bytes per bf16 parameter become 4).

The buffer has two layouts. Between updates ("bf16 layout") it holds [residual | bf16 param]: the
second half is the model's parameter (contiguous, what forward and backward read), the first half
the low 16 bits the bf16 value dropped. For the update ("fp32 layout") the halves are interleaved
back into the fp32 master (little-endian: low half first), which the torch optimizer updates in
place; the update's copy of the masters to the model's parameters becomes the split back.

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

import torch

OPTIMIZER = "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params"
ROUND = 0x8000
RESIDUAL_ZERO = -0x8000          # 0x8000 as int16: the low half of an exact bf16 value, rounded


class SharedMasters:
    """The shared buffers of one Float16 optimizer: (model param, master, buffer) per bf16 param."""

    def __init__(self, opt):
        self.opt = opt
        self.pairs = []
        with torch.no_grad():
            for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for model, main in zip(models, mains):
                    if model.dtype != torch.bfloat16:
                        continue
                    n = main.numel()
                    buffer = torch.empty(2 * n, dtype=torch.bfloat16, device=main.device)
                    buffer.view(torch.float32).copy_(main.detach().reshape(-1))
                    main.data = buffer.view(torch.float32).view(main.shape)
                    model.data = buffer[n:].view(model.shape)
                    self.pairs.append((model, main, buffer))
        self.fp32 = True
        self.to_bf16()

    # -- the two layouts ------------------------------------------------------------------
    @torch.no_grad()
    def to_fp32(self) -> None:
        if self.fp32:
            return
        for _model, _main, buffer in self.pairs:
            n = buffer.numel() // 2
            buffer.copy_(buffer.view(2, n).t().reshape(-1))       # [res | hi] -> (res, hi) pairs
            buffer.view(torch.int32).sub_(ROUND)
        self.fp32 = True

    @torch.no_grad()
    def to_bf16(self) -> None:
        if not self.fp32:
            return
        for _model, _main, buffer in self.pairs:
            n = buffer.numel() // 2
            buffer.view(torch.int32).add_(ROUND)
            buffer.copy_(buffer.view(n, 2).t().reshape(-1))       # (res, hi) pairs -> [res | hi]
        self.fp32 = False

    @torch.no_grad()
    def master_copies(self) -> dict:
        """id(master) -> an fp32 copy of it, read without changing the layout."""
        out = {}
        for _model, main, buffer in self.pairs:
            if self.fp32:
                out[id(main)] = main.detach().clone()
                continue
            n = buffer.numel() // 2
            pairs = buffer.view(2, n).t().contiguous()
            pairs.view(torch.int32).sub_(ROUND)
            out[id(main)] = pairs.view(torch.float32).view(main.shape)
        return out

    @torch.no_grad()
    def clear_residuals(self) -> None:
        """Masters := the bf16 parameters exactly (a model-only checkpoint load)."""
        self.to_bf16()
        for _model, _main, buffer in self.pairs:
            n = buffer.numel() // 2
            buffer[:n].view(torch.int16).fill_(RESIDUAL_ZERO)

    def bytes(self) -> int:
        """Storage of the bf16 parameters and their masters (each buffer once)."""
        return sum(buffer.untyped_storage().nbytes() for _m, _p, buffer in self.pairs)


def expand_before_step(opt, shared) -> None:
    """Mark opt as reusing (attach once) and let its inner optimizer step on fp32 masters: shared
    turns the buffers into fp32 first (the copy back to bf16 follows Megatron's own copy-out)."""
    opt.mindspeed_reuse = shared
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

