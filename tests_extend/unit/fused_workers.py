"""Bodies run in a fresh process (tests_extend.distributed.harness) for the fused-wiring tests:
each applies MindSpeed with some flags, builds a tiny Megatron-Core GPT and reports back."""
from __future__ import annotations

import torch

DENSE_FLAGS = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn",
               "--gradient-accumulation-fusion"]
COUNTED = ("rms_norm", "swiglu", "rope", "attention", "matmul_add_fp32")


def _count_kernel_calls(kernels, names):
    """Wrap the live backend's kernels so each call is counted (the real kernel still runs)."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        impl = kernels._impl[name]

        def counted(*args, _impl=impl, _name=name, **kwargs):
            counts[_name] += 1
            return _impl(*args, **kwargs)
        kernels._impl[name] = counted
    return counts


def _ddp(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    return DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)


def _with_flags(flags):
    import mindspeed
    from mindspeed.backends import get_backend
    mindspeed.unadapt()
    mindspeed.adapt(list(flags))
    return get_backend()


def layer_wiring(rank, world_size):
    """With and without the flags: module classes and kernel calls in one forward+backward."""
    from tests_extend import megatron_tiny
    report = {}
    for name, flags in (("on", DENSE_FLAGS), ("off", [])):
        backend = _with_flags(flags)
        counts = _count_kernel_calls(backend.kernels, COUNTED)
        megatron_tiny.init_parallel()
        model = _ddp(megatron_tiny.build_gpt(layers=1))
        layer = model.module.decoder.layers[0]
        tokens, position_ids, labels = megatron_tiny.batch()
        model(tokens, position_ids, None, labels=labels).float().mean().backward()
        report[name] = dict(
            counts=dict(counts),
            norm=type(layer.input_layernorm).__name__,
            final_norm=type(model.module.decoder.final_layernorm).__name__,
            attention=type(layer.self_attention.core_attention).__name__,
            swiglu_fusion=layer.mlp.config.bias_activation_fusion,
            grad_fusion=layer.mlp.config.gradient_accumulation_fusion)
    import mindspeed
    mindspeed.unadapt()
    return report


def train_losses(rank, world_size, steps: int = 20):
    """Loss curve of a tiny GPT (DDP main_grad + Adam) with the fused flags on and off."""
    from tests_extend import megatron_tiny
    curves = {}
    for name, flags in (("on", DENSE_FLAGS), ("off", [])):
        _with_flags(flags)
        megatron_tiny.init_parallel(seed=7)
        torch.manual_seed(7)
        model = _ddp(megatron_tiny.build_gpt(layers=1))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=3e-3)
        losses = []
        for step in range(steps):
            model.zero_grad_buffer()
            tokens, position_ids, labels = megatron_tiny.batch(seed=step % 4)
            loss = model(tokens, position_ids, None, labels=labels).float().mean()
            loss.backward()
            model.finish_grad_sync()
            for p in params:
                p.grad = p.main_grad.to(p.dtype)
            opt.step()
            for p in params:
                p.grad = None            # main_grad is DDP's buffer: do not let autograd accumulate into it
            losses.append(loss.item())
        curves[name] = losses
    import mindspeed
    mindspeed.unadapt()
    return curves


MOE_FLAGS = ["--moe-grouped-gemm", "--use-fused-moe-token-permute-and-unpermute"]
PERMUTE_FLAG = "--use-fused-moe-token-permute-and-unpermute"
MOE_KERNELS = ("gmm", "moe_permute", "moe_unpermute")
NUM_EXPERTS = 4


def _moe_gpt(seed: int):
    """One-layer bf16 MoE GPT (4 experts, top-2, alltoall dispatcher), local spec (GroupedMLP
    asserts bf16)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests_extend import megatron_tiny
    megatron_tiny.init_parallel(seed=seed)
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                               bf16=True, params_dtype=torch.bfloat16)
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, normalization="RMSNorm")
    return _ddp(GPTModel(config, spec, vocab_size=megatron_tiny.VOCAB, max_sequence_length=megatron_tiny.SEQ,
                         position_embedding_type="rope"))


_EXPERT = "decoder.layers.0.mlp.experts."


