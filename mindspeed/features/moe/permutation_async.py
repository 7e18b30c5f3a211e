"""The Megatron-Core hook of --moe-permutation-async-comm.

allgather dispatcher: token_dispatch starts the three all-gathers over the TP x EP group (routing
map, probabilities, hidden states) at once and returns; dispatch_postprocess waits for the routing
map first and computes the local map, the tokens-per-expert count (a device-to-host copy on an
accelerator) and the local probabilities while the hidden states are still on their way, then
waits for them and permutes. alltoall dispatcher: the tokens' and the probabilities' all-to-alls
are started together instead of one after the other.

Gradients: an all-gather's adjoint is a reduce-scatter, an all-to-all's the reverse all-to-all,
as in Megatron's own collectives.
"""
from __future__ import annotations

import functools

from mindspeed.features.moe.async_comm import computing, finish, started

DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
WHY = "--moe-permutation-async-comm: dispatcher collectives started asynchronously"


def as_list(splits) -> list[int]:
    return [int(s) for s in (splits.tolist() if hasattr(splits, "tolist") else splits)]


def _allgather_dispatch(original, comm):
    def token_dispatch(self, hidden_states, probs):
        if self.tp_size == 1 and self.ep_size == 1:
            return original(self, hidden_states, probs)
        group = self.tp_ep_group
        self._async_gathers = (started(comm.all_gather_async(self.routing_map, 0, group)),
                               started(comm.all_gather_async(probs.detach(), 0, group)),
                               started(comm.all_gather_async(hidden_states.detach(), 0, group)))
        return hidden_states, probs          # still local: dispatch_postprocess finishes the gathers
    return token_dispatch


def _allgather_postprocess(original, comm):
    def dispatch_postprocess(self, hidden_states, probs):
        pending = self.__dict__.pop("_async_gathers", None)
        if pending is None:
            return original(self, hidden_states, probs)
        group = self.tp_ep_group
        routing, probs_h, hidden_h = pending
        self.routing_map = finish(routing, self.routing_map, None)
        computing()                          # the bookkeeping below runs while hidden states travel
        lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, lo:hi].contiguous()
        tokens_per_expert = self.local_map.sum(dim=0).long().cpu()

        def reduce_scatter(grad):
            return comm.reduce_scatter(grad, 0, group)
        probs = finish(probs_h, probs, reduce_scatter)
        local_probs = probs[:, lo:hi].contiguous()
        self.local_probs = local_probs.T.contiguous().masked_select(self.local_map.T.contiguous())
        hidden_states = finish(hidden_h, hidden_states, reduce_scatter)
        self.hidden_shape_before_permute = hidden_states.shape
        from megatron.core.transformer.moe import token_dispatcher   # its `permute` (maybe the fused one)
        permuted, _, self.reversed_local_input_permutation_mapping = token_dispatcher.permute(
            hidden_states, self.local_map, num_out_tokens=tokens_per_expert.sum(),
            fused=self.config.moe_permute_fusion)
        self.routing_map = None
        return permuted, tokens_per_expert, self.local_probs
    return dispatch_postprocess


def _alltoall_dispatch(original, comm):
    def token_dispatch(self, tokens, probs):
        if self.ep_size == 1 or self.tp_size > 1:
            return original(self, tokens, probs)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        group = self.ep_group
        out_s, in_s = as_list(self.output_splits), as_list(self.input_splits)
        h_tokens = started(comm.all_to_all_v_async(tokens.detach(), out_s, in_s, group))
        h_probs = started(comm.all_to_all_v_async(probs.detach(), out_s, in_s, group))

        def back(grad):
            return comm.all_to_all_v_async(grad, in_s, out_s, group).wait()
        return finish(h_tokens, tokens, back), finish(h_probs, probs, back)
    return token_dispatch


def install(patcher, backend) -> None:
    """The dispatchers' hooks, starting their collectives on `backend`'s comm (the run's)."""
    # the support matrix has checked these methods exist (features.MoeComm.megatron_hooks)
    for method, wrap in (("MoEAllGatherTokenDispatcher.token_dispatch", _allgather_dispatch),
                         ("MoEAllGatherTokenDispatcher.dispatch_postprocess", _allgather_postprocess),
                         ("MoEAlltoAllTokenDispatcher.token_dispatch", _alltoall_dispatch)):
        patcher.wrap(f"{DISPATCHER}.{method}", functools.partial(wrap, comm=backend.comm), reason=WHY)
