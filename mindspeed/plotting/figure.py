"""One figure for several runs: train loss (line) and validation loss (markers) against iteration,
and, when any run logged it, throughput in tokens/s on a second panel. One colour per run."""
from __future__ import annotations

from mindspeed.plotting.runs import TOKENS, TRAIN, VALID, PlotError, Run


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotError("plotting needs matplotlib: pip install -e \".[plot]\" "
                        "(matplotlib==3.11.2)") from exc
    matplotlib.use("Agg")          # files only: no display on a training machine
    import matplotlib.pyplot as plt
    return plt


def draw(runs: list[Run], title: str | None = None):
    """The matplotlib Figure (axes[0]: loss; axes[1]: tokens/s, only when some run has it)."""
    plt = _pyplot()
    with_tokens = any(run.series[TOKENS] for run in runs)
    fig, axes = plt.subplots(2 if with_tokens else 1, 1, sharex=True, squeeze=False,
                             figsize=(8, 7 if with_tokens else 4.5))
    loss_ax = axes[0][0]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, run in enumerate(runs):
        colour = colours[k % len(colours)]
        if run.series[TRAIN]:
            loss_ax.plot(*run.points(TRAIN), color=colour, linewidth=1.2, label=f"{run.name} train")
        if run.series[VALID]:
            loss_ax.plot(*run.points(VALID), color=colour, linestyle="--", marker="o",
                         label=f"{run.name} validation")
        if with_tokens and run.series[TOKENS]:
            axes[1][0].plot(*run.points(TOKENS), color=colour, linewidth=1.2, label=run.name)
    loss_ax.set_ylabel("lm loss (nats/token)")
    loss_ax.set_title(title or "training loss")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize="small")
    if with_tokens:
        axes[1][0].set_ylabel("throughput (tokens/s)")
        axes[1][0].grid(alpha=0.3)
        axes[1][0].legend(fontsize="small")
    axes[-1][0].set_xlabel("iteration")
    fig.tight_layout()
    return fig


def save(fig, path: str) -> None:
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
