"""The example trainer (tests_extend/example/pretrain_gpt.py) as a user runs it on one process,
with no launcher: the tests that compare the two trainers' logs start it this way."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "tests_extend", "example", "pretrain_gpt.py")


def run_pretrain_gpt(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python pretrain_gpt.py ARGV` from the checkout, without a launcher's rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, PRETRAIN, *argv], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
