"""Full recompute (--recompute-granularity full) under --moe-fb-overlap: Megatron-Core's combined step
runs each layer as nodes (attn, moe_dispatch, mlp, moe_combine) and refuses full recompute. Here each
compute node of a recomputed layer runs under a non-reentrant checkpoint: its forward keeps only its
inputs, and its backward (in the combined step's slot, on the compute stream) recomputes it first. The
all-to-all nodes keep their outputs (they are the next node's inputs anyway), so no all-to-all runs twice
and the overlap's stream split stays as it is. The arithmetic is the same: the losses equal the run
without recompute bit for bit.

A node's recomputation sees the layer state its forward saw (the token dispatcher's routing state, the
layer's residual hand-offs): by the time it runs, another micro-batch's forward may have overwritten it.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter

WHY = "--recompute-granularity full under --moe-fb-overlap: each layer's compute nodes recompute in their backward"
CHUNK_PLAN = "megatron.core.models.common.model_chunk_schedule_plan.TransformerModelChunkSchedulePlan"
RECOMPUTED_NODES = ("attn", "mlp")       # the compute-stream nodes; the all-to-all nodes keep their outputs
COMM_NODES = ("moe_dispatch", "moe_combine")
log = logging.getLogger("mindspeed")


class SeenState:
    """Checkpoint context of a node's recomputation: the attributes its objects had when its forward
    began, put back for the recomputation; the present ones restored after it. The counters the forward
    added to (the router's tokens per expert, the aux-loss log) keep their values: Megatron's own full
    recompute counts a layer once too (its first pass runs without grad, which the router skips)."""

    def __init__(self, objects, counters, quiet):
        self.objects, self.counters, self.quiet = objects, counters, quiet
        self.seen = [dict(vars(obj)) for obj in objects]
        self.present = self.counted = None

    @staticmethod
    def _load(objects, states):
        for obj, state in zip(objects, states):
            vars(obj).clear()
            vars(obj).update(state)

    def __enter__(self):
        self.quiet()
        self.present = [dict(vars(obj)) for obj in self.objects]
        self.counted = [(tensor, tensor.clone()) for tensor in self.counters()]
        self._load(self.objects, self.seen)

    def __exit__(self, *exc):
        self._load(self.objects, self.present)
        for tensor, value in self.counted:
            tensor.copy_(value)
        self.present = self.counted = None
        return False


def _moe_layer(layer):
    mlp = getattr(getattr(layer, "transformer_layer", layer), "mlp", None)    # an MTP layer holds one
    return mlp if getattr(mlp, "token_dispatcher", None) is not None else None


def _state_objects(node, layer):
    """What a node's forward reads besides its inputs and writes for later nodes."""
    objects = [node, node.layer_state, node.chunk_state]     # the chunk state: MTP rolls its token ids there
    moe = _moe_layer(layer)
    return objects + [moe.token_dispatcher] if moe is not None else objects


def _counters(layer):
    def tensors():
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
        logged = [entry["values"] for entry in get_moe_layer_wise_logging_tracker().values()]
        moe = _moe_layer(layer)
        tokens = getattr(getattr(moe, "router", None), "local_tokens_per_expert", None)
        return logged + ([tokens] if tokens is not None else [])
    return tensors


class CommInFlight:
    """The MoE layers whose dispatch or combine forward is under way (on the side stream: fb_overlap.py):
    they read the token dispatcher's state, which a recomputation of the same layer (the other
    micro-batch's backward, at the middle layer of the combined step's pair) swaps, so it waits for them."""

    def __init__(self):
        self.layers, self.changed = Counter(), threading.Condition()

    def track(self, node, layer) -> None:
        submit, run = node.forward, node.forward_func

        def forward(*args):                   # the host thread, before the node goes to the side stream
            with self.changed:
                self.layers[id(layer)] += 1
            return submit(*args)

        def forward_func(*args):              # where it runs
            try:
                return run(*args)
            finally:
                with self.changed:
                    self.layers[id(layer)] -= 1
                    self.changed.notify_all()
        node.forward, node.forward_func = forward, forward_func

    def quiet(self, layer):
        def wait():
            with self.changed:
                self.changed.wait_for(lambda: not self.layers[id(layer)])
        return wait


def recompute_node(node, layer, in_flight: CommInFlight) -> None:
    """node's forward under a checkpoint; its inputs are kept (they are what the recomputation starts from)."""
    from contextlib import nullcontext

    from torch.utils.checkpoint import checkpoint
    forward = node.forward_func

    def recomputed_forward(*inputs):
        contexts = lambda: (nullcontext(), SeenState(_state_objects(node, layer), _counters(layer),  # noqa: E731
                                                     in_flight.quiet(layer)))
        return checkpoint(forward, *inputs, use_reentrant=False, context_fn=contexts)
    node.forward_func = recomputed_forward
    node.free_input = False


def recomputed(config, index: int, decoder: bool) -> bool:
    """Megatron's rule: uniform recomputes every layer, block the first recompute_num_layers of each
    chunk; the MTP layers recompute whenever full recompute is on (as Megatron's MTP block does)."""
    if config.recompute_granularity != "full":
        return False
    return not decoder or config.recompute_method != "block" or index < (config.recompute_num_layers or 0)


def _build_layers(original, in_flight: CommInFlight):
    def _build_layer_schedule_plan(self, module, comp_stream, comm_stream):
        first = len(self._transformer_layers)
        original(self, module, comp_stream, comm_stream)
        if module is None:
            return
        decoder = module is getattr(self._model_chunk_state.model, "decoder", None)
        for index, plan in enumerate(self._transformer_layers[first:]):
            if recomputed(plan.layer.config, index, decoder):
                for name in RECOMPUTED_NODES:
                    recompute_node(getattr(plan, name), plan.layer, in_flight)
                for name in COMM_NODES if _moe_layer(plan.layer) is not None else ():
                    in_flight.track(getattr(plan, name), plan.layer)
    return _build_layer_schedule_plan


def install(patcher, args) -> None:
    if args.recompute_granularity != "full":
        return
    if args.recompute_method == "uniform" and (args.recompute_num_layers or 1) > 1:
        log.info("MindSpeed: --recompute-num-layers %s under --moe-fb-overlap: the combined step recomputes "
                 "each layer on its own (its nodes), not %s layers as one group", args.recompute_num_layers,
                 args.recompute_num_layers)
    in_flight = CommInFlight()
    patcher.wrap(f"{CHUNK_PLAN}._build_layer_schedule_plan", lambda original: _build_layers(original, in_flight),
                 reason=WHY)
