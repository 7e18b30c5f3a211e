"""Training curves read back from what the trainers write: Megatron-format log lines (both built-in
trainers print them; so does Megatron-LM), --log-loss-file JSON lines, or TensorBoard event files.

A run is {series name: {iteration: value}}; a later value for the same iteration wins (a resumed
run repeats the iterations after its checkpoint).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

TRAIN, VALID, TOKENS = "train loss", "validation loss", "tokens/s"
SERIES = (TRAIN, VALID, TOKENS)

_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"
_ITERATION = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|")
_TRAIN = re.compile(r"\|\s*lm loss: " + _NUMBER)
_TOKENS = re.compile(r"\|\s*tokens per second: " + _NUMBER)
# " validation loss at iteration 20 | lm loss value: ..." (also "final validation ...", and
# Megatron-LM's "... at iteration 20 on validation set |"; its "on test set" lines are not validation)
_VALID = re.compile(r"validation loss at iteration (\d+)(?![^|]*test set)[^|]*\|\s*lm loss value: " + _NUMBER)
# TensorBoard tags the trainers (and Megatron-LM) write
_TAGS = {"lm loss": TRAIN, "lm loss validation": VALID, "lm loss final validation": VALID,
         "tokens-per-second": TOKENS}
_EXPECTED = ("Megatron-format 'iteration N/ M | ... | lm loss: X |' lines, --log-loss-file JSON lines, "
             "or TensorBoard event files")


class PlotError(ValueError):
    """A path that cannot be plotted; one line for the user."""


@dataclass
class Run:
    name: str
    path: str
    series: dict = field(default_factory=lambda: {s: {} for s in SERIES})

    def points(self, series: str) -> tuple[list[int], list[float]]:
        items = sorted(self.series[series].items())
        return [i for i, _ in items], [v for _, v in items]


def read_run(path: str, name: str | None = None) -> Run:
    if not os.path.exists(path):
        raise PlotError(f"{path} does not exist")
    run = Run(name or run_names([path])[0], path)
    if os.path.isdir(path):
        _read_tensorboard(path, run)
    else:
        _read_log(path, run)
    if not run.series[TRAIN] and not run.series[VALID]:
        raise PlotError(f"{path} has no loss values (expected {_EXPECTED})")
    return run


def _read_log(path: str, run: Run) -> None:
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("{"):
                _read_json_line(line, run)
                continue
            it = _ITERATION.search(line)
            if it:
                for pattern, series in ((_TRAIN, TRAIN), (_TOKENS, TOKENS)):
                    m = pattern.search(line, it.end())
                    if m:
                        run.series[series][int(it.group(1))] = float(m.group(1))
            m = _VALID.search(line)
            if m:
                run.series[VALID][int(m.group(1))] = float(m.group(2))


def _read_json_line(line: str, run: Run) -> None:
    try:
        rec = json.loads(line)
    except ValueError:
        return
    if isinstance(rec, dict) and "iteration" in rec and "lm_loss" in rec:   # --log-loss-file
        run.series[TRAIN][int(rec["iteration"])] = float(rec["lm_loss"])


def _read_tensorboard(path: str, run: Run) -> None:
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError as exc:
        raise PlotError("reading TensorBoard event files needs the 'tensorboard' package "
                        "(pip install tensorboard==2.21.0)") from exc
    files = sorted(os.path.join(root, f) for root, _, names in os.walk(path)
                   for f in names if "tfevents" in f)
    for file in files:    # in name order, which is creation order: a resumed run's later values win
        for event in EventFileLoader(file).Load():
            for value in event.summary.value:
                series = _TAGS.get(value.tag)
                if series is None:
                    continue
                number = value.simple_value if value.HasField("simple_value") \
                    else float(tensor_util.make_ndarray(value.tensor))
                run.series[series][int(event.step)] = number


def run_names(paths: list[str]) -> list[str]:
    """Each path's last component (a file without its extension); paths that would share a name
    get as many parent directories as it takes to tell them apart."""
    parts = [os.path.normpath(os.path.abspath(p)).split(os.sep) for p in paths]
    for p, path in zip(parts, paths):
        if not os.path.isdir(path):
            p[-1] = os.path.splitext(p[-1])[0] or p[-1]
    depth = [1] * len(paths)
    while True:
        names = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
        clashes = [i for i, n in enumerate(names) if names.count(n) > 1 and depth[i] < len(parts[i])]
        if not clashes:
            return names
        for i in clashes:
            depth[i] += 1
