"""`python -m mindspeed matrix [--markdown|--json]`: print the support matrix.
`python -m mindspeed check [flags...]`: exit non-zero when the flags ask for something the chosen
backend cannot run (the same gate training runs before it starts; Megatron flags not given take
the built-in trainers' defaults).
`python -m mindspeed plot RUN [RUN ...] [-o loss.png]`: loss and throughput curves (mindspeed.plotting)."""
from __future__ import annotations

import argparse
import functools
import sys

from mindspeed import support_matrix
from mindspeed.adaptor_core import MindSpeedConfigError, plan
from mindspeed.errors import report
from mindspeed.plotting import main as plot_main
from mindspeed.readme import update_docs


@functools.lru_cache(maxsize=1)
def command_parser() -> argparse.ArgumentParser:
    """The subcommands' parser: built once (argparse looks up its message catalogue for every
    parser it makes, a file-system search each time), then only parsed with."""
    parser = argparse.ArgumentParser(prog="python -m mindspeed")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("matrix", help="print the support matrix")
    m.add_argument("--json", action="store_true", help="JSON instead of markdown")
    m.add_argument("--markdown", action="store_true", help="markdown table (default)")
    sub.add_parser("flags", help="print every MindSpeed flag as a markdown table")
    sub.add_parser("readme", aliases=["docs"],
                   help="rewrite the generated sections of docs/support-matrix.md and docs/flags.md in place")
    sub.add_parser("check", help="validate MindSpeed flags against the support matrix", add_help=False)
    sub.add_parser("plot", help="plot loss and throughput of training logs / TensorBoard dirs", add_help=False)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns, rest = command_parser().parse_known_args(argv)
    if ns.command == "matrix":
        print(support_matrix.to_json() if ns.json else support_matrix.to_markdown())
        return 0
    if ns.command == "flags":
        print(support_matrix.flags_markdown())
        return 0
    if ns.command == "plot":
        return plot_main(rest)
    if ns.command in ("readme", "docs"):
        print(update_docs())
        return 0
    try:
        result = plan(rest, unknown_flags="trainer")    # answers for the built-in trainers' defaults
    except MindSpeedConfigError as exc:
        report(exc, prefix="")
        return 2
    print("\n".join([result.describe(), *result.notes()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
