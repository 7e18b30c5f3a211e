"""Training logs in Megatron's format, plus optional TensorBoard scalars.

    iteration       10/     200 | consumed samples: ... | elapsed time per iteration (ms): ... |
    [throughput per device (TFLOP/s/device): ... | MFU: ...% | (--log-throughput, --op-cal-tflops)]
    learning rate: ... | global batch size: ... | lm loss: ... | grad norm: ... | tokens per second: ...
"""
from __future__ import annotations

import datetime
import json
import sys

from mindspeed.training import peak
from mindspeed.training.flops import tflops_per_device, throughput_requested


def _now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")


class TrainingLogger:
    def __init__(self, args, is_writer: bool):
        self.args = args
        self.is_writer = is_writer
        self.tb = None
        if is_writer and args.tensorboard_dir:
            self.tb = _tensorboard_writer(args.tensorboard_dir)

    def print(self, msg: str) -> None:
        if self.is_writer:
            print(msg, flush=True)

    def iteration(self, it: int, *, consumed: int, step_ms: float, lr: float, loss: float,
                  grad_norm, tokens_per_s: float, peak_mem_mb: float, skipped: int, eta_s: float,
                  tflops: float | None = None, mfu: float | None = None, batch_size: int | None = None,
                  loss_scale: float | None = None) -> None:
        """tflops: model TFLOP/s per device and mfu its fraction of the device's peak (--log-throughput,
        --op-cal-tflops); batch_size: this step's global batch (differs from --global-batch-size
        during --rampup-batch-size); loss_scale: fp16's."""
        a = self.args
        parts = [f" [{_now()}] iteration {it:8d}/{a.train_iters:8d}",
                 f"consumed samples: {consumed:12d}",
                 f"elapsed time per iteration (ms): {step_ms:.1f}"]
        if tflops is not None:
            parts.append(f"throughput per device (TFLOP/s/device): {tflops:.4g}")
        if mfu is not None:
            parts.append(f"MFU: {100 * mfu:.4g}%")
        parts += [f"learning rate: {lr:.6E}",
                  f"global batch size: {batch_size or a.global_batch_size:5d}",
                  f"lm loss: {loss:.6E}",
                  *([f"loss scale: {loss_scale:.1f}"] if loss_scale is not None else []),
                  f"grad norm: {grad_norm:.3f}" if grad_norm is not None else "grad norm: n/a",
                  f"tokens per second: {tokens_per_s:.0f}",
                  f"peak memory (MB): {peak_mem_mb:.0f}",
                  f"number of skipped iterations: {skipped:3d}",
                  f"progress: {100.0 * it / a.train_iters:5.1f}% eta {eta_s:.0f}s"]
        self.print(" | ".join(parts) + " |")
        if self.tb is not None:
            for name, value in (("lm loss", loss), ("learning-rate", lr), ("tokens-per-second", tokens_per_s),
                                ("iteration-time-ms", step_ms), ("peak-memory-MB", peak_mem_mb)):
                self.tb.add_scalar(name, value, it)
            if grad_norm is not None:
                self.tb.add_scalar("grad-norm", grad_norm, it)
            if tflops is not None:
                self.tb.add_scalar("throughput-tflops-per-device", tflops, it)
            if mfu is not None:
                self.tb.add_scalar("mfu", mfu, it)

    def validation(self, it: int, loss: float, label: str = "validation") -> None:
        import math
        ppl = math.exp(min(loss, 20.0))
        line = f" {label} loss at iteration {it} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        self.print("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        if self.tb is not None:
            self.tb.add_scalar(f"lm loss {label}", loss, it)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _tensorboard_writer(path: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("warning: --tensorboard-dir needs the 'tensorboard' package (pip install "
              "tensorboard==2.21.0); continuing without TensorBoard", file=sys.stderr, flush=True)
        return None
    return SummaryWriter(log_dir=path, max_queue=10)


class StepRecorder:
    """Per-step bookkeeping both trainers share: losses, timing, the --log-loss-file line, the
    Megatron-format line every --log-interval steps, and the run's throughput."""

    def __init__(self, logger: TrainingLogger, args, *, tokens_per_step: int, stop_at: int, write_loss_file: bool,
                 device: str = "cpu"):
        """device: where the trainer runs (the peak FLOP/s of MFU is that device's)."""
        self.logger, self.args = logger, args
        self.peak = None
        if logger.is_writer and throughput_requested(args):     # only the writer logs MFU
            self.peak = peak.device_peak(args.backend, device, args.params_dtype)
            logger.print(f"> device peak for MFU: {self.peak.describe()}")
        self.tokens_per_step, self.stop_at = tokens_per_step, stop_at
        self.losses: list[float] = []
        self._interval_losses: list[float] = []
        self._interval_time, self._interval_tokens = 0.0, 0
        self.total_time, self.total_steps, self.total_tokens = 0.0, 0, 0
        path = args.log_loss_file
        self._loss_file = open(path, "a") if path and write_loss_file else None

    def record(self, iteration: int, loss: float, elapsed: float, *, consumed: int, lr, grad_norm,
               peak_mem_mb, skipped: int = 0, batch_size: int | None = None, loss_scale=None) -> None:
        """lr, peak_mem_mb (and loss_scale, fp16 only) are callables: only evaluated on iterations
        that log. batch_size: this step's global batch (it grows during batch size ramp-up)."""
        tokens = self.tokens_per_step if batch_size is None else batch_size * self.args.seq_length
        self.losses.append(loss)
        self._interval_losses.append(loss)
        self._interval_time += elapsed
        self._interval_tokens += tokens
        if iteration > 1 or self.args.load:   # the first step includes one-off setup; keep it out of speed
            self.total_time += elapsed
            self.total_steps += 1
            self.total_tokens += tokens
        if self._loss_file is not None:
            self._loss_file.write(json.dumps({"iteration": iteration, "lm_loss": loss}) + "\n")
            self._loss_file.flush()
        if iteration % self.args.log_interval == 0 or iteration == self.stop_at:
            steps = len(self._interval_losses)
            step_s = self._interval_time / steps
            self.logger.iteration(iteration, consumed=consumed, step_ms=1000 * step_s, lr=lr(),
                                  loss=sum(self._interval_losses) / steps, grad_norm=grad_norm,
                                  tokens_per_s=self._interval_tokens / self._interval_time,
                                  peak_mem_mb=peak_mem_mb(), skipped=skipped,
                                  eta_s=step_s * (self.stop_at - iteration), **self._throughput(),
                                  batch_size=batch_size, loss_scale=loss_scale() if loss_scale else None)
            self._interval_losses, self._interval_time, self._interval_tokens = [], 0.0, 0

    def _throughput(self) -> dict:
        if not throughput_requested(self.args):
            return {}
        tflops = tflops_per_device(self.args, self._interval_tokens, self._interval_time)
        return {"tflops": tflops, "mfu": tflops / self.peak.tflops if self.peak else None}

    def close(self) -> None:
        if self._loss_file is not None:
            self._loss_file.close()
            self._loss_file = None

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.total_time if self.total_time else 0.0

    @property
    def step_time_s(self):
        return self.total_time / self.total_steps if self.total_steps else None
