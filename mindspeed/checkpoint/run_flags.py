"""The run's flags, as JSON, beside the checkpoints both trainers write (`<save>/run_flags.json`):
what `python -m mindspeed.generate` and `python -m mindspeed.evaluate` rebuild the model (and the
validation split) from. Plain values only (no pickle): every flag and derived value that is a
string, number, boolean, None or a list of those. Framework-free."""
from __future__ import annotations

import json
import os

from mindspeed.errors import CheckpointError
from mindspeed.files import atomic_write, private_dir

RUN_FLAGS_FILE = "run_flags.json"
FORMAT = 1
SCALARS = (str, int, float, bool, type(None))


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(isinstance(item, SCALARS) for item in value)
    return isinstance(value, SCALARS)


def plain_flags(args) -> dict:
    """vars(args) without what JSON cannot hold as it is (callables, dtypes, objects)."""
    return {key: list(value) if isinstance(value, tuple) else value
            for key, value in sorted(vars(args).items()) if _plain(value)}


def write(root: str, args, trainer: str) -> str:
    """<root>/run_flags.json for this run (one writer: the caller is rank 0); returns its path."""
    path = os.path.join(root, RUN_FLAGS_FILE)
    body = {"format": FORMAT, "trainer": trainer, "args": plain_flags(args)}

    def dump(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=1)
    try:
        private_dir(root)
        atomic_write(path, dump)
    except OSError as err:      # a full disk: one line, the tracker untouched
        raise CheckpointError(f"writing {path} failed: {err.strerror or err} (the tracker still names the "
                              f"last complete checkpoint)") from None
    return path


def read(root: str) -> dict | None:
    """{"trainer": "torch"|"mindspore", "args": {...}} of <root>/run_flags.json; None without one."""
    path = os.path.join(root, RUN_FLAGS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is unreadable ({err})") from None
    if not isinstance(body, dict) or not isinstance(body.get("args"), dict):
        raise CheckpointError(f"{path} is not a run's flags file (no 'args' object)")
    return body
