"""The parity experiment shared by test_mindspore_parity.py and its msrun worker: one GPT config,
one set of batches, trained by Megatron-Core's GPTModel on torch and by the MindSpore trainer.

Both sides use Megatron's optimizer semantics: AdamW with no decay on 1-D params, global-norm
clipping (coeff = max / (norm + 1e-6)), and the Megatron LR schedule (schedule.learning_rate).
"""
from __future__ import annotations

import numpy as np

from mindspeed.checkpoint import neutral as nf
from mindspeed.training.mindspore.schedule import learning_rate

LAYERS, HIDDEN, HEADS, GROUPS, FFN, VOCAB, SEQ, MBS = 2, 32, 4, 2, 64, 64, 16, 2
STEPS = 20
FP32_TOL = 1e-4     # the fp32 parity bound on a loss (test_mindspore_parity.py's TOL)
OPT = dict(lr=5e-3, min_lr=5e-4, warmup=3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0)
EVAL_SEED = 1000


def batch(step: int):
    """Four batches in turn (so the loss can fall); EVAL_SEED gives a held-out one."""
    rng = np.random.RandomState(step if step == EVAL_SEED else step % 4)
    tokens = rng.randint(0, VOCAB, (MBS, SEQ + 1))
    mask = np.ones((MBS, SEQ), np.float32)
    mask[0, :3] = 0.0       # a masked prefix: the loss must honour loss_mask on both sides
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32), mask


def lr_at(step: int) -> float:
    return learning_rate(step, max_lr=OPT["lr"], min_lr=OPT["min_lr"], warmup_steps=OPT["warmup"],
                         decay_steps=STEPS, decay_style="cosine")


