"""--rampup-batch-size on both trainers: the MindSpore trainer's steps grow as Megatron-Core's
micro-batch calculator grows the torch trainer's, and its learning rate follows the samples of the
applied steps as Megatron's scheduler does: the two trainers' iteration lines show the same
consumed samples, global batch sizes and learning rates (one process each, mock data)."""
import re

import pytest

from mindspeed.flags.trainer_flags import parse_args
from mindspeed.training import loop
from tests_extend.system.one_process_run import run_pretrain_gpt

RAMP = ["--micro-batch-size", "2", "--global-batch-size", "6", "--rampup-batch-size", "2", "2", "8"]
TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--train-iters", "6", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--mock-data"] + RAMP
LINE = re.compile(r"iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) .*?learning rate: ([0-9.E+-]+) \| "
                  r"global batch size: +(\d+)")


def test_the_ramp_is_megatron_cores():
    calculator = pytest.importorskip("megatron.core.num_microbatches_calculator")
    args = parse_args(TINY, world_size=1)
    megatron = calculator.RampupBatchsizeNumMicroBatchesCalculator(6, 2, 1, False, 0, 2, 2, 8)
    for consumed in range(0, 40):
        megatron.update(consumed, consistency_check=False)
        assert loop.ramped_global_batch(args, consumed) == megatron.get_current_global_batch_size(), consumed


def _run(backend: str) -> list:
    result = run_pretrain_gpt("--backend", backend, *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    return [(int(it), int(consumed), float(lr), int(gbs)) for it, consumed, lr, gbs in LINE.findall(result.stdout)]


def test_both_trainers_ramp_the_batch_and_the_lr_alike():
    torch_lines, ms_lines = _run("torch"), _run("mindspore")
    assert [(it, consumed, gbs) for it, consumed, _, gbs in ms_lines] == \
        [(1, 2, 2), (2, 4, 2), (3, 8, 4), (4, 14, 6), (5, 20, 6), (6, 26, 6)]
    assert len(torch_lines) == len(ms_lines) == 6
    for t, m in zip(torch_lines, ms_lines):
        assert t[:2] == m[:2] and t[3] == m[3], (t, m)
        assert m[2] == pytest.approx(t[2], rel=1e-6), (t, m)     # the logged lr, printed to 7 digits
