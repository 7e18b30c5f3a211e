"""The pipeline-parallel parity experiment: mindspore_parity's GPT and optimizer with a
global batch of MICRO micro-batches, trained by Megatron-Core's GPTModel on torch at PP=1
(gradients accumulated over the micro-batches: mathematically what 1F1B computes) and by the
MindSpore trainer at PP=2 (two msrun processes, the 1F1B schedule of pipeline.py)."""
from __future__ import annotations

import numpy as np

from tests_extend.distributed import mindspore_parity as mp

MICRO = 4            # micro-batches per global batch: 1F1B's warmup, steady state and cooldown all run


def micro_batches(step: int) -> list:
    return [dict(zip(("tokens", "labels", "loss_mask"), mp.batch(MICRO * step + k))) for k in range(MICRO)]


LENGTHS = (16, 11, 6, 13)     # --variable-seq-lengths: each micro-batch as long as its longest sample
VARIABLE_STEPS = 4


def padded_micro_batches(step: int) -> list:
    """micro_batches(step) with every token past its micro-batch's length padding (no loss): the
    full --seq-length micro-batches an instruction dataset gives without --variable-seq-lengths."""
    out = []
    for mb, length in zip(micro_batches(step), LENGTHS):
        mask = mb["loss_mask"].copy()
        mask[:, length:] = 0.0
        out.append(dict(mb, loss_mask=mask))
    return out


def variable_micro_batches(step: int) -> list:
    """The same micro-batches cut to their lengths, as the trainer's data makes them with the flag."""
    return [{k: v[:, :length] for k, v in mb.items()} for mb, length in zip(padded_micro_batches(step), LENGTHS)]


EOD_STEPS = 3        # --reset-attention-mask: packed documents, each micro-batch its own documents' mask


def eod_micro_batches(step: int, torch_side: bool = False) -> list:
    """MICRO micro-batches of packed documents (mindspore_parity_eod's), with the documents' mask the
    MindSpore data pipeline builds, or (torch_side) the one Megatron's _get_ltor_masks_and_position_ids builds."""
    from tests_extend.distributed import mindspore_parity_eod as pe
    make = pe.torch_batch if torch_side else pe.ms_batch
    return [make(MICRO * step + k, pe.DOCUMENT_FLAGS) for k in range(MICRO)]


def eval_batches() -> list:
    return [dict(zip(("tokens", "labels", "loss_mask"), mp.batch(mp.EVAL_SEED)))]


# -- mindspore side ------------------------------------------------------------------------------
VPP_LAYERS = 4       # the virtual pipeline case: 4 layers, 1 per virtual stage (2 model chunks per stage)
VPP_FLAGS = ("--num-layers-per-virtual-pipeline-stage", "1")
UNALIGNED_FLAGS = ("--pipeline-num-transformer-layers", "[[0,2],[1,1]]")   # stage 0's first chunk: the embedding only
UNALIGNED_STEPS = 6     # CI time: the VPP case covers the interleaved schedule's 20 steps


def ms_argv(pp: int, tied: bool = False, dp: int = 1, layers: int = mp.LAYERS) -> list:
    """The trainer's flags at PP=pp x DP=dp (tied: without --untie-embeddings-and-output-weights)."""
    argv = mp.trainer_argv(1) + ["--global-batch-size", str(mp.MBS * MICRO * dp),
                                 "--pipeline-model-parallel-size", str(pp)]
    argv[argv.index("--num-layers") + 1] = str(layers)
    return [a for a in argv if a != "--untie-embeddings-and-output-weights"] if tied else argv


def ms_train_pp(backend, pp: int, init_ckpt: str, save_dir: str | None = None, steps: int = mp.STEPS,
                extra: tuple = (), tied: bool = False, batches=micro_batches, layers: int = mp.LAYERS,
                held_out=eval_batches) -> dict:
    """Through the support matrix (mindspeed.adapt) as the trainer goes; returns losses, grad norms,
    the held-out loss, and whether the run was PyNative. `extra`: more trainer flags; tied: the
    output layer is the word embeddings; batches(step): the step's micro-batches; held_out(): the
    evaluated ones."""
    import mindspeed
    from mindspeed.backends import get_backend
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.mindspore import checkpoint
    from mindspeed.training.mindspore.model import GPTConfig
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    dp = backend.comm.world_size() // pp
    argv = ms_argv(pp, tied, dp, layers) + list(extra)
    args = parse_args(argv, world_size=backend.comm.world_size())
    args.backend = "mindspore"
    mindspeed.adapt(args)
    try:
        backend = get_backend()
        ps = build_parallel_state(backend.comm, 1, False, 1, pp)
        trainer = Trainer(args, backend, ps, GPTConfig.from_args(args, mp.VOCAB))
        checkpoint.load(init_ckpt, trainer.model)
        losses, norms = [], []
        for step in range(steps):
            # each DP replica its own micro-batches (at DP=1 step's own)
            loss, norm, lr = trainer.train_step(batches(dp * step + ps.dp_rank), step + 1)
            assert abs(lr - mp.lr_at(step)) < 1e-12
            losses.append(loss)
            norms.append(norm)
        eval_loss = trainer.evaluate(held_out())
        if save_dir:
            checkpoint.save(backend, ps, save_dir, steps, trainer.model, trainer.optimizer, {"backend": "mindspore"})
        return {"losses": losses, "grad_norms": norms, "eval_loss": eval_loss, "graph_mode": trainer.graph_mode,
                "layers": list(trainer.model.layers), "params": sorted(trainer.model.params),
                "pipeline": type(trainer.pipeline).__name__}
    finally:
        mindspeed.unadapt()