def trainer_argv(tp: int, sp: bool = False) -> list:
    argv = ["--num-layers", LAYERS, "--hidden-size", HIDDEN, "--num-attention-heads", HEADS,
            "--group-query-attention", "--num-query-groups", GROUPS, "--ffn-hidden-size", FFN,
            "--seq-length", SEQ, "--micro-batch-size", MBS, "--global-batch-size", MBS, "--train-iters", STEPS,
            "--lr", OPT["lr"], "--min-lr", OPT["min_lr"], "--lr-warmup-iters", OPT["warmup"],
            "--adam-beta1", OPT["betas"][0], "--adam-beta2", OPT["betas"][1], "--adam-eps", OPT["eps"],
            "--weight-decay", OPT["weight_decay"], "--clip-grad", OPT["clip"], "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", tp,
            "--make-vocab-size-divisible-by", VOCAB // 2]
    return [str(a) for a in argv] + (["--sequence-parallel"] if sp else [])


# -- mindspore side ------------------------------------------------------------------------------
def ms_train(backend, tp: int, sp: bool, init_ckpt: str, save_dir: str | None = None, steps: int = STEPS,
             cp: int = 1, cp_algo: str | None = None, extra: tuple = (), batch_fn=None) -> dict:
    """Load the initial weights, train `steps` steps on batch(step); optionally save the result.
    cp > 1 runs the context-parallel feature, `extra` flags their features (adapted through
    mindspeed.adapt, as the trainer does). batch_fn(step): the micro-batch dict instead of batch(step)."""
    import mindspeed
    from mindspeed.backends import get_backend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore import checkpoint
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    argv = trainer_argv(tp, sp) + (["--context-parallel-size", str(cp), "--context-parallel-algo", cp_algo]
                                   if cp > 1 else []) + list(extra)
    args = parse_args(argv, world_size=backend.comm.world_size())
    session = None
    if cp > 1 or extra:
        args.backend = "mindspore"
        session = mindspeed.adapt(args)      # as the trainer's setup does
        backend = session.backend
    try:
        return _ms_train(backend, args, tp, sp, cp, init_ckpt, save_dir, steps, batch_fn, session)
    finally:
        if session is not None:
            session.close()


def _as_micro_batch(step):
    tokens, labels, mask = batch(step)
    return {"tokens": tokens, "labels": labels, "loss_mask": mask}


def _ms_train(backend, args, tp, sp, cp, init_ckpt, save_dir, steps, batch_fn=None, session=None):
    from mindspeed.training.mindspore import checkpoint
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    ps = build_parallel_state(backend.comm, tp, sp, cp)
    features = session.feature_ids if session is not None else ()     # as the trainer's _train reads them
    trainer = Trainer(args, backend, ps, GPTConfig.from_args(args, VOCAB, features), session)
    if init_ckpt:      # else the trainer's own initialisation (TP-independent, from --seed)
        checkpoint.load(init_ckpt, trainer.model)
    losses, norms = [], []
    batch_fn = batch_fn or _as_micro_batch
    for step in range(steps):
        loss, norm, lr = trainer.train_step([batch_fn(step)], step + 1)
        assert abs(lr - lr_at(step)) < 1e-12
        losses.append(loss)
        norms.append(norm)
    eval_loss = trainer.evaluate([batch_fn(EVAL_SEED)])
    if save_dir:
        checkpoint.save(backend, ps, save_dir, STEPS, trainer.model, trainer.optimizer, {"backend": "mindspore"})
    return {"losses": losses, "grad_norms": norms, "eval_loss": eval_loss, "graph_mode": trainer.graph_mode}


# -- torch side (Megatron-Core GPTModel, run inside the gloo harness) ----------------------------
def build_torch_model(tp: int, swiglu: bool = True, normalization: str = "RMSNorm",
                      position_embedding_type: str = "rope", num_query_groups: int | None = None,
                      tied: bool = False, layers: int | None = None, qk_layernorm: bool = False,
                      kv_channels: int | None = None, yarn: dict | None = None, mla: dict | None = None,
                      mtp: dict | None = None):
    """swiglu=False: Megatron-Core's default GELU MLP (F.gelu, not gated), as --no-swiglu;
    num_query_groups: GROUPS unless given (HEADS: multi-head attention, one query head per group);
    tied: the output layer is the word embeddings (Megatron's default; the trainers' argv unties);
    layers: transformer layers (LAYERS, read at the call: benchmarks resize the module, unless given);
    qk_layernorm, kv_channels: --qk-layernorm's per-head q/k norms, --kv-channels' head size (Qwen3);
    yarn: YaRN's settings (family_flags.yarn_settings), set as the torch trainer sets them for a dense model;
    mla: MLATransformerConfig's fields of multi-latent attention (its sizes, rope_type and YaRN's settings);
    mtp: mtp_num_layers and mtp_loss_scaling_factor: Megatron-Core's MTP block after the decoder."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    config_class = MLATransformerConfig if mla else TransformerConfig
    config = config_class(**(mla or {}), **(mtp or {}), num_layers=layers or LAYERS, hidden_size=HIDDEN,
                               num_attention_heads=HEADS,
                               num_query_groups=num_query_groups or GROUPS, ffn_hidden_size=FFN,
                               use_cpu_initialization=True,
                               normalization=normalization, layernorm_epsilon=1e-5, gated_linear_unit=swiglu,
                               activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
                               add_bias_linear=False,
                               tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0,
                               qk_layernorm=qk_layernorm, kv_channels=kv_channels)
    spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm,
                                    multi_latent_attention=bool(mla))
    if yarn:
        for name, value in yarn.items():
            setattr(config, f"yarn_{name}", value)
        config.yarn_correction_range_round_to_int = True
        position_embedding_type = "yarn"
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp else None
    return GPTModel(config, spec, vocab_size=VOCAB, mtp_block_spec=mtp_spec,
                    max_sequence_length=SEQ, position_embedding_type=position_embedding_type,
                    share_embeddings_and_output_weights=tied)


def save_torch_init(model, ckpt: str) -> None:
    """The torch model's initial weights as the neutral checkpoint both sides start from."""
    import torch
    nf.save(ckpt, 0, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()
                      if torch.is_tensor(v) and not k.endswith("_extra_state") and v.is_floating_point()},
            meta={"backend": "torch"})


def megatron_adamw(params):
    """torch.optim.AdamW over Megatron-Core's default param groups (no weight decay on 1-D
    parameters: norms, biases) with OPT's settings; the lr is set per step."""
    import torch
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": OPT["weight_decay"]},
                              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                             lr=OPT["lr"], betas=OPT["betas"], eps=OPT["eps"])


def clip_like_megatron(params, norm: float, max_norm: float = OPT["clip"]) -> None:
    """Megatron's clipping: gradients scaled by max_norm / (norm + 1e-6) when that is below 1."""
    coeff = max_norm / (norm + 1e-6)
    if coeff < 1.0:
        for p in params:
            p.grad.mul_(coeff)


def _torch_loss(model, step, batch_fn=None):
    """batch_fn(step): torch tensors tokens, labels, loss_mask, position_ids, attention_mask
    (None: batch(step) with plain positions and the causal mask)."""
    import torch
    if batch_fn is not None:
        mb = batch_fn(step)
        tokens, labels, mask, position_ids, attention_mask = (mb[k] for k in ("tokens", "labels", "loss_mask",
                                                                               "position_ids", "attention_mask"))
    else:
        tokens, labels, mask = (torch.from_numpy(a.astype(np.int64) if a.dtype != np.float32 else a)
                                for a in batch(step))
        position_ids, attention_mask = torch.arange(SEQ).unsqueeze(0).expand(MBS, -1), None
    # MTP's loss masks its tokens by loss_mask (rolled), as the torch trainer's forward_step passes it
    extra = {"loss_mask": mask} if model.config.mtp_num_layers else {}
    per_token = model(tokens, position_ids, attention_mask, labels=labels, **extra)          # [b, s]
    return (per_token * mask).sum() / mask.sum()


