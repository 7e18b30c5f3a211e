"""`python -m mindspeed plot RUN [RUN ...] [-o loss.png]`: loss (and throughput) curves of one or
more runs in one figure. A RUN is a training log (Megatron-format lines), a --log-loss-file, or a
--tensorboard-dir; the legend names each run after its path."""
from __future__ import annotations

import argparse

from mindspeed.errors import report
from mindspeed.plotting import figure
from mindspeed.plotting.runs import SERIES, PlotError, read_run, run_names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mindspeed plot",
                                description="plot train/validation loss and tokens/s against iteration")
    p.add_argument("runs", nargs="+", metavar="RUN", help="a training log, a --log-loss-file or a TensorBoard dir")
    p.add_argument("-o", "--output", default="loss.png", help="image file to write (default: loss.png)")
    p.add_argument("--title", default=None, help="figure title")
    return p


def plot(paths: list[str], output: str, title: str | None = None) -> dict:
    """Draw the runs into `output`; returns {run name: {series: number of points}}."""
    runs = [read_run(path, name) for path, name in zip(paths, run_names(paths))]
    fig = figure.draw(runs, title)
    figure.save(fig, output)
    return {run.name: {s: len(run.series[s]) for s in SERIES} for run in runs}


def main(argv=None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        summary = plot(ns.runs, ns.output, ns.title)
    except (PlotError, OSError) as exc:
        report(exc)
        return 2
    for name, counts in summary.items():
        print(f"{name}: " + ", ".join(f"{s} {n} points" for s, n in counts.items() if n))
    print(f"wrote {ns.output}")
    return 0
