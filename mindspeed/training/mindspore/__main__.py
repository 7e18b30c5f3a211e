"""python -m mindspeed.training.mindspore [Megatron-style flags]: the MindSpore trainer directly."""
import sys

from mindspeed.errors import report


def main(argv=None) -> int:
    from mindspeed.errors import ArgumentError
    from mindspeed.flags.trainer_flags import parse_args
    try:
        args = parse_args(argv)
    except ArgumentError as err:
        report(err)
        return 2
    from mindspeed.training.mindspore import run
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
