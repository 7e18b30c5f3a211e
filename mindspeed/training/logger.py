"""Training logs in Megatron's format, plus optional TensorBoard scalars.

    iteration       10/     200 | consumed samples: ... | elapsed time per iteration (ms): ... |
    learning rate: ... | global batch size: ... | lm loss: ... | grad norm: ... | tokens per second: ...
"""
from __future__ import annotations

import datetime
import sys


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
                  grad_norm, tokens_per_s: float, peak_mem_mb: float, skipped: int, eta_s: float) -> None:
        a = self.args
        parts = [f" [{_now()}] iteration {it:8d}/{a.train_iters:8d}",
                 f"consumed samples: {consumed:12d}",
                 f"elapsed time per iteration (ms): {step_ms:.1f}",
                 f"learning rate: {lr:.6E}",
                 f"global batch size: {a.global_batch_size:5d}",
                 f"lm loss: {loss:.6E}",
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
