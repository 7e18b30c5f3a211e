"""Megatron-Core hook of --adaptive-recompute-device-size (torch backend).

Every TransformerLayer built after adapt() gets an instance forward routed through one
AdaptiveRecompute (layer_init.py's construction hook). For the first --adaptive-recompute-profiling-step
steps the layers run as they are and each forward is measured: the bytes it saves for backward
(unique storages, sized when it returns, its parameters and the model-wide tensors it is handed
left out), its input's bytes (what a checkpoint keeps) and its time. At the end of that step the
plan is chosen (adaptive_recompute_plan.choose_layers) and from the next step on the chosen layers
run under Megatron-Core's own activation checkpoint (tensor_parallel.checkpoint, as
--recompute-granularity full does), the others keep their activations. Recompute reruns the same
ops on the same inputs with the same RNG state: the losses are those of the plain run.
"""
from __future__ import annotations

import functools
import logging
import time

from mindspeed.features.base import TRAIN_STEP_END
from mindspeed.features.memory import layer_init
from mindspeed.features.memory.adaptive_recompute_plan import LayerProfile, RecomputePlan, choose_layers

log = logging.getLogger("mindspeed")
MB = 1 << 20


class AdaptiveRecompute:
    """The profile, the plan and the layers' forward. Provided to the trainer as part
    "adaptive_recompute" (tests and benchmarks read `plan` and `profiles`)."""

    def __init__(self, budget_mb: int, profiling_steps: int):
        self.budget_bytes, self.profiling_steps = budget_mb * MB, profiling_steps
        self.steps, self.forwards = 0, 0             # profiled steps, first-layer forwards in them
        self.layers: list = []
        self.measured: dict = {}                     # layer index -> [held, checkpoint, seconds, calls]
        self.plan: RecomputePlan | None = None

    # construction ------------------------------------------------------------------------------
    def adopt(self, layer, _arguments) -> None:
        index = len(self.layers)
        self.layers.append(layer)
        layer.forward = functools.partial(self._forward, index, layer.forward)

    # the layers' forward -----------------------------------------------------------------------
    def _forward(self, index, original, *args, **kwargs):
        import torch
        if not (torch.is_grad_enabled() and self.layers[index].training):
            return original(*args, **kwargs)          # evaluation: nothing is held for backward
        if self.plan is None:
            return self._profiled(index, original, args, kwargs)
        if index in self.plan.recompute:
            return _checkpointed(self.layers[index], original, args, kwargs)
        return original(*args, **kwargs)

    def _profiled(self, index, original, args, kwargs):
        import torch
        storages = {}

        def pack(t):
            s = t.untyped_storage()
            storages.setdefault(s._cdata, s)
            return t
        hidden = args[0] if args else kwargs["hidden_states"]
        _settle(hidden)
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = original(*args, **kwargs)
        _settle(hidden)
        seconds = time.perf_counter() - start
        shared = [v for k, v in kwargs.items() if k != "hidden_states" and torch.is_tensor(v)]
        skip = {t.untyped_storage()._cdata for t in [*self.layers[index].parameters(), *shared]}
        held = sum(s.nbytes() for k, s in storages.items() if k not in skip)
        record = self.measured.setdefault(index, [0, 0, 0.0, 0])
        record[0], record[1] = max(record[0], held), max(record[1], hidden.untyped_storage().nbytes())
        record[2], record[3] = record[2] + seconds, record[3] + 1
        self.forwards += index == 0
        return out

    # the plan ----------------------------------------------------------------------------------
    @property
    def profiles(self) -> list[LayerProfile]:
        return [LayerProfile(i, held, kept, seconds / calls)
                for i, (held, kept, seconds, calls) in sorted(self.measured.items())]

    def on_step_end(self, **_info) -> None:
        if self.plan is not None or not self.measured:
            return
        self.steps += 1
        if self.steps < self.profiling_steps:
            return
        in_flight = _in_flight(self.forwards // self.steps)
        self.plan = choose_layers(self.profiles, self.budget_bytes, in_flight)
        held = sum(p.held_bytes for p in self.profiles) * in_flight
        log.warning("MindSpeed: adaptive recompute after %d profiled steps: %d of %d layers recompute "
                    "(%s), the layers hold %.1f MB for backward instead of %.1f MB (%d micro-batches in "
                    "flight), budget %.1f MB%s", self.steps, len(self.plan.recompute), len(self.measured),
                    ",".join(map(str, sorted(self.plan.recompute))) or "none", self.plan.held_bytes / MB,
                    held / MB, in_flight, self.budget_bytes / MB,
                    "" if self.plan.fits else ": does not fit even with every layer recomputed")


def _settle(tensor) -> None:
    """An accelerator runs kernels asynchronously: wait for them so the layer's time is its own."""
    import torch
    if tensor.device.type != "cpu":
        torch.accelerator.synchronize(tensor.device)


def _in_flight(microbatches: int) -> int:
    """Micro-batches whose activations one stage holds at once: 1F1B keeps PP - rank in its warm-up."""
    from megatron.core import parallel_state as ps
    size = ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if size <= 1:
        return 1
    return max(1, min(microbatches, size - ps.get_pipeline_model_parallel_rank()))


def _checkpointed(layer, original, args, kwargs):
    """The layer under Megatron-Core's checkpoint: its tensor arguments are the checkpoint's inputs
    (kept), the rest (packed-sequence parameters, None) is closed over."""
    import torch
    from megatron.core import tensor_parallel
    kwargs = dict(kwargs)
    hidden, rest = (args[0], args[1:]) if args else (kwargs.pop("hidden_states"), ())
    names = [k for k, v in kwargs.items() if torch.is_tensor(v)]
    others = {k: v for k, v in kwargs.items() if k not in names}

    def run(hidden_states, *tensors):
        return original(hidden_states, *rest, **others, **dict(zip(names, tensors)))
    return tensor_parallel.checkpoint(run, layer.config.distribute_saved_activations, hidden,
                                      *(kwargs[n] for n in names))


def install(ctx, args) -> AdaptiveRecompute:
    controller = AdaptiveRecompute(args.adaptive_recompute_device_size, args.adaptive_recompute_profiling_step)
    layer_init.add_hook(ctx.patcher, controller.adopt, "--adaptive-recompute-device-size: profile, then "
                        "recompute the layers the budget needs")
    ctx.subscribe(TRAIN_STEP_END, controller.on_step_end)
    ctx.provide("adaptive_recompute", controller)
    return controller
