"""MoE parity: Megatron-Core's MoE GPTModel (torch, CPU/gloo; TopKRouter, alltoall dispatcher,
SequentialMLP experts) and the MindSpore trainer's MoE layer, from the same initial weights on the
same batches: at EP=1 in one process (with shared experts), at EP=2 on 2 processes (DP=2: each
rank its own batches, tokens exchanged between the ranks' experts) and at TP=2 with sequence
parallelism and --moe-tp-extend-ep on 2 processes (each rank routes its sequence shard's tokens to
whole experts spread over the two TP ranks). The load-balancing loss is on (coefficient 0.1): its
gradient is in the updates, while the compared loss is the lm loss alone.

The torch side mirrors Megatron's DDP and optimizer for expert parallelism: dense gradients
averaged over DP, expert gradients summed over the expert-data-parallel group and divided by the
DP size; with sequence parallelism the norms' and the router's gradients summed over TP (Megatron's
finalize_model_grads); the clipping norm counts the dense weights once (TP shards summed over TP)
and every expert once (summed over EP)."""
from __future__ import annotations

import numpy as np

from tests_extend.distributed import mindspore_parity as mp

EXPERTS, TOPK, MOE_FFN, SHARED, AUX = 4, 2, 32, 16, 0.1
EXPERT_KEY = "mlp.experts.local_experts."
# the MoE features on the MindSpore trainer, compared with its plain run
KERNEL_FLAGS = ("--use-fused-moe-token-permute-and-unpermute", "--moe-grouped-gemm", "--moe-shared-expert-overlap")
# MindSpeed-LLM's mixtral recipe's MoE flags (TP 2 + SP, experts split over TP; the async counts inert at EP 1)
MIXTRAL_FLAGS = ("--moe-grouped-gemm", "--use-fused-moe-token-permute-and-unpermute", "--moe-permutation-async-comm")
COMM_FLAGS = ("--moe-alltoall-overlap-comm", "--moe-permutation-async-comm", "--use-fused-moe-token-permute-and-unpermute")
# Megatron-Core's router options (DeepSeek-V3's noaux_tc: sigmoid scores with the expert bias, node-limited
# groups, scaled weights, --seq-aux), as flags for the MindSpore trainer (MindSpeed-LLM's spelling) and as the
# TransformerConfig fields they become; the bias's rate large enough that it changes the routing in 20 steps
BIAS_RATE = 0.01
ROUTER_FLAGS = ("--moe-router-load-balancing-type", "noaux_tc", "--norm-topk-prob", "--seq-aux",
                "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor",
                "2.5", "--moe-router-bias-update-rate", str(BIAS_RATE))
ROUTER_FIELDS = dict(moe_router_score_function="sigmoid", moe_router_load_balancing_type="seq_aux_loss",
                     moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5,
                     moe_router_enable_expert_bias=True, moe_router_bias_update_rate=BIAS_RATE)


def moe_flags(ep: int, shared: bool, tp: int = 1, extend: bool = True) -> list:
    """tp > 1: --moe-tp-extend-ep (the experts over the TP x EP ranks; it needs --sequence-parallel,
    which mp.trainer_argv(tp, True) gives); extend False: every expert split over TP (expert TP = TP)."""
    flags = ["--num-experts", EXPERTS, "--moe-router-topk", TOPK, "--moe-ffn-hidden-size", MOE_FFN,
             "--moe-aux-loss-coeff", AUX, "--expert-model-parallel-size", ep]
    return [str(a) for a in flags + (["--moe-shared-expert-intermediate-size", SHARED] if shared else [])
            + (["--moe-tp-extend-ep"] if tp > 1 and extend else [])]


def batch(step: int, dp_rank: int):
    """Four batches per DP rank in turn, different on each rank; step EVAL_SEED: held out."""
    seed = 5000 + dp_rank if step == mp.EVAL_SEED else 100 + 10 * dp_rank + step % 4
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, mp.VOCAB, (mp.MBS, mp.SEQ + 1))
    mask = np.ones((mp.MBS, mp.SEQ), np.float32)
    mask[0, :3] = 0.0
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32), mask


