"""Pretrain a GPT with MindSpeed on Megatron-Core (or on MindSpore with --backend mindspore).

    torchrun --nproc_per_node 2 tests_extend/example/pretrain_gpt.py --tensor-model-parallel-size 2 ...
    (see train_distributed.sh; without --data-path the bundled Shakespeare dataset is built and used)
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # run from source


def main(argv=None) -> int:
    if os.environ.get("MS_ROLE") == "MS_SCHED" and os.environ.get("MINDSPEED_NODE_RANK", "0") != "0":
        # msrun starts a scheduler on every node whose address is MASTER_ADDR: nodes sharing the
        # master's machine would start a second one (its port is taken). Node 0's coordinates.
        return 0
    from mindspeed.errors import ArgumentError, hide_fallback_warnings, report
    from mindspeed.flags.trainer_flags import parse_args
    hide_fallback_warnings()
    try:
        args = parse_args(argv)
    except ArgumentError as err:
        report(err)
        return 2
    from mindspeed import deferred_compile
    from mindspeed.patching import GLOBAL_PATCHES
    deferred_compile.install(GLOBAL_PATCHES)   # before Megatron's import (either trainer): ~4 s of each rank's start
    import mindspeed
    from mindspeed.adaptor_core import MindSpeedConfigError
    from mindspeed.backends import BackendUnavailableError
    from mindspeed.data import DataError, TokenizerError
    from mindspeed.errors import CheckpointError, CollectiveTimeout, ConvertError
    user_errors = (MindSpeedConfigError, BackendUnavailableError, DataError, TokenizerError, CheckpointError,
                   ConvertError)
    try:
        if args.enable_hf2mg_convert:       # MindSpeed-LLM's: convert --load's Hugging Face model first
            from mindspeed.convert.at_training import convert_load
            convert_load(args, log=print if os.environ.get("RANK", "0") == "0" else (lambda msg: None))
        if args.backend == "mindspore":
            from mindspeed.training import mindspore as ms_trainer   # imported only when asked for
            from mindspeed.training.mindspore.trainer import TrainerConfigError
            user_errors += (TrainerConfigError,)
            ms_trainer.run(args)
        else:
            # device shim + enabled features, before the model exists; the trainer puts the features'
            # modules into its layer spec itself (nothing patches Megatron-Core's spec providers)
            session = mindspeed.adapt(args, specs_from_session=True)
            from mindspeed.training.pretrain import run
            run(args, session)
    except user_errors as err:
        report(err)
        return 2
    except CollectiveTimeout as err:    # a rank hangs or died: not the user's input
        report(err)
        return 1
    return 0


if __name__ == "__main__":
    from mindspeed.backends.mindspore.worker_exit import finish    # imports no framework
    code = main()
    # a MindSpore worker under mindspeed.msrun, where every rank succeeded: the end without MindSpore's exit handler
    sys.exit(finish(code) if code == 0 else code)