# -- torch side (Megatron-Core GPTModel at PP=1, in the gloo harness) ----------------------------
def torch_train_accumulated_dp(rank, world_size, init_ckpt):
    """DP=world_size from init_ckpt: each replica accumulates MICRO micro-batches of its own
    (micro_batches(dp x step + dp rank)), the gradients are averaged over DP; the loss is the DP mean."""
    import mindspeed
    mindspeed.adapt([])
    from megatron.core import parallel_state
    from tests_extend import megatron_tiny
    megatron_tiny.init_parallel(tp=1)
    model = mp.build_torch_model(1)
    mp.load_into_torch(model, init_ckpt, 0, 1)
    return _train_accumulated(model, lambda step: micro_batches(world_size * step + rank),
                              parallel_state.get_data_parallel_group(), world_size)


def torch_references(rank, world_size, init_ckpt):
    """torch_train_accumulated untied (initial weights at init_ckpt), tied (at init_ckpt_tied), on
    padded_micro_batches (at init_ckpt_variable), tied with VPP_LAYERS layers (at init_ckpt_vpp), and on
    packed documents with their mask (at init_ckpt_eod)."""
    return {"untied": torch_train_accumulated(rank, world_size, init_ckpt),
            "tied": torch_train_accumulated(rank, world_size, init_ckpt + "_tied", tied=True),
            "vpp": torch_train_accumulated(rank, world_size, init_ckpt + "_vpp", tied=True, layers=VPP_LAYERS),
            "variable": torch_train_accumulated(rank, world_size, init_ckpt + "_variable",
                                                batches=padded_micro_batches, steps=VARIABLE_STEPS),
            "eod": torch_train_accumulated(rank, world_size, init_ckpt + "_eod", steps=EOD_STEPS,
                                           batches=lambda step: eod_micro_batches(step, torch_side=True))}


def torch_train_accumulated(rank, world_size, init_ckpt, tied: bool = False, batches=micro_batches,
                            steps: int = mp.STEPS, layers: int = mp.LAYERS):
    """Write the initial weights, then train `steps` steps of MICRO micro-batches each (batches(step))."""
    import mindspeed
    mindspeed.adapt([])
    from tests_extend import megatron_tiny
    megatron_tiny.init_parallel(tp=1)
    model = mp.build_torch_model(1, tied=tied, layers=layers)
    mp.save_torch_init(model, init_ckpt)
    return _train_accumulated(model, batches, steps=steps)


def _train_accumulated(model, batches_of_step, dp_group=None, dp: int = 1, steps: int = mp.STEPS) -> dict:
    """mp.STEPS AdamW steps, each over batches_of_step(step)'s micro-batches with their gradients
    accumulated (Megatron's schedule divides each loss by the micro-batch count), averaged over
    dp_group's replicas when given; the losses are the step means (over DP too)."""
    import torch
    params = list(model.parameters())
    opt = mp.megatron_adamw(params)
    position_ids = torch.arange(mp.SEQ).unsqueeze(0).expand(mp.MBS, -1)
    losses, norms = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = mp.lr_at(step)
        opt.zero_grad()
        total = 0.0
        for mb in batches_of_step(step):
            tokens, labels = (torch.as_tensor(mb[k]).long() for k in ("tokens", "labels"))
            mask = torch.as_tensor(mb["loss_mask"])
            per_token = model(tokens, position_ids, mb.get("attention_mask"), labels=labels)
            loss = (per_token * mask).sum() / mask.sum()
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        if dp_group is not None:
            for p in params:
                torch.distributed.all_reduce(p.grad, group=dp_group)
                p.grad.div_(dp)
            mean = torch.tensor(total, dtype=torch.float64)
            torch.distributed.all_reduce(mean, group=dp_group)
            total = float(mean) / dp
        norm = float(torch.sqrt(sum(p.grad.double().square().sum() for p in params)))
        mp.clip_like_megatron(params, norm)
        opt.step()
        losses.append(total)
        norms.append(norm)
    return {"losses": losses, "grad_norms": norms}
