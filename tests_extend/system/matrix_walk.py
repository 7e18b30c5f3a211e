"""The support-matrix cells this machine can run (every feature x torch/cpu and mindspore/cpu),
each with the command line that turns its feature on, and the two answers to compare: what
`python -m mindspeed check` says and what a real start of the trainer does.

Shared by the test (tests_extend/system/test_matrix_walk.py) and the MindSpore worker that runs
the accepted cells under msrun (tests_extend/system/matrix_walk_ms_worker.py)."""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLUMNS = (("torch", "cpu"), ("mindspore", "cpu"))
WORLD = 2            # every real start runs on 2 processes (cells for 1 process run data parallel)
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "2", "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
        "--lr", "1e-3", "--seed", "7"]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
# cells whose example needs a file this test cannot make offline: not started, and said so
NOT_STARTED = {"tokenizer-model": "needs a Hugging Face tokenizer file"}


def cell_argv(feature, backend: str, tmp: str, data_prefix: str) -> list[str]:
    subst = {"DATA": data_prefix, "CACHE": os.path.join(tmp, "cache"), "TMP": os.path.join(tmp, "profile"),
             "TOKENIZER": os.path.join(tmp, "tokenizer.json")}
    example = [subst.get(tok, tok) for tok in feature.examples.get(backend, feature.example)]
    data = [] if "--data-path" in example or "--tokenizer-type" in example else MOCK
    return TINY + data + example + ["--backend", backend]


def inert_cell_argv(feature, backend: str, tmp: str, data_prefix: str) -> list[str]:
    """The command line on which the feature is on but has no effect (Feature.inert): its
    inert_example, or for a flag that never has one here its example."""
    subst = {"DATA": data_prefix, "CACHE": os.path.join(tmp, "cache"), "TMP": os.path.join(tmp, "profile")}
    example = [subst.get(tok, tok) for tok in feature.inert_example or feature.examples.get(backend, feature.example)]
    data = [] if "--data-path" in example or "--tokenizer-type" in example else MOCK
    return TINY + data + example + ["--backend", backend]


def without_flags(feature, argv: list[str]) -> list[str]:
    """argv less the feature's own flags (and their values): the same run without it."""
    from mindspeed.flags.mindspeed_flags import trainer_parser
    actions = trainer_parser()._option_string_actions
    own = {fl.name for fl in feature.flags}
    kept, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok in own:
            skip = actions[tok].nargs != 0
        else:
            kept.append(tok)
    return kept


def check_notes(argv: list[str]) -> tuple[int, list[str]]:
    """(exit code, the lines saying a flag has no effect) of `python -m mindspeed check argv`."""
    from mindspeed.__main__ import main
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(["check", *argv])
    return rc, [line for line in out.getvalue().splitlines() if "has no effect here" in line]


def check_answer(argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr's one line) of `python -m mindspeed check argv`, in this process."""
    from mindspeed.__main__ import main
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = main(["check", *argv])
    lines = [line for line in err.getvalue().splitlines() if line.strip() and "WARNING" not in line]
    return rc, lines[-1] if lines else ""


def trainer_main():
    sys.path.insert(0, os.path.join(ROOT, "tests_extend", "example"))
    from pretrain_gpt import main
    return main


def start(argv: list[str], loss_file: str) -> dict:
    """A real start of the trainer's entry point (tests_extend/example/pretrain_gpt.py); `notes`:
    the lines its log gave saying a flag has no effect (Feature.inert)."""
    import time
    err, out = io.StringIO(), io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = trainer_main()(argv + ["--log-loss-file", loss_file])
    seconds = time.perf_counter() - started
    sys.stdout.write(out.getvalue())        # the log, as without the capture
    notes = [line for line in out.getvalue().splitlines() if "has no effect here" in line]
    losses = []
    if os.path.isfile(loss_file):
        with open(loss_file) as f:
            losses = [json.loads(line)["lm_loss"] for line in f if line.strip()]
    lines = [line for line in err.getvalue().splitlines() if line.strip() and "WARNING" not in line]
    return {"rc": rc, "line": lines[-1] if lines else "", "losses": losses, "seconds": round(seconds, 2),
            "trained": rc == 0 and len(losses) >= 2 and all(math.isfinite(x) for x in losses), "notes": notes}
