"""A small learnable corpus for training tests: text documents -> Megatron's indexed dataset
through the example's preprocess_data.py (character-level)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREPROCESS = os.path.join(ROOT, "tests_extend", "example", "preprocess_data.py")


def build_indexed_corpus(root, documents: list[list[str]]) -> str:
    """Each document (a list of lines) into its own text file under `root`, all of them into one
    indexed dataset; returns its prefix."""
    texts = []
    for i, lines in enumerate(documents):
        path = os.path.join(str(root), f"part{i}.txt")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        texts.append(path)
    prefix = os.path.join(str(root), "tiny")
    result = subprocess.run([sys.executable, PREPROCESS, "--input", *texts, "--output-prefix", prefix],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return prefix
