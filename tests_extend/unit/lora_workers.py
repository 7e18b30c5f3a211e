"""The torch trainer's LoRA at TP = world size on the converted tiny Llama (convert_kit), run by
tests_extend/unit/test_lora.py through harness.run_distributed (daemon=False: the checkpoint save
starts a helper process). One process group serves every check: train, save, resume, merge."""
from __future__ import annotations

import torch

from tests_extend.unit import convert_kit as kit

LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
        "--lora-r", "4", "--lora-alpha", "8"]
STEPS = 3


class _Log:
    def print(self, *_):
        pass


def trainer_args(mg_dir: str, world: int, extra=()):
    args = kit.trainer_args(mg_dir, tp=world, world_size=world,
                            extra=["--lr", "1e-2", "--micro-batch-size", "2", "--global-batch-size", "2",
                                   "--train-iters", "8", *LORA, *extra])
    args.finetune = False       # kit's --finetune is for the base model; LoRA reads --load so anyway
    args.device_name = "cpu"
    return args


def batches(vocab: int, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (2, 17), generator=g)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16),
                    "position_ids": torch.arange(16).expand(2, 16)})
    return out


def full_logits(trainer, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s, padded vocab] on every rank: the TP shards gathered."""
    from megatron.core import parallel_state
    model = trainer.model[0].module
    model.eval()
    with torch.no_grad():
        local = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None).float()
    model.train()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(group.size())]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def lora_report(rank: int, world: int, mg_dir: str, lora_dir: str, logits_file: str, extra=()) -> dict:
    import mindspeed
    from mindspeed.features.finetune import lora_megatron
    from mindspeed.training import pretrain
    args = trainer_args(mg_dir, world, ["--save", lora_dir, *extra])
    state = mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain._set_seeds(args)
    pretrain.init_batch_schedule(args, rank)
    lora = state.context.part("lora")
    trainer = pretrain.Trainer(args, _Log(), lora=lora)
    pretrain.resume_lora(args, trainer, _Log())
    model = trainer.model[0].module
    named = dict(model.named_parameters())
    adapter_names = sorted(n for n in named if lora.is_adapter_key(n))
    base_before = {n: p.detach().clone() for n, p in named.items() if n not in adapter_names}
    adapters_before = {n: named[n].detach().clone() for n in adapter_names}
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    data = batches(128, STEPS + 1)
    tokens = data[0]["tokens"]
    base_logits = full_logits(trainer, tokens)       # B starts at zero: the base model's logits

    losses = [trainer.train_step(iter([batch]))[0] for batch in data[:STEPS]]
    report = {
        "adapters": len(adapter_names), "trainable": sorted(n for n, p in named.items() if p.requires_grad),
        "adapter_names": adapter_names, "optimizer_params": len(in_optimizer),
        "optimizer_holds_only_adapters": in_optimizer == {id(named[n]) for n in adapter_names},
        "losses": losses,
        "base_changed": [n for n, p in base_before.items() if not torch.equal(p, named[n])],
        "adapters_unchanged": [n for n, p in adapters_before.items() if torch.equal(p, named[n])],
    }
    pretrain.loop_parts(args, trainer, None, None, state.backend).save(STEPS, STEPS * 2)
    trained_logits = full_logits(trainer, tokens)
    report["lora_moved_logits"] = float((trained_logits - base_logits).abs().max())
    if rank == 0:
        torch.save({"tokens": tokens, "base": base_logits, "trained": trained_logits}, logits_file)
    report["next_loss"] = trainer.train_step(iter([data[STEPS]]))[0]

    # a fresh trainer (other random adapters) resumed from the adapter checkpoint
    args.lora_load = lora_dir
    pretrain._set_seeds(args)
    torch.manual_seed(99)
    fresh = pretrain.Trainer(args, _Log(), lora=lora)
    report["resumed_at"] = pretrain.resume_lora(args, fresh, _Log())
    report["resumed_logits_diff"] = float((full_logits(fresh, tokens) - trained_logits).abs().max())
    report["resumed_next_loss"] = fresh.train_step(iter([data[STEPS]]))[0]

    unmerged = full_logits(fresh, tokens)
    report["merged"] = lora_megatron.merge(fresh.model)
    report["merge_diff"] = float((full_logits(fresh, tokens) - unmerged).abs().max())
    report["merge_scale"] = float(unmerged.abs().max())
    return report
