"""The trainers' logged throughput, checked the same way for both: each TFLOP/s per device is the
model's FLOPs per iteration over the logged step time and 2 devices, and MFU is that over the device
peak the run stated."""
import re

import pytest

STEP_LINE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+) \| throughput per device "
                       r"\(TFLOP/s/device\): ([0-9.e+-]+) \| MFU: ([0-9.e+-]+)% \|")


def assert_tflops_and_mfu(output: str, tiny: dict, logged: int, peak_source: str,
                          abs_tol: float = 1e-12) -> None:
    """`tiny`: the launch's model and batch settings; `logged`: how many step lines carry the figures;
    `peak_source`: how the run says it measured the peak ("fp32 matmul", "fp32 matmul with mindspore")."""
    from mindspeed.training import flops
    from mindspeed.flags.trainer_flags import parse_args
    args = parse_args(["--num-layers", tiny["NUM_LAYERS"], "--hidden-size", tiny["HIDDEN_SIZE"],
                       "--num-attention-heads", tiny["NUM_HEADS"], "--seq-length", tiny["SEQ_LENGTH"],
                       "--swiglu"], world_size=2)
    args.padded_vocab_size = int(re.search(r"\(padded (\d+)\)", output).group(1))
    peak = float(re.search(r"> device peak for MFU: ([0-9.e+-]+) TFLOP/s per device, measured: "
                           + re.escape(peak_source), output).group(1))
    lines = STEP_LINE.findall(output)
    assert len(lines) == logged
    for step_ms, tflops, mfu in lines:
        expected = flops.flops_per_iteration(args, int(tiny["GLOBAL_BATCH"])) / (float(step_ms) / 1000) / 1e12 / 2
        # the log rounds the step time to 0.1 ms and TFLOP/s to 4 digits: a 20 ms step is off by up to 0.25 %
        assert float(tflops) == pytest.approx(expected, rel=0.05 / float(step_ms) + 5e-4, abs=abs_tol)
        assert float(mfu) == pytest.approx(100 * float(tflops) / peak, rel=2e-3)
