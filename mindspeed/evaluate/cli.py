"""`python -m mindspeed.evaluate --load DIR [--data-path P]`: the loss and perplexity of a
checkpoint on a validation split, computed as the trainer that wrote it computes its validation
loss (mindspeed.evaluate.losses). The run's flags (run_flags.json beside the checkpoints) give the
model, the split and the batches; --data-path / --eval-iters replace the run's. Launch with
`torchrun --nproc_per_node N` for tensor parallelism over N processes.

Every input that cannot work is refused in one line (exit 2) before the model is built."""
from __future__ import annotations

import json
import math
import sys

import mindspeed
from mindspeed.adaptor_core import MindSpeedConfigError
from mindspeed.backends import BackendUnavailableError
from mindspeed.data import DataError, TokenizerError
from mindspeed.errors import ArgumentError, CheckpointError, InferenceError, OneLineParser, report
from mindspeed.evaluate import losses
from mindspeed.generate import lora_adapters
from mindspeed.generate.loading import load_model, quiet_frameworks, rank, start_processes, stop_processes, world_size
from mindspeed.generate.model_source import read_source
from mindspeed.training.layer_spec import SpecModules

USER_ERRORS = (ArgumentError, InferenceError, CheckpointError, DataError, TokenizerError, MindSpeedConfigError,
               BackendUnavailableError)


def build_parser(prog: str = "python -m mindspeed.evaluate") -> OneLineParser:
    p = OneLineParser(prog=prog, allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="a checkpoint directory of either trainer")
    p.add_argument("--data-path", nargs="+", default=None,
                   help="indexed-dataset prefix(es) whose validation split (the run's --split) is evaluated "
                        "(default: the run's --data-path)")
    p.add_argument("--eval-iters", type=int, default=None, help="global batches to evaluate (default: the run's)")
    p.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the latest")
    p.add_argument("--output-json", default=None, help='also write {"loss", "perplexity"} here')
    p.add_argument("--use-ema", action="store_true",
                   help="the checkpoint's EMA of the weights (--optimizer-selection fused_ema_adamw) instead of them")
    lora_adapters.add_flags(p)
    return p


def main(argv=None) -> int:
    try:
        opts = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        source = read_source(opts.load, world_size())
        if source.origin == "convert" and not opts.data_path:
            raise InferenceError(f"{opts.load} is a converted checkpoint with no run's data: give --data-path")
        args = source.args
        if opts.data_path:
            args.data_path = opts.data_path
            args.mock_data = False
        if opts.eval_iters is not None:
            if opts.eval_iters < 1:
                raise ArgumentError("--eval-iters must be a positive integer")
            args.eval_iters = opts.eval_iters
        lora = lora_adapters.settings(opts)
        with quiet_frameworks():
            loss = _evaluate(args, source.origin, opts, lora)
        if rank() == 0:
            _print(loss, opts)
    except USER_ERRORS as err:
        if rank() == 0:
            report(str(err))
        return 2
    return 0


def _evaluate(args, origin: str, opts, lora: dict) -> float:
    """`lora`: lora_adapters.settings, applied with the model's features ({}: none)."""
    say = print if rank() == 0 else (lambda _msg: None)
    if origin == "mindspore":
        # the model is Megatron-Core's: the device shim only (the run's features were MindSpore's)
        session = mindspeed.adapt(["--optimization-level", "0", *lora_adapters.as_flags(lora)])
    else:
        vars(args).update(lora)
        session = mindspeed.adapt(args, specs_from_session=True)   # the run's features: the trainer's kernels
    args.device_name = session.device
    split = (losses.mindspore_trainer_data(args, say) if origin == "mindspore"
             else losses.torch_trainer_data(args, session, say))
    start_processes(args)
    try:
        chunks = load_model(args, opts.ckpt_step, session.part("lora"), SpecModules.of(session), opts.use_ema)
        if origin == "mindspore":
            loss = losses.mindspore_trainer_loss(args, chunks[0], *split)
        else:
            loss = losses.torch_trainer_loss(args, chunks, split[1], split[0])
    finally:
        stop_processes()
        session.close()
    return losses.check_split(loss, opts.load)


def _print(loss: float, opts) -> None:
    ppl = math.exp(min(loss, 20.0))
    print(f"> {opts.load}: validation loss | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |", flush=True)
    if opts.output_json:
        with open(opts.output_json, "w", encoding="utf-8") as f:
            json.dump({"loss": loss, "perplexity": ppl}, f)
