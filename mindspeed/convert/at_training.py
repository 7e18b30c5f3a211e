"""MindSpeed-LLM's --enable-hf2mg-convert on the torch trainer: the Hugging Face model that --load names
is converted (hf_to_mg, in this process) for the run's TP/PP/EP sizes, checkpoint format, parameter
dtype, uneven pipeline split and --moe-grouped-gemm into --mg-save-dir (default <load>/megatron_cache_tp<T>pp<P>ep<E>, as
MindSpeed-LLM names it), and the run loads that instead, as a converted checkpoint (iteration 0, no
optimizer state: the run loads it as with --finetune). --model-type-hf, when not given, is the one
config.json's model_type converts as.

As in MindSpeed-LLM every start converts again (the cache is this converter's, recognised by its
convert_info.json; any other non-empty directory there is refused). Rank 0 converts; the other ranks
of the run wait for its completion marker, which names the run (the launcher's rendezvous)."""
from __future__ import annotations

import json
import os
import shutil
import time

from mindspeed.convert import sidecar
from mindspeed.convert.arch import SUGGESTED
from mindspeed.errors import ConvertError

DONE = ".converted_for_run"


def cache_dir(args) -> str:
    if args.mg_save_dir:
        return args.mg_save_dir
    return os.path.join(args.load, f"megatron_cache_tp{args.tensor_model_parallel_size}"
                                   f"pp{args.pipeline_model_parallel_size}ep{args.expert_model_parallel_size}")


def model_type_hf(args) -> str:
    """--model-type-hf, else the type config.json's model_type converts as."""
    if args.model_type_hf:
        return args.model_type_hf
    path = os.path.join(args.load, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            kind = json.load(f).get("model_type")
    except (OSError, ValueError) as err:
        raise ConvertError(f"--enable-hf2mg-convert: --load {args.load} is not a Hugging Face model ({path}: "
                           f"{type(err).__name__}); give the model's directory") from None
    if kind not in SUGGESTED:
        raise ConvertError(f"--enable-hf2mg-convert: config.json model_type {kind!r} is not one the converter "
                           f"knows ({', '.join(sorted(SUGGESTED))})")
    return SUGGESTED[kind]


def converter_argv(args, save_dir: str) -> list[str]:
    """convert_ckpt.py's command line for this run."""
    argv = ["--load-model-type", "hf", "--save-model-type", "mg", "--model-type-hf", model_type_hf(args),
            "--load-dir", args.load, "--save-dir", save_dir,
            "--target-tensor-parallel-size", str(args.tensor_model_parallel_size),
            "--target-pipeline-parallel-size", str(args.pipeline_model_parallel_size),
            "--target-expert-parallel-size", str(args.expert_model_parallel_size),
            "--make-vocab-size-divisible-by", str(args.make_vocab_size_divisible_by),
            "--params-dtype", "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
            "--ckpt-format", "torch" if args.ckpt_format == "torch" else "torch_dist"]
    stages = layer_list(args)
    if stages:
        argv += ["--num-layer-list", ",".join(map(str, stages))]
    if args.padded_vocab_size:
        argv += ["--padded-vocab-size", str(args.padded_vocab_size)]
    if args.add_qkv_bias:
        argv.append("--add-qkv-bias")
    if args.moe_grouped_gemm:
        argv.append("--moe-grouped-gemm")
    return argv


def layer_list(args) -> list[int] | None:
    """The run's uneven pipeline split (--decoder-first/last-pipeline-num-layers) as --num-layer-list; None
    for an even one (the stages between share the other layers, as Megatron-Core splits them)."""
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    pp = args.pipeline_model_parallel_size
    if pp == 1 or (first is None and last is None):
        return None
    given = [n for n in (first, last) if n is not None]
    each = (args.num_layers - sum(given)) // max(1, pp - len(given))
    return [each if first is None else first] + [each] * (pp - 2) + [each if last is None else last]


def _marker_says(marker: str, token: str) -> bool:
    try:
        with open(marker, encoding="utf-8") as f:
            return f.read() == token
    except FileNotFoundError:
        return False


def _run_token() -> str:
    """The same on every rank of one launch, different between launches."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "") + "@" + os.environ.get("MASTER_ADDR", "") + ":" + \
        os.environ.get("MASTER_PORT", str(os.getppid()))


def _clear_cache(save_dir: str) -> None:
    if not os.path.exists(save_dir) or (os.path.isdir(save_dir) and not os.listdir(save_dir)):
        return
    if not os.path.isfile(os.path.join(save_dir, sidecar.INFO_FILE)):
        raise ConvertError(f"--enable-hf2mg-convert: {save_dir} holds something other than this converter's "
                           "output: move it, or give --mg-save-dir another directory")
    shutil.rmtree(save_dir)


def convert_load(args, log=print, wait_minutes: float = 30.0) -> None:
    """Convert --load's Hugging Face model for this run and point args.load at the result."""
    from mindspeed.convert import cli, hf_to_mg
    save_dir = cache_dir(args)
    marker, token = os.path.join(save_dir, DONE), _run_token()
    if int(os.environ.get("RANK", "0")) == 0:
        opts = cli.build_parser().parse_args(converter_argv(args, save_dir))
        _clear_cache(save_dir)
        hf_to_mg.convert(opts, log=log)
        with open(marker, "w", encoding="utf-8") as f:
            f.write(token)
    else:
        deadline = time.monotonic() + 60 * wait_minutes
        while not _marker_says(marker, token):
            if time.monotonic() > deadline:
                raise ConvertError(f"--enable-hf2mg-convert: rank 0 did not finish converting into {save_dir} "
                                   f"within {wait_minutes:g} minutes")
            time.sleep(1.0)
    log(f"> --enable-hf2mg-convert: loading {save_dir}, converted from {args.load}, as with --finetune "
        "(iteration 0, no optimizer state)")
    args.load, args.finetune = save_dir, True
