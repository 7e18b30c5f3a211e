"""Batches of packed documents for the EOD parity test (test_mindspore_parity_eod.py): the same
tokens, with end-of-document tokens in them, given to Megatron-Core's GPTModel with the masks and
positions Megatron's own _get_ltor_masks_and_position_ids builds, and to the MindSpore trainer with
the ones its data pipeline builds (mindspeed/training/mindspore/eod.py)."""
from __future__ import annotations

import functools

import numpy as np

from tests_extend.distributed import mindspore_parity as mp

EOD = 0          # the character tokenizer's end-of-document id
FLAGS = ("--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask")


def raw_batch(step: int):
    """tokens/labels [b, s] from one stream of seq+1 tokens per sample, about 3 documents each."""
    rng = np.random.RandomState(7000 + (step if step == mp.EVAL_SEED else step % 4))
    stream = rng.randint(1, mp.VOCAB, (mp.MBS, mp.SEQ + 1))
    for row in stream:
        row[rng.choice(mp.SEQ, 3, replace=False)] = EOD
    mask = np.ones((mp.MBS, mp.SEQ), np.float32)
    mask[0, :3] = 0.0
    return stream[:, :-1].astype(np.int32), stream[:, 1:].astype(np.int32), mask


def ms_batch(step: int, flags=FLAGS) -> dict:
    from types import SimpleNamespace
    from mindspeed.training.mindspore.eod import EodRules
    tokens, labels, mask = raw_batch(step)
    args = SimpleNamespace(**{dest: f"--{dest.replace('_', '-')}" in flags
                              for dest in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")})
    return EodRules.from_args(args, EOD).apply({"tokens": tokens, "labels": labels, "loss_mask": mask})


def torch_batch(step: int, flags=FLAGS) -> dict:
    import torch
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    tokens, labels, mask = (torch.from_numpy(a) for a in raw_batch(step))
    rows = [_get_ltor_masks_and_position_ids(row, EOD, "--reset-position-ids" in flags,
                                             "--reset-attention-mask" in flags, "--eod-mask-loss" in flags, True)
            for row in tokens]
    return {"tokens": tokens.long(), "labels": labels.long(),
            "loss_mask": mask * torch.stack([r[1] for r in rows]),
            "attention_mask": torch.stack([r[0] for r in rows]),
            "position_ids": torch.stack([r[2] for r in rows])}


# model variant -> (build_torch_model's keywords, the MindSpore trainer's flags for it)
CASES = {"learned_positions": ({"position_embedding_type": "learned_absolute"},
                               ("--position-embedding-type", "learned_absolute")),
         "rope": ({}, ())}     # RoPE ignores position ids in both (Megatron-Core's GPTModel)


def init_ckpt(root: str, case: str) -> str:
    return f"{root}/init_{case}"


def torch_all(rank, world_size, root):
    """Harness body (one process): each case from its own torch-initialised weights."""
    return {case: mp.torch_train(rank, world_size, 1, init_ckpt(root, case), True, model_kw=kw, batch_fn=torch_batch)
            for case, (kw, _) in CASES.items()}


def ms_run(backend, root: str, case: str) -> dict:
    return mp.ms_train(backend, 1, False, init_ckpt(root, case), extra=FLAGS + CASES[case][1], batch_fn=ms_batch)


DOCUMENT_FLAGS = ("--eod-mask-loss", "--reset-attention-mask")
DOCUMENT_STEPS = 3


def ms_documents(backend, init_ckpt: str, cp: int = 1, flags=DOCUMENT_FLAGS) -> dict:
    """The documents' mask (RoPE: no reset positions) from `init_ckpt`; at CP=2 ring attention takes it
    as the batch's own mask (--attention-mask-type general)."""
    general = ("--attention-mask-type", "general") if cp > 1 else ()
    return mp.ms_train(backend, 1, False, init_ckpt, steps=DOCUMENT_STEPS, cp=cp,
                       cp_algo="megatron_cp_algo" if cp > 1 else None, extra=tuple(flags) + general,
                       batch_fn=functools.partial(ms_batch, flags=flags))