# --first-k-dense-replace 1: layer 0 dense (the plain MLP, --ffn-hidden-size), layer 1 MoE; Megatron-Core's
# moe_layer_freq pattern for it
DENSE_FIRST, DENSE_FIRST_PATTERN = ("--first-k-dense-replace", "1"), [0, 1]
# one MTP layer (an MoE layer, as the decoder's last), DeepSeek-V3's scaling factor; as the trainer's flags and the
# TransformerConfig fields
MTP_FLAGS = ("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3")
MTP_FIELDS = dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)


def write_init(path: str, shared: bool, seed: int = 7, bf16: bool = False, extra: tuple = ()) -> None:
    """The initial weights (Megatron's init, the trainer's init_full_weights) as a neutral checkpoint;
    bf16: rounded to bf16, so both sides' fp32 masters start from their bf16 weights' values; extra:
    more flags (the layer layout)."""
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.checkpoint import neutral as nf
    from mindspeed.training.mindspore.model import GPTConfig, init_full_weights
    from tests_extend.distributed.mindspore_parity_fp16 import to_bf16
    args = parse_args(mp.trainer_argv(1) + moe_flags(1, shared) + list(extra))
    full = init_full_weights(GPTConfig.from_args(args, mp.VOCAB), seed)
    nf.save(path, 0, {k: to_bf16(v) if bf16 else v for k, v in full.items()}, meta={"backend": "test"})


