"""Runs the user's entry points on many command lines while paying their imports once.

    python -m tests_extend.system.entry_runner JOBS.json

JOBS.json: a list, in order, of {"entry": "trainer" | "data" | "convert", "argv": [...], "out": DIR,
"inputs": [PATH, ...]} and {"prepare": "module:function", "args": [...]} (a function run here, that
makes the next jobs' inputs). The entry points' modules are imported here, then each job runs in a
child forked from this process, as `python <entry> ARGV` would: its stdout and stderr (file
descriptors 1 and 2) go to DIR/stdout and DIR/stderr, an exception that escapes main() is printed
as the interpreter prints it, and its exit status goes to DIR/status. DIR/changed lists the inputs
whose bytes or mtime the job changed. What the imports print (the only thing a fork skips) is left
to the tests that launch the entry points themselves.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import sys
import traceback

from tests_extend.system.file_snapshot import snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER_SCRIPT = os.path.join(ROOT, "tests_extend", "example", "pretrain_gpt.py")


def _trainer_main():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", TRAINER_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import mindspeed.training.pretrain  # noqa: F401  the trainer's own imports, paid once
    return module.main


def entry_points() -> dict:
    from mindspeed.convert.cli import main as convert_main   # convert_ckpt.py's main
    from mindspeed.data.__main__ import main as data_main
    import mindspeed.data.pipeline  # noqa: F401  imported by the data CLI once it runs
    return {"trainer": _trainer_main(), "data": data_main, "convert": convert_main}


def _exit_status(main, argv) -> int:
    """What `python entry argv` exits with, printing an escaped exception as the interpreter does."""
    try:
        code = main(list(argv))
    except SystemExit as done:
        code = done.code
    except BaseException:          # noqa: BLE001  the interpreter's own behaviour
        traceback.print_exc()
        code = 1
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _state(paths) -> dict:
    """Each input's files (a file: itself) with their hashes and mtimes; None when missing."""
    out = {}
    for path in paths:
        if os.path.isdir(path):
            out[path] = snapshot(path)
        elif os.path.isfile(path):
            with open(path, "rb") as f:
                out[path] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
        else:
            out[path] = None
    return out


def run_job(main, job: dict) -> None:
    os.makedirs(job["out"], exist_ok=True)
    before = _state(job.get("inputs", []))
    pid = os.fork()
    if pid == 0:
        status = 70
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, name in ((1, "stdout"), (2, "stderr")):
                target = os.open(os.path.join(job["out"], name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(target, fd)
                os.close(target)
            status = _exit_status(main, job["argv"])
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    with open(os.path.join(job["out"], "status"), "w") as f:
        f.write(str(os.waitstatus_to_exitcode(wait_status)))
    after = _state(job.get("inputs", []))
    with open(os.path.join(job["out"], "changed"), "w") as f:
        f.write("".join(f"{path}\n" for path in before if before[path] != after[path]))


def prepare(job: dict) -> None:
    module, function = job["prepare"].split(":")
    getattr(importlib.import_module(module), function)(*job.get("args", []))


def main(path: str) -> int:
    with open(path) as f:
        jobs = json.load(f)
    mains = entry_points()
    for job in jobs:
        if "prepare" in job:
            prepare(job)
        else:
            run_job(mains[job["entry"]], job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
