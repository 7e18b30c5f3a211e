"""python -m mindspeed.training.mindspore [Megatron-style flags]: the MindSpore trainer directly."""
import sys

from mindspeed.backends.mindspore.worker_exit import finish
from mindspeed.errors import ArgumentError, report
from mindspeed.flags.trainer_flags import parse_args
from mindspeed.training.mindspore import run


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ArgumentError as err:
        report(err)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    code = main()
    # under mindspeed.msrun, where every rank succeeded: the end without MindSpore's exit handler
    sys.exit(finish(code) if code == 0 else code)