def load_into_torch(model, ckpt, tp_rank, tp, gated: bool = True):
    import torch
    arrays = nf.megatron_state_dict_arrays(ckpt, tp_rank, tp, gated)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in arrays.items()},
                                                strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith("_extra_state") for k in missing), missing


def _sum_replicated_partial_grads(model, tp_group) -> None:
    """What Megatron-Core's finalize_model_grads does for TP-replicated weights whose gradient each TP
    rank holds only a part of (the q/k norms: each rank normalized its own heads), by its own
    function (the harness trains the bare GPTModel, without Megatron's DDP and its config)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
    model.ddp_config = DistributedDataParallelConfig()
    _allreduce_non_tensor_model_parallel_grads([model], model.config, tp_group)


def torch_train(rank, world_size, tp, init_ckpt, save_init, other_ckpt=None, model_kw=None, steps=STEPS,
                batch_fn=None, adapt_argv=()):
    """Harness body: train `steps` steps; with save_init, first write the initial weights.
    model_kw: build_torch_model's keywords (the model variant); batch_fn: _torch_loss's;
    adapt_argv: MindSpeed flags whose features Megatron-Core runs with (the feature under test)."""
    import torch
    import mindspeed
    mindspeed.adapt(list(adapt_argv))
    from megatron.core import parallel_state
    from tests_extend import megatron_tiny
    megatron_tiny.init_parallel(tp=tp)
    tp_rank, tp_group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
    model_kw = dict(model_kw or {})
    gated = model_kw.get("swiglu", True)
    model = build_torch_model(tp, **model_kw)
    if save_init:
        assert tp == 1
        save_torch_init(model, init_ckpt)
    else:
        load_into_torch(model, init_ckpt, tp_rank, tp, gated)
    params = list(model.named_parameters())
    opt = megatron_adamw(p for _, p in params)
    losses, norms = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.zero_grad()
        loss = _torch_loss(model, step, batch_fn)
        loss.backward()
        _sum_replicated_partial_grads(model, tp_group)
        sq = sum(float(p.grad.double().square().sum()) for _, p in params
                 if getattr(p, "tensor_model_parallel", False) or tp_rank == 0)
        sq_t = torch.tensor([sq], dtype=torch.float64)
        torch.distributed.all_reduce(sq_t, group=tp_group)
        norms.append(float(sq_t.sqrt()))
        clip_like_megatron([p for _, p in params], norms[-1])
        opt.step()
        losses.append(loss.item())
    result = {"losses": losses, "grad_norms": norms}
    if other_ckpt:      # a checkpoint the MindSpore trainer wrote: load it here and evaluate
        fresh = build_torch_model(tp, **model_kw)
        load_into_torch(fresh, other_ckpt, tp_rank, tp, gated)
        with torch.no_grad():
            result["eval_loss_of_other"] = _torch_loss(fresh, EVAL_SEED, batch_fn).item()
    return result


def torch_yarn(rank, world_size, init_ckpt: str, other_ckpt: str, yarn: dict, table_settings: list) -> dict:
    """Harness body: torch_train at TP=1 with YaRN's `yarn` settings (evaluating `other_ckpt`), then
    Megatron-Core's YaRN tables and defaults (_yarn_tables)."""
    result = torch_train(rank, world_size, 1, init_ckpt, False, other_ckpt, {"yarn": yarn})
    result["tables"], result["defaults"] = _yarn_tables(table_settings)
    return result


def _yarn_tables(settings: list) -> tuple:
    """Megatron-Core's YarnRotaryEmbedding cos tables (times its concentration factor, as its rotation
    applies it) for each (kv_channels, rotary_base, seq, yarn settings), and its MLATransformerConfig's YaRN
    defaults."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    tables = []
    for kv_channels, base, seq, yarn in settings:
        rope = YarnRotaryEmbedding(kv_channels, rotary_base=base, use_cpu_initialization=True,
                                   scaling_factor=yarn["rotary_scaling_factor"], beta_fast=yarn["beta_fast"],
                                   beta_slow=yarn["beta_slow"], mscale=yarn["mscale"],
                                   mscale_all_dim=yarn["mscale_all_dim"],
                                   original_max_position_embeddings=yarn["original_max_position_embeddings"])
        emb, concentration = rope(seq)
        tables.append((emb.cos() * concentration).reshape(seq, -1).numpy().tolist())
    fields = MLATransformerConfig.__dataclass_fields__
    defaults = {name: fields[name].default for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                                                        "original_max_position_embeddings")}
    return tables, defaults