def _to_grouped(state: dict) -> dict:
    """SequentialMLP's per-expert weights as GroupedMLP's weight1/weight2, which GroupedMLP views
    as [E, hidden, 2*ffn] and [E, ffn, hidden]: expert e's fc1/fc2 weights, transposed, in order."""
    fc = lambda e, i: state[f"{_EXPERT}local_experts.{e}.linear_fc{i}.weight"]
    hidden = fc(0, 1).shape[1]
    out = {k: v for k, v in state.items() if "local_experts" not in k}
    out[_EXPERT + "weight1"] = torch.stack([fc(e, 1).t() for e in range(NUM_EXPERTS)]).reshape(hidden, -1)
    out[_EXPERT + "weight2"] = torch.stack([fc(e, 2).t() for e in range(NUM_EXPERTS)]).reshape(-1, hidden)
    return out


def _from_grouped(state: dict) -> dict:
    """The inverse of _to_grouped (for gradients)."""
    if _EXPERT + "weight1" not in state:
        return state
    out = {k: v for k, v in state.items() if not k.startswith(_EXPERT + "weight")}
    hidden = state[_EXPERT + "weight2"].shape[1]
    w1 = state[_EXPERT + "weight1"].reshape(NUM_EXPERTS, hidden, -1)
    w2 = state[_EXPERT + "weight2"].reshape(NUM_EXPERTS, -1, hidden)
    for e in range(NUM_EXPERTS):
        out[f"{_EXPERT}local_experts.{e}.linear_fc1.weight"] = w1[e].t()
        out[f"{_EXPERT}local_experts.{e}.linear_fc2.weight"] = w2[e].t()
    return out


def _doubled(kernels, name):
    """Make kernel `name` return twice its (first) output: a result that ignores it stays the same."""
    impl = kernels._impl[name]

    def doubled(*args, **kwargs):
        out = impl(*args, **kwargs)
        return (out[0] * 2, *out[1:]) if isinstance(out, tuple) else out * 2
    kernels._impl[name] = doubled
    return lambda: kernels._impl.__setitem__(name, impl)


def moe_wiring(rank, world_size):
    """The MoE GPT unfused (Megatron's SequentialMLP and permutation), with the fused permutation,
    and with grouped GEMM (with and without main_grad fusion), all from the same weights: expert
    module, kernel calls, per-token losses and every parameter's main_grad against the unfused run,
    and whether doubling each kernel's output changes the loss (its result is used, not dropped)."""
    from tests_extend import megatron_tiny
    runs = {"off": [], "permute": [PERMUTE_FLAG], "grouped": MOE_FLAGS,
            "grouped+fused_grad": MOE_FLAGS + ["--gemm-gradient-accumulation-fusion"]}
    tokens, position_ids, labels = megatron_tiny.batch()
    report, losses, grads, weights = {}, {}, {}, None
    for name, flags in runs.items():
        backend = _with_flags(flags)
        model = _moe_gpt(seed=3)
        if weights is None:
            weights = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        else:
            wanted = _to_grouped(weights) if "grouped" in name else weights
            with torch.no_grad():
                for n, p in model.module.named_parameters():
                    p.copy_(wanted[n])
        counts = _count_kernel_calls(backend.kernels, MOE_KERNELS)
        per_token = model(tokens, position_ids, None, labels=labels).float()
        per_token.mean().backward()
        model.finish_grad_sync()
        experts = model.module.decoder.layers[0].mlp.experts
        calls = dict(counts)                     # forward + backward; the probes below call again
        losses[name] = per_token.detach()
        grads[name] = _from_grouped({n: p.main_grad.float().clone() for n, p in model.module.named_parameters()})
        sensitive = {}
        for kernel in MOE_KERNELS:
            if counts[kernel]:
                restore = _doubled(backend.kernels, kernel)
                with torch.no_grad():
                    sensitive[kernel] = float((model(tokens, position_ids, None, labels=labels).float()
                                               - losses[name]).abs().max())
                restore()
        report[name] = dict(experts=type(experts).__name__, counts=calls, loss=float(per_token.mean()),
                            sensitivity=sensitive)
    import mindspeed
    mindspeed.unadapt()
    # tensors do not travel back through the harness queue: compare here, return numbers
    ref_grads = grads["off"]
    for name in runs:
        report[name]["loss_max_diff"] = float((losses[name] - losses["off"]).abs().max())
        report[name]["grad_rel_diff"] = {n: float((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max())
                                         for n, g in grads[name].items()}
    report["grad_names"] = sorted(ref_grads)
    return report


EOD_FLAGS = ["--use-flash-attn", "--reset-attention-mask", "--reset-position-ids"]
DOC_LENGTHS = ([5, 11, 16], [20, 1, 11])      # per sample of SEQ = 32 tokens; each ends in an EOD token


def _packed_documents(eod: int):
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, eod, (len(DOC_LENGTHS), sum(DOC_LENGTHS[0])), generator=g)
    for i, lengths in enumerate(DOC_LENGTHS):
        tokens[i, torch.tensor(lengths).cumsum(0) - 1] = eod
    return tokens


