"""The validation loss of a checkpoint, computed the way the trainer that wrote it computes it.

torch trainer (and converted checkpoints): mindspeed.training.pretrain.validation_loss itself, the
mean over --eval-iters global batches of each batch's token-weighted loss, on Megatron-Core's
GPTDataset validation split. MindSpore trainer: its validation stream (training/mindspore/data.py)
and its average, the mean over every micro-batch of the micro-batch's mean token loss, with the
same weights in Megatron-Core's GPTModel (so equal up to float rounding between the frameworks)."""
from __future__ import annotations

import numpy as np
import torch

from mindspeed.data.flag_tokenizers import from_flags
from mindspeed.errors import InferenceError
from mindspeed.training import data, pretrain
from mindspeed.training.mindspore import data as ms_data
from mindspeed.training.mindspore.eod import EodRules


def torch_trainer_data(args, session, log):
    """(batch reader, validation dataset) as the torch trainer builds them from the run's flags and
    the features `session` applied."""
    tokenizer = pretrain.resolve_tokenizer(args, log=log)
    reader = data.BatchReader.for_session(session, args, tokenizer.eod)
    _train, valid, _test = data.build_datasets(args, tokenizer, packed=reader.packed)
    return reader, valid


def torch_trainer_loss(args, chunks, valid, reader) -> float | None:
    return pretrain.validation_loss(args, chunks, valid, reader, args.global_batch_size // args.micro_batch_size)


def mindspore_trainer_data(args, log):
    """(validation stream, EOD rules) as the MindSpore trainer builds them from the run's flags."""
    flag_tokenizer = from_flags(args)
    _vocab, _train, valid = ms_data.build_streams(args, log=log)
    wants_eod = args.eod_mask_loss or args.reset_position_ids or args.reset_attention_mask
    rules = EodRules.from_args(args, ms_data.eod_id(args, flag_tokenizer) if wants_eod else None)
    return valid, rules


def mindspore_trainer_loss(args, model, valid, rules) -> float | None:
    """Every data-parallel rank's micro-batches of a global batch are its consecutive slices of
    --micro-batch-size samples: the same set whatever the run's data-parallel size, so one rank
    walks them all."""
    if valid is None or args.eval_iters < 1:
        return None
    model.eval()
    losses = []
    with torch.no_grad():
        for k in range(args.eval_iters):
            for batch in ms_data.micro_batches_for_step(valid, k * args.global_batch_size, args, 0, 1, rules):
                losses.append(_micro_batch_loss(model, batch, args.device_name))
    return sum(losses) / len(losses)


def _micro_batch_loss(model, batch: dict, device: str) -> float:
    tokens = torch.from_numpy(np.asarray(batch["tokens"], np.int64)).to(device)
    labels = torch.from_numpy(np.asarray(batch["labels"], np.int64)).to(device)
    mask = torch.from_numpy(np.asarray(batch["loss_mask"], np.float32)).to(device)
    b, s = tokens.shape
    positions = batch.get("position_ids")
    positions = torch.arange(s, device=device).expand(b, s) if positions is None else \
        torch.from_numpy(np.asarray(positions, np.int64)).to(device)
    attention = batch.get("attention_mask")
    if attention is not None:
        attention = torch.from_numpy(np.asarray(attention, bool)).to(device)
    per_token = model(tokens, positions, attention, labels=labels).float()
    return float((per_token * mask).sum() / mask.sum())


def check_split(loss: float | None, load_dir: str) -> float:
    if loss is None:
        raise InferenceError(f"no validation split to evaluate {load_dir} on: the run's --split gives it none, "
                             "or --eval-iters is 0 (give --data-path and --eval-iters)")
    return loss
