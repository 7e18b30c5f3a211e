"""Cases for test_moe_comm.py, run inside the 2-process spawn: one Megatron-Core MoE layer built
with and without the MoE communication flags from the same full expert weights and inputs."""
from __future__ import annotations

H, FFN, E, S, B = 16, 24, 4, 8, 2       # hidden, expert ffn, experts, sequence (full), batch


def full_weights():
    """Every parameter of the layer at full size (experts whole), from a fixed seed."""
    import torch
    g = torch.Generator().manual_seed(11)
    w = {"router": torch.randn(E, H, generator=g) * 0.5}
    for e in range(E):
        w[f"fc1.{e}"] = torch.randn(2 * FFN, H, generator=g) * 0.2      # SwiGLU: [gate; up]
        w[f"fc2.{e}"] = torch.randn(H, FFN, generator=g) * 0.2
    w["shared.fc1"] = torch.randn(2 * FFN, H, generator=g) * 0.2
    w["shared.fc2"] = torch.randn(H, FFN, generator=g) * 0.2
    return w


def inputs(step: int):
    import torch
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _swiglu_rows(w, tp_rank, tp):
    """Rows of a SwiGLU fc1 [gate; up] that tensor-parallel rank tp_rank holds (gate and up split alike)."""
    import torch
    gate, up = w.chunk(2)
    n = gate.shape[0] // tp
    return torch.cat([gate[tp_rank * n:(tp_rank + 1) * n], up[tp_rank * n:(tp_rank + 1) * n]])


def build_layer(tp: int, ep: int, dispatcher: str, shared: bool = False, shared_overlap: bool = False):
    """An MoELayer on the current process groups, loaded from full_weights() for this rank's layout."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                            num_moe_experts=E, moe_router_topk=2, moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN,
                            moe_token_dispatcher_type=dispatcher, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            moe_shared_expert_intermediate_size=FFN if shared else None,
                            moe_shared_expert_overlap=shared_overlap, bias_activation_fusion=False,
                            hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=E).submodules.mlp
    layer = MoELayer(cfg, spec.submodules)
    load(layer, full_weights(), ps)
    return layer


def load(layer, w, ps):
    import torch
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        for k, e in enumerate(layer.local_expert_indices):
            mlp = layer.experts.local_experts[k]
            mlp.linear_fc1.weight.copy_(_swiglu_rows(w[f"fc1.{e}"], etp_rank, etp))
            mlp.linear_fc2.weight.copy_(w[f"fc2.{e}"].chunk(etp, dim=1)[etp_rank])
        if layer.shared_experts is not None:
            layer.shared_experts.linear_fc1.weight.copy_(_swiglu_rows(w["shared.fc1"], tp_rank, tp))
            layer.shared_experts.linear_fc2.weight.copy_(w["shared.fc2"].chunk(tp, dim=1)[tp_rank])


def full_grads(layer, ps):
    """Every parameter's gradient at full size (gathered over the expert layout), keyed like full_weights."""
    import torch
    import torch.distributed as dist
    etp, etp_group = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group()
    ep_group = ps.get_expert_model_parallel_group()
    out = {"router": layer.router.weight.grad.clone()}

    def gather(t, group, n):
        if n == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts
    local = {}
    for k, e in enumerate(layer.local_expert_indices):
        mlp = layer.experts.local_experts[k]
        fc1 = gather(mlp.linear_fc1.weight.grad, etp_group, etp)
        gates = torch.cat([p.chunk(2)[0] for p in fc1]); ups = torch.cat([p.chunk(2)[1] for p in fc1])
        local[e] = (torch.cat([gates, ups]), torch.cat(gather(mlp.linear_fc2.weight.grad, etp_group, etp), dim=1))
    n_ep = ps.get_expert_model_parallel_world_size()
    for e_local in range(len(layer.local_expert_indices)):
        fc1s = gather(local[layer.local_expert_indices[e_local]][0], ep_group, n_ep)
        fc2s = gather(local[layer.local_expert_indices[e_local]][1], ep_group, n_ep)
        for r in range(n_ep):
            e = r * len(layer.local_expert_indices) + e_local
            out[f"fc1.{e}"], out[f"fc2.{e}"] = fc1s[r], fc2s[r]
    return out


def run_layer(layer, ps, steps: int = 3, lr: float = 0.02):
    """`steps` SGD steps on loss = sum((y - target)^2) / 2 over this rank's sequence shard: per step
    the loss (summed over the ranks), then the last step's output, input gradient and full gradients."""
    import torch
    import torch.distributed as dist
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp_group = ps.get_data_parallel_group()
    losses = []
    for step in range(steps):
        x_full, dy_full = inputs(step + 10 * ps.get_data_parallel_rank())
        rows = S // tp
        x = x_full[tp_rank * rows:(tp_rank + 1) * rows].clone().requires_grad_(True)
        layer.zero_grad()
        y, _ = layer(x)
        loss = 0.5 * (y - dy_full[tp_rank * rows:(tp_rank + 1) * rows]).pow(2).sum()
        loss.backward()
        # experts get every token routed to them (whole gradients); the router is replicated on every
        # rank (TP under SP, and DP), the shared experts over DP: sum theirs as Megatron's DDP does
        dist.all_reduce(layer.router.weight.grad)
        if layer.shared_experts is not None:
            for p in layer.shared_experts.parameters():
                dist.all_reduce(p.grad, group=dp_group)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
        grads = full_grads(layer, ps)
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(p.grad, alpha=-lr) if p.grad is not None else None
    return losses, y.detach().clone(), x.grad.detach().clone(), grads


def arrival_inputs(layer, ps):
    """One forward: for each chunk's dispatch arrival node in the autograd graph (chunked_alltoall.py),
    the sorted names of the nodes its gradients go to. The edge from the previous chunk's combine is
    what fixes the gradient all-to-alls' start order, whatever autograd's scheduling of ready nodes."""
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    x = inputs(0)[0][tp_rank * (S // tp):(tp_rank + 1) * (S // tp)].clone().requires_grad_(True)
    y, _ = layer(x)
    seen, todo, arrivals = set(), [y.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nexts = [n for n, _ in node.next_functions]
        if node.name() == "_DispatchArriveBackward":
            arrivals.append(sorted(n.name() for n in nexts if n is not None))
        todo.extend(nexts)
    return sorted(arrivals)
