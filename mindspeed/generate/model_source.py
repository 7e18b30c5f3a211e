"""The trainer arguments that rebuild a checkpoint's model, from the JSON beside it: run_flags.json
(either trainer's run, mindspeed.checkpoint.run_flags) or convert_info.json (`python -m
mindspeed.convert`). The parallel layout is the launch's: tensor parallel over every process, no
pipeline, context or data parallelism (generation and evaluation run one sequence at a time)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mindspeed.checkpoint import run_flags
from mindspeed.convert import sidecar
from mindspeed.errors import ArgumentError, CheckpointError, InferenceError
from mindspeed.flags.trainer_flags import padded_vocab_size, parse_args

# what a single-sequence launch switches off whatever the run used
NO_PIPELINE = dict(pipeline_model_parallel_size=1, context_parallel_size=1, expert_model_parallel_size=1,
                   num_layers_per_virtual_pipeline_stage=None, decoder_first_pipeline_num_layers=None,
                   decoder_last_pipeline_num_layers=None, pipeline_model_parallel_layout=None,
                   sequence_parallel=False, recompute_granularity=None, recompute_method=None,
                   recompute_num_layers=None, hidden_dropout=0.0, attention_dropout=0.0)


@dataclass
class ModelSource:
    args: object        # the trainer's argument namespace for this launch
    origin: str         # "torch", "mindspore" (the trainer that wrote it) or "convert"
    vocab_size: int     # the model's real vocabulary (rows beyond it are padding)
    run_args: dict      # the run's own values (run_flags.json), empty for a conversion


def read_source(load_dir: str, world_size: int) -> ModelSource:
    """The arguments of the model in `load_dir` at tensor parallel size `world_size`."""
    if not os.path.isdir(load_dir):
        raise InferenceError(f"--load {load_dir} does not exist or is not a directory")
    try:
        body = run_flags.read(load_dir)
    except CheckpointError as err:
        raise InferenceError(str(err)) from None
    if body is not None:
        args, origin = _from_run(body, load_dir), str(body.get("trainer", "torch"))
    elif os.path.isfile(os.path.join(load_dir, sidecar.INFO_FILE)):
        args, origin = _from_conversion(load_dir), "convert"
    else:
        raise InferenceError(f"--load {load_dir} has neither {run_flags.RUN_FLAGS_FILE} (written beside the "
                             f"checkpoints by both trainers' --save) nor {sidecar.INFO_FILE} (written by "
                             "`python -m mindspeed.convert`): nothing says how to rebuild its model")
    vocab = args.vocab_size
    if not vocab:
        raise InferenceError(f"the model flags of {load_dir} hold no vocabulary size")
    _set_layout(args, world_size, load_dir)
    args.load = load_dir
    return ModelSource(args=args, origin=origin, vocab_size=int(vocab), run_args=dict(body["args"]) if body else {})


def _from_run(body: dict, load_dir: str):
    saved = body["args"]
    if saved.get("lora_target_modules"):
        # a LoRA run's --save holds the adapters only; its base model is the run's --load
        base = saved.get("load") or "the run's --load"
        raise InferenceError(f"--load {load_dir} holds a LoRA run's adapters only: give the base model as --load "
                             f"({base}) and {load_dir} as --lora-load")
    try:    # every flag at the trainers' default, then the run's values over them
        args = parse_args(["--backend", "torch"], world_size=1)
    except ArgumentError as err:
        raise InferenceError(f"cannot rebuild the flags of {load_dir}: {err}") from None
    for key, value in saved.items():
        setattr(args, key, value)
    args.backend = "torch"          # the model is rebuilt on Megatron-Core whichever trainer wrote it
    args.padded_vocab_size = saved.get("padded_vocab_size")
    return args


def _from_conversion(load_dir: str):
    info = sidecar.read_info(load_dir)
    flags = list(info.get("trainer_flags") or [])
    tp = int(info.get("target_tensor_parallel_size", 1)) * int(info.get("target_pipeline_parallel_size", 1))
    try:
        args = parse_args(flags + ["--backend", "torch"], world_size=tp)
    except ArgumentError as err:
        raise InferenceError(f"{os.path.join(load_dir, sidecar.INFO_FILE)}: its trainer flags do not parse "
                             f"({err})") from None
    args.vocab_size = info.get("vocab_size")
    args.padded_vocab_size = info.get("padded_vocab_size")
    length = _hf_max_positions(load_dir)
    if length:      # the Hugging Face model's context, not the trainer's default --seq-length
        args.seq_length = args.max_position_embeddings = length
    return args


def _hf_max_positions(load_dir: str) -> int | None:
    path = os.path.join(load_dir, sidecar.HF_CONFIG_DIR, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def _set_layout(args, tp: int, load_dir: str) -> None:
    for key, value in NO_PIPELINE.items():
        setattr(args, key, value)
    for name, count in (("--num-attention-heads", args.num_attention_heads),
                        ("--num-query-groups", args.num_query_groups), ("--ffn-hidden-size", args.ffn_hidden_size)):
        if count % tp:
            raise InferenceError(f"the model of {load_dir} has {name} {count}, which does not split over "
                                 f"{tp} tensor-parallel processes: launch a number of processes that divides it")
    args.tensor_model_parallel_size = args.world_size = tp
    args.data_parallel_size = 1
    # keep the checkpoint's padding where it splits over this TP size (a torch_dist checkpoint's
    # rows are fixed); else pad as the trainer would at this size (neutral checkpoints fit rows)
    saved = args.padded_vocab_size
    if not saved or saved % tp:
        args.padded_vocab_size = padded_vocab_size(int(args.vocab_size), args.make_vocab_size_divisible_by, tp)
