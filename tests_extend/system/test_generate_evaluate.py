"""After training: each trainer's checkpoint (torch: torch_dist with MindSpeed's fused kernels;
MindSpore: the neutral safetensors) evaluated by `python -m mindspeed.evaluate` to the validation
loss the trainer logged, and generated from by `python -m mindspeed.generate` with the dataset's
character-level tokenizer, through the run_flags.json the trainers write beside checkpoints."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests_extend.system.test_pretrain_gpt import PRETRAIN, ROOT, tiny_dataset  # noqa: F401  (fixture)

TIMEOUT = 540       # a launch under a loaded CI machine (MindSpore starts slowly)
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--normalization", "RMSNorm", "--swiglu",
         "--position-embedding-type", "rope", "--disable-bias-linear"]
RUN = ["--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-2", "--min-lr", "1e-3",
       "--lr-warmup-iters", "1", "--split", "90,10,0", "--log-interval", "3", "--eval-interval", "6",
       "--eval-iters", "2"]
FUSED = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn"]
# the torch run keeps an EMA of its weights and validates with it: evaluation and generation load it (--use-ema)
EMA = ["--optimizer-selection", "fused_ema_adamw", "--ema-decay", "0.9", "--use-ema"]
LOGGED = re.compile(r"final validation loss at iteration 6 \| lm loss value: (\S+) \|")


def _run(cmd, stdin: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), input=stdin,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def _module(name: str, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", name, *argv], stdin)


@pytest.fixture(scope="module", params=["torch", "mindspore"])
def trained(request, tiny_dataset, tmp_path_factory):      # noqa: F811  (the fixture)
    """(backend, checkpoint directory, the validation loss the trainer logged, tmp dir)."""
    backend = request.param
    if backend == "mindspore":
        pytest.importorskip("mindspore")
    root = tmp_path_factory.mktemp(backend)
    save = str(root / "ckpt")
    train = _run([sys.executable, PRETRAIN, "--backend", backend, *MODEL, *RUN, "--data-path", tiny_dataset,
                  "--save", save, *(FUSED + EMA if backend == "torch" else [])])
    return backend, save, float(LOGGED.search(train.stdout).group(1)), root


def test_evaluate_equals_the_trainers_validation_loss(trained):
    backend, save, logged, root = trained
    with open(os.path.join(save, "run_flags.json")) as f:
        assert json.load(f)["trainer"] == backend
    out = str(root / "eval.json")
    evaluated = _module("mindspeed.evaluate", "--load", save, "--output-json", out,
                        *(["--use-ema"] if backend == "torch" else []))
    with open(out) as f:
        loss = json.load(f)["loss"]
    if backend == "torch":      # the trainer's own validation code, on its own kernels: the same digits
        # (both with the EMA of the weights: the trainer's in its optimizer, evaluate's from the checkpoint)
        assert f"lm loss value: {loss:.6E}" in evaluated.stdout
        assert f"{loss:.6E}" == f"{logged:.6E}"
    else:                       # MindSpore's kernels against Megatron-Core's: float rounding apart
        assert loss == pytest.approx(logged, abs=2e-5)


def test_generate_from_the_trainers_checkpoint(trained, tiny_dataset):      # noqa: F811  (the fixture)
    backend, save, _logged, root = trained
    tokenizer = tiny_dataset + ".tokenizer.json"
    if backend == "torch":      # interactive chat: two turns from stdin, sampled, then quit
        chat = _module("mindspeed.generate", "--load", save, "--tokenizer-model", tokenizer, "--task", "chat",
                       "--top-k", "3", "--max-new-tokens", "8", "--use-ema", stdin="the king\nthe fool\nquit\n")
        assert chat.stdout.count(">>> ") == 3 and chat.stdout.count("tokens/s") == 2, chat.stdout
        return
    answer = str(root / "answer.json")
    _module("mindspeed.generate", "--load", save, "--tokenizer-model", tokenizer, "--prompt", "the king",
            "--max-new-tokens", "8", "--output-json", answer)
    with open(answer) as f:
        result = json.load(f)
    assert result["prompt"] == "the king" and 1 <= len(result["tokens"]) <= 8
    assert all(0 <= t < 28 for t in result["tokens"])        # the character vocabulary (26 + 2)


def test_evaluate_refusals_are_one_line(tmp_path):
    """Missing directory, a directory without model flags: one line, exit 2, no traceback."""
    for load, words in ((tmp_path / "nowhere", "does not exist"), (tmp_path, "run_flags.json")):
        result = subprocess.run([sys.executable, "-m", "mindspeed.evaluate", "--load", str(load)], cwd=ROOT,
                                capture_output=True, text=True, timeout=TIMEOUT)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ") and words in result.stderr, \
            result.stderr