# -- mindspore side -------------------------------------------------------------------------------
def ms_train(backend, ep: int, shared: bool, init_ckpt: str, save_dir: str | None = None,
             steps: int = mp.STEPS, extra: tuple = (), tp: int = 1, resume: bool = False, pp: int = 1,
             extend: bool = True) -> dict:
    """Load init_ckpt, train `steps` steps (none: evaluate the checkpoint only), optionally save;
    `extra`: more flags (another feature on top of MoE); tp > 1: sequence parallel, --moe-tp-extend-ep;
    resume: init_ckpt's optimizer state too, and on from its iteration; pp > 1: that many pipeline
    stages (one micro-batch per data-parallel rank and step, as at PP 1); extend False at tp > 1: no
    --moe-tp-extend-ep, each expert split over TP."""
    import mindspeed
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore import checkpoint
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    world = backend.comm.world_size()
    args = parse_args(mp.trainer_argv(tp, tp > 1) + moe_flags(ep, shared, tp, extend)
                      + ["--global-batch-size", str(mp.MBS * world // (tp * pp)),
                         "--pipeline-model-parallel-size", str(pp)] + list(extra), world_size=world)
    args.backend = "mindspore"
    state = mindspeed.adapt(args)       # the support matrix's gate: MoE (and EP) must be accepted here
    try:
        ps = build_parallel_state(backend.comm, tp, tp > 1, pp_size=pp, ep_size=ep, tp_extend_ep=tp > 1 and extend)
        trainer = Trainer(args, backend, ps, GPTConfig.from_args(args, mp.VOCAB, state.feature_ids), state)
        meta = checkpoint.load(init_ckpt, trainer.model, trainer.optimizer, load_optimizer=resume)
        start = int(meta["iteration"]) if resume else 0
        losses, norms = [], []
        for step in range(start, start + steps):
            tokens, labels, mask = batch(step, ps.dp_rank)
            loss, norm, _ = trainer.train_step([{"tokens": tokens, "labels": labels, "loss_mask": mask}], step + 1)
            losses.append(loss)      # the DP mean, as the torch side reports per rank below
            norms.append(norm)
        tokens, labels, mask = batch(mp.EVAL_SEED, ps.dp_rank)
        eval_loss = trainer.evaluate([{"tokens": tokens, "labels": labels, "loss_mask": mask}])
        if save_dir:
            checkpoint.save(backend, ps, save_dir, start + steps, trainer.model, trainer.optimizer,
                            {"backend": "mindspore"})
        return {"losses": losses, "grad_norms": norms, "eval_loss": eval_loss, "graph_mode": trainer.graph_mode,
                "params": sorted(trainer.model.params), "schedule": moe_schedule(trainer.model),
                "param_dtypes": sorted({str(p.dtype) for p in trainer.model.params.values()}),
                **(held_state(trainer) if trainer.distributed_optimizer else {})}
    finally:
        mindspeed.unadapt()


def held_state(trainer) -> dict:
    """The distributed optimizer's state values on this rank, dense and experts apart, and the
    parameter values of each (the plain Adam holds two state values per parameter value)."""
    from mindspeed.checkpoint.neutral import is_expert
    params = trainer.model.params
    values = lambda expert: sum(int(p.size) for n, p in params.items() if is_expert(n) == expert)
    opt = trainer.optimizer
    return {"state_dense": opt.state_elements("dense"), "state_experts": opt.state_elements("experts"),
            "dense_values": values(False), "expert_values": values(True)}


def moe_schedule(model) -> list:
    """The steps the first MoE layer took in its last call (training/mindspore/moe.py)."""
    layers = getattr(model, "moe_layers", {})
    return layers[min(layers)].schedule if layers else []


# -- torch side (inside the gloo harness) ----------------------------------------------------------
def build_torch_model(ep: int, shared: bool, tp: int = 1, layer_freq=1, router: dict | None = None,
                      mtp: dict | None = None):
    """layer_freq: Megatron-Core's moe_layer_freq (a 0/1 list: dense layers among the MoE ones, its
    decoder block spec); router: more TransformerConfig router fields (ROUTER_FIELDS); mtp: MTP_FIELDS,
    Megatron-Core's MTP block, whose layer follows the decoder's (an MoE layer here)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    config = TransformerConfig(num_layers=mp.LAYERS, hidden_size=mp.HIDDEN, num_attention_heads=mp.HEADS,
                               num_query_groups=mp.GROUPS, ffn_hidden_size=mp.FFN, use_cpu_initialization=True,
                               normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, add_bias_linear=False,
                               bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
                               num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
                               moe_aux_loss_coeff=AUX, moe_token_dispatcher_type="alltoall",
                               expert_model_parallel_size=ep, tensor_model_parallel_size=tp,
                               sequence_parallel=tp > 1,
                               moe_shared_expert_intermediate_size=SHARED if shared else None,
                               moe_layer_freq=layer_freq, **(router or {}), **(mtp or {}))
    spec = (get_gpt_layer_local_spec(num_experts=EXPERTS, normalization="RMSNorm") if layer_freq == 1 else
            get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm"))
    return GPTModel(config, spec, mtp_block_spec=get_gpt_mtp_block_spec(config, spec, False) if mtp else None,
                    vocab_size=mp.VOCAB, max_sequence_length=mp.SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def _local_name(name: str, ep_rank: int, local: int):
    """A whole checkpoint's expert name -> this EP rank's state-dict name, or None (not its expert)."""
    if EXPERT_KEY not in name:
        return name
    head, tail = name.split(EXPERT_KEY, 1)
    e, rest = tail.split(".", 1)
    return f"{head}{EXPERT_KEY}{int(e) - ep_rank * local}.{rest}" if int(e) // local == ep_rank else None


def load_into_torch(model, ckpt: str, ep_rank: int, ep: int, tp_rank: int = 0, tp: int = 1,
                    expert_tp: bool = False) -> None:
    """ep, ep_rank: the ranks the experts are spread over (TP x EP with --moe-tp-extend-ep); dense
    weights cut for TP rank tp_rank, experts whole (expert_tp: cut as the dense MLP's too)."""
    import torch
    from mindspeed.checkpoint import neutral as nf
    full, _, _ = nf.load(ckpt)
    local = EXPERTS // ep
    state = {_local_name(k, ep_rank, local): torch.from_numpy(np.array(nf.shard_for_rank(k, np.asarray(v), tp_rank, tp,
                                                                                 experts_sharded=expert_tp)))
             for k, v in full.items()}
    state.pop(None, None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    # the initial weights hold no expert bias: Megatron's buffer starts at zero (the test compares the trained ones)
    assert all(k.endswith(("_extra_state", "router.expert_bias")) for k in missing), missing


def _loss(model, step, dp_rank):
    import torch
    tokens, labels, mask = (torch.from_numpy(a.astype(np.int64) if a.dtype != np.float32 else a)
                            for a in batch(step, dp_rank))
    position_ids = torch.arange(mp.SEQ).unsqueeze(0).expand(mp.MBS, -1)
    # MTP's loss masks its tokens by loss_mask (rolled), as the torch trainer's forward_step passes it
    per_token = model(tokens, position_ids, None, labels=labels,
                      **({"loss_mask": mask} if model.config.mtp_num_layers else {}))
    return (per_token * mask).sum() / mask.sum()


def torch_layouts(rank, world_size, layouts):
    """Harness body: torch_train for each (args, kwargs) of `layouts` in turn, in one launch."""
    return [torch_train(rank, world_size, *a, **kw) for a, kw in layouts]


def torch_train(rank, world_size, ep, shared, init_ckpt, other_ckpt=None, steps=mp.STEPS, save_dir=None, tp=1,
                bf16=False, layer_freq=1, router=None, expert_tp=False, mtp=None):
    """Harness body: train; evaluate the result; with save_dir (EP=1) save it as a neutral
    checkpoint; with other_ckpt, load that one into a fresh model and evaluate it too. tp > 1:
    sequence parallel, with MindSpeed's --moe-tp-extend-ep hook (the experts over TP x EP). bf16:
    Megatron's --bf16 (Float16Module's bf16 weights and activations; fp32 main gradients, reduced
    in fp32, and fp32 masters that AdamW updates, as Float16OptimizerWithFloat16Params). expert_tp at
    tp > 1: no hook, Megatron-Core's expert_tensor_parallel_size = TP (each expert split over TP)."""
    import torch
    import mindspeed
    mindspeed.adapt([str(a) for a in ["--moe-tp-extend-ep", "--num-experts", EXPERTS, "--tensor-model-parallel-size",
                                      tp, "--sequence-parallel"]] if tp > 1 and not expert_tp else [])
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(123)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    ep_rank, ep_group = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_group()
    edp_group, dp_group = ps.get_expert_data_parallel_group(), ps.get_data_parallel_group()
    tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    spread = ps.get_expert_model_parallel_world_size()       # ep, or ep x tp extended
    _fresh_trackers()
    model = build_torch_model(ep, shared, tp, layer_freq, router, mtp)
    load_into_torch(model, init_ckpt, ep_rank, spread, tp_rank, tp, expert_tp)
    params = list(model.named_parameters())
    forward, updated = model, [p for _, p in params]
    if bf16:
        from megatron.core.transformer.module import Float16Module
        model.config.bf16 = True
        forward = Float16Module(model.config, model)          # the weights in bf16, in place
        updated = [p.detach().float().requires_grad_() for _, p in params]      # the fp32 masters
    opt = torch.optim.AdamW([{"params": [m for m in updated if m.dim() > 1], "weight_decay": mp.OPT["weight_decay"]},
                             {"params": [m for m in updated if m.dim() <= 1], "weight_decay": 0.0}],
                            lr=mp.OPT["lr"], betas=mp.OPT["betas"], eps=mp.OPT["eps"])
    losses, norms = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = mp.lr_at(step)
        opt.zero_grad()
        loss = _loss(forward, step, dp_rank)
        loss.backward()
        _update_expert_bias(model)
        for (_, p), m in zip(params, updated):
            if p.grad is None:       # an expert no token was routed to
                p.grad = torch.zeros_like(p)
            if bf16:
                m.grad, p.grad = p.grad.float(), None
        dense_sq, expert_sq = 0.0, 0.0
        for (name, held), p in zip(params, updated):      # p: what the optimizer updates
            if tp > 1 and getattr(held, "sequence_parallel", False):     # norms, the router: partial over TP
                torch.distributed.all_reduce(p.grad, group=tp_group)
            p.grad.div_(dp)          # Megatron's DDP: scale by 1/dp, then sum over (expert-)DP
            if EXPERT_KEY in name:
                torch.distributed.all_reduce(p.grad, group=edp_group)
                expert_sq += float(p.grad.double().square().sum())
            else:
                torch.distributed.all_reduce(p.grad, group=dp_group)
                if getattr(held, "tensor_model_parallel", False) or tp_rank == 0:
                    dense_sq += float(p.grad.double().square().sum())
        sq, dense = (torch.tensor([v], dtype=torch.float64) for v in (expert_sq, dense_sq))
        torch.distributed.all_reduce(sq, group=ep_group)
        if expert_tp:        # each expert's TP shards
            torch.distributed.all_reduce(sq, group=tp_group)
        torch.distributed.all_reduce(dense, group=tp_group)
        norms.append(float((sq + dense).sqrt()))
        coeff = mp.OPT["clip"] / (norms[-1] + 1e-6)
        if coeff < 1.0:
            for p in updated:
                p.grad.mul_(coeff)
        opt.step()
        if bf16:
            with torch.no_grad():
                for (_, p), m in zip(params, updated):
                    p.copy_(m)
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=dp_group)
        losses.append(mean.item() / dp)
    result = {"losses": losses, "grad_norms": norms, "eval_loss": _eval(forward, dp_rank, dp_group, dp)}
    if save_dir:
        from mindspeed.checkpoint import neutral as nf
        assert ep == 1      # the state dict's local expert indices are the global ones
        nf.save(save_dir, steps, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()
                                  if torch.is_tensor(v) and v.is_floating_point()}, meta={"backend": "torch"})
    if other_ckpt:      # the MindSpore run's final checkpoint, loaded here and evaluated
        fresh = build_torch_model(ep, shared, tp, layer_freq, router, mtp)
        load_into_torch(fresh, other_ckpt, ep_rank, spread, tp_rank, tp, expert_tp)
        result["eval_loss_of_other"] = _eval(fresh, dp_rank, dp_group, dp)
    result["experts"] = sorted({int(n.split(EXPERT_KEY)[1].split(".")[0]) + ep_rank * (EXPERTS // spread)
                                for n, _ in params if EXPERT_KEY in n})
    mindspeed.unadapt()
    return result


def _fresh_trackers() -> None:
    """Megatron-Core's logging buffers, sized by the first model's layers (an MTP run adds layers)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    get_moe_layer_wise_logging_tracker().clear()
    MTPLossLoggingHelper.tracker.clear()


def _update_expert_bias(model) -> None:
    """Megatron's finalize_model_grads's expert-bias step (this loop replaces finalize_model_grads): the
    tokens per expert summed over TP x DP, each bias moved by the rate, the counts zeroed."""
    from megatron.core.distributed.finalize_model_grads import (_update_router_expert_bias,
                                                                reset_model_temporary_tensors)
    if model.config.moe_router_enable_expert_bias:
        _update_router_expert_bias([model], model.config)
        reset_model_temporary_tensors(model.config, [model])


def _eval(model, dp_rank, dp_group, dp) -> float:
    """The held-out batch's loss, averaged over DP (the MindSpore trainer's evaluate)."""
    import torch
    with torch.no_grad():
        value = _loss(model, mp.EVAL_SEED, dp_rank).reshape(1)
    torch.distributed.all_reduce(value, group=dp_group)
    return value.item() / dp
