"""--log-throughput / --op-cal-tflops: the device's peak FLOP/s (datasheet, or measured once and
cached), and MFU = TFLOP/s per device / that peak in the iteration line and in TensorBoard."""
import re

import pytest

from mindspeed.training import flops, peak
from mindspeed.flags.trainer_flags import parse_args
from mindspeed.training.logger import StepRecorder, TrainingLogger


def test_cpu_peak_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak, "BENCH_SECONDS", 0.05)
    first = peak.device_peak("torch", "cpu", "fp32")
    assert 1e-4 < first.tflops < 100 and first.source.startswith("measured: fp32 matmul with torch")
    assert "now cached in" in first.source and (tmp_path / "peak_flops.json").is_file()
    monkeypatch.setattr(peak, "_measure", lambda *a: pytest.fail("measured again despite the cache"))
    again = peak.device_peak("torch", "cpu", "fp32")
    assert again.tflops == first.tflops and "cached in" in again.source and "now" not in again.source
    monkeypatch.setattr(peak, "_measure", lambda *a: 0.5)            # another dtype: another key
    assert peak.device_peak("torch", "cpu", "bf16").tflops == 0.5


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mindspore_cpu_peak_is_measured_for_each_dtype_the_trainer_takes(tmp_path, monkeypatch, dtype):
    """MindSpore's CPU MatMul has no bf16 kernel (the trainer's bf16 matmuls run in fp32 there): the peak of a
    --bf16 run is measured, not a crash of the run's first log line."""
    pytest.importorskip("mindspore")
    monkeypatch.setenv("MINDSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak, "BENCH_SECONDS", 0.05)
    got = peak.device_peak("mindspore", "cpu", dtype)
    assert 1e-4 < got.tflops < 100 and got.source.startswith(f"measured: {dtype} matmul with mindspore")


@pytest.mark.parametrize("model, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.0), ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5), ("NVIDIA H200", "fp16", 989.0)])
def test_known_gpus_take_the_datasheet_peak(monkeypatch, model, dtype, expected):
    monkeypatch.setattr(peak, "_device_model", lambda *a: model)
    monkeypatch.setattr(peak, "_measure", lambda *a: pytest.fail("a datasheet peak is not measured"))
    got = peak.device_peak("torch", "cuda", dtype)
    assert got.tflops == expected and got.source == f"datasheet ({model}, {dtype})"


class _Lines(TrainingLogger):
    def __init__(self, args):
        super().__init__(args, is_writer=True)
        self.lines, self.scalars = [], {}
        self.tb = self                       # stands in for the TensorBoard writer

    def print(self, msg):
        self.lines.append(msg)

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = value

    def flush(self):
        pass


def _one_step(*flags, elapsed=0.25):
    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                       "--log-interval", "1", *flags], world_size=2)
    args.padded_vocab_size = 128
    logger = _Lines(args)
    steps = StepRecorder(logger, args, tokens_per_step=8 * 32, stop_at=1, write_loss_file=False)
    steps.record(1, 2.0, elapsed, consumed=8, lr=lambda: 1e-3, grad_norm=1.0, peak_mem_mb=lambda: 0.0)
    return args, logger


@pytest.mark.parametrize("flag", ["--log-throughput", "--op-cal-tflops"])
def test_tflops_and_mfu_in_the_line_and_tensorboard(monkeypatch, flag):
    monkeypatch.setattr(peak, "device_peak", lambda *a: peak.Peak(0.02, "measured: stand-in"))
    args, logger = _one_step(flag)
    assert logger.lines[0] == "> device peak for MFU: 0.02 TFLOP/s per device, measured: stand-in"
    line = logger.lines[-1]
    tflops = float(re.search(r"\| throughput per device \(TFLOP/s/device\): ([0-9.e+-]+) \|", line).group(1))
    mfu = float(re.search(r"\| MFU: ([0-9.e+-]+)% \|", line).group(1))
    expected = flops.flops_per_iteration(args, 8) / 0.25 / 1e12 / 2          # per device of 2
    assert tflops == pytest.approx(expected, rel=1e-3)
    assert mfu == pytest.approx(100 * expected / 0.02, rel=1e-3)
    assert logger.scalars["throughput-tflops-per-device"] == pytest.approx(expected, rel=1e-9)
    assert logger.scalars["mfu"] == pytest.approx(expected / 0.02, rel=1e-9)


def test_without_either_flag_no_peak_no_tflops_no_mfu(monkeypatch):
    monkeypatch.setattr(peak, "device_peak", lambda *a: pytest.fail("no peak is needed"))
    _, logger = _one_step()
    assert len(logger.lines) == 1 and "TFLOP" not in logger.lines[0] and "MFU" not in logger.lines[0]
    assert "mfu" not in logger.scalars and "throughput-tflops-per-device" not in logger.scalars