def eod_documents(rank, world_size, extra_flags=()):
    """--reset-attention-mask with flash attention: the per-token loss of a packed batch against each
    document run on its own (same weights), with every attention call's layout and mask recorded;
    and the packed batch with the documents withheld (plain causal), which must differ."""
    from mindspeed.features import documents
    from mindspeed.training.data import documents_mask
    from tests_extend import megatron_tiny
    backend = _with_flags(EOD_FLAGS + list(extra_flags))
    calls = []
    impl = backend.kernels._impl["attention"]

    def recorded(*args, **kwargs):
        calls.append((kwargs.get("layout"), kwargs.get("mask") is None))
        return impl(*args, **kwargs)
    backend.kernels._impl["attention"] = recorded
    megatron_tiny.init_parallel(seed=5)
    torch.manual_seed(5)
    model = megatron_tiny.build_gpt(layers=2)
    eod = megatron_tiny.VOCAB - 1
    tokens = _packed_documents(eod)
    labels = torch.roll(tokens, -1, 1)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    ends = [documents.ends_from_eod(row, eod) for row in tokens]
    packed = model(tokens, positions, documents_mask(ends), labels=labels)
    packed.float().sum().backward()         # the TND path's backward runs too
    packed_calls = list(calls)
    # the references get Megatron's causal mask ([1, 1, s, s], True = masked), which sparse mode 1 uses as given
    causal = lambda s: torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)    # noqa: E731
    with torch.no_grad():
        crossing = model(tokens, positions, causal(tokens.shape[1]), labels=labels)
        alone = torch.zeros_like(packed)
        for i, row in enumerate(ends):
            for a, b in zip([0] + row[:-1], row):
                doc = tokens[i:i + 1, a:b]
                alone[i, a:b] = model(doc, torch.arange(b - a).unsqueeze(0), causal(b - a),
                                      labels=labels[i:i + 1, a:b])[0]
    backend.kernels._impl["attention"] = impl
    interleaved = _documents_under_recompute(model, tokens, eod)
    import mindspeed
    mindspeed.unadapt()
    # the last token of a document predicts the next document's first token: the same label either way
    return dict(ends=ends, calls=packed_calls, max_diff=float((packed.detach() - alone).abs().max()),
                crossing_diff=float((crossing - alone).abs().max()), **interleaved)


def _documents_under_recompute(model, tokens_a, eod):
    """A pipeline schedule's order with full recompute: micro-batch A's forward, then B's (other
    documents), then A's backward, which re-runs A's layers. Returns the largest gradient difference
    against A's forward and backward without recompute (same weights), and (the check's
    sensitivity) against A's tokens run with B's documents. Each forward's documents are made right
    before it, as get_batch makes them."""
    from mindspeed.features import documents
    from mindspeed.training.data import documents_mask
    from tests_extend import megatron_tiny
    recomputed = megatron_tiny.build_gpt(layers=2, recompute_granularity="full", recompute_method="uniform",
                                         recompute_num_layers=1)
    recomputed.load_state_dict(model.state_dict())
    tokens_b = tokens_a.roll(7, 1)
    positions = torch.arange(tokens_a.shape[1]).expand_as(tokens_a)

    def grads(gpt, *forwards):           # (tokens, the tokens whose documents it gets) per micro-batch
        gpt.zero_grad(set_to_none=True)
        losses = [gpt(t, positions, documents_mask([documents.ends_from_eod(row, eod) for row in d]),
                      labels=torch.roll(t, -1, 1)).float().sum() for t, d in forwards]
        losses[0].backward()
        return torch.cat([p.grad.flatten() for p in gpt.parameters() if p.grad is not None])
    alone = grads(model, (tokens_a, tokens_a))
    interleaved = grads(recomputed, (tokens_a, tokens_a), (tokens_b, tokens_b))
    other_documents = grads(model, (tokens_a, tokens_b))
    return dict(recompute_interleaved_diff=float((interleaved - alone).abs().max()),
                recompute_other_documents_diff=float((other_documents - alone).abs().max()))


def all_reports(rank, world_size):
    """Every report above in one process (one interpreter start for the whole test module)."""
    return dict(layer=layer_wiring(rank, world_size), train=train_losses(rank, world_size),
                moe=moe_wiring(rank, world_size), eod=eod_documents(rank, world_size),
                eod_given_mask=eod_documents(rank, world_size, ["--sparse-mode", "1"]))
