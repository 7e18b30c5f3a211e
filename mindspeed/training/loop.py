"""The outer training loop, written once for both trainers (torch: training/pretrain.py,
MindSpore: training/mindspore/trainer.py).

As torchtitan's train.py with its TrainSpec: each framework hands the loop its parts (TrainParts:
run one global batch, evaluate, save, and the readers the step log needs), and the loop owns the
rest: counting iterations from the resumed one to the exit rule, consumed samples, the step log
(StepRecorder), the loop events the features subscribed to, the eval and save schedules, the final save and validation, and the
"> done:" line and summary. Plain Python: no framework is imported here.
"""
from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from mindspeed.checkpoint import run_flags
from mindspeed.features.base import TRAIN_END, TRAIN_STEP_BEGIN, TRAIN_STEP_END
from mindspeed.training.logger import StepRecorder, TrainingLogger
from mindspeed.training.manual_gc import ManualGC


@dataclass(frozen=True)
class StepResult:
    """One optimizer step over a global batch, as the framework saw it."""
    loss: float                 # mean token loss over every rank's micro-batches
    grad_norm: float | None     # None where there is none (a skipped fp16 step)
    applied: bool = True        # False: the update was skipped (fp16 overflow); the log counts these


@dataclass(frozen=True)
class TrainParts:
    """A framework's side of the loop. Iterations are 1-based: step `iteration` ends at it."""
    step: Callable[[int, int, int], StepResult]  # (iteration, consumed samples before it, its batch size)
    evaluate: Callable[[], float | None]         # validation loss; None: no validation data, --eval-iters 0
    save: Callable[[int, int], object]           # (iteration, consumed samples): a checkpoint under --save
    lr: Callable[[int], float]                   # the lr after step `iteration` (the one Megatron logs)
    peak_memory_mb: Callable[[], float]
    batch_size: Callable[[int], int]             # global batch of the step starting at consumed samples
    loss_scale: Callable[[], float] | None = None  # fp16's; None: no loss-scale column
    # True on every rank when the flag is True on any rank (a collective over the whole job); asked
    # once per step, and only when an exit rule needs the ranks to agree (a signal, a time limit)
    any_rank: Callable[[bool], bool] = bool
    # the readers (lr, peak_memory_mb, loss_scale) are called only on iterations that log


@dataclass(frozen=True)
class RunReport:
    """What the run's log and summary show beyond the loop's own counts."""
    parameters: int                  # on rank 0
    summary_keys: tuple[str, ...]    # the trainer's summary, in its order (tests and users read it)
    device: str                      # MFU's peak FLOP/s is this device's
    write_loss_file: bool            # --log-loss-file: one writer (rank 0)
    unigram_baseline: float | None = None   # shown in the done line when measured
    started_at: float | None = None  # time.time() when the run began: --exit-duration-in-mins counts from
                                     # it (as Megatron's, setup included); None: from the first step


@dataclass
class Progress:
    """Where training stands: zeros for a fresh run, else the loaded checkpoint's counts."""
    iteration: int = 0
    consumed: int = 0
    skipped: int = 0     # steps whose update was skipped


def stop_iteration(args) -> int:
    """The iteration training ends at: --train-iters, or --exit-interval when it comes first."""
    return min(args.train_iters, args.exit_interval) if args.exit_interval else args.train_iters


def should_stop(progress: Progress, stop_at: int) -> bool:
    """The iteration rule, asked before every step (ExitWatch adds the signal and the time limit)."""
    return progress.iteration >= stop_at


class ExitWatch:
    """Megatron's --exit-signal-handler and --exit-duration-in-mins: after each step the ranks agree
    (TrainParts.any_rank) whether one of them received --exit-signal or is past the time limit; the
    loop then saves the current iteration and stops. One vote per step: each rank's two conditions
    are one flag. The handler only records the signal, so the step in flight (and its collectives)
    finishes on every rank first. A context manager: the previous handler is back when training ends."""

    def __init__(self, args, started_at: float | None):
        self.signum = signal.Signals[args.exit_signal] if args.exit_signal_handler else None
        self.minutes = args.exit_duration_in_mins
        self.deadline = (started_at or time.time()) + 60 * self.minutes if self.minutes else None
        self.received = False
        self._previous = None

    def __enter__(self) -> "ExitWatch":
        if self.signum is not None:
            self._previous = signal.signal(self.signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        if self.signum is not None:
            signal.signal(self.signum, self._previous)

    def _record(self, _signum, _frame) -> None:
        self.received = True

    def _late(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def reason(self, any_rank: Callable[[bool], bool]) -> str | None:
        """Whether the run stops now (the same answer on every rank): why, as this rank knows it, or
        None. The ranks are asked only when an exit rule is on, and once."""
        if self.signum is None and self.deadline is None:
            return None
        if not any_rank(self.received or self._late()):
            return None
        # this rank's own cause, read again after the vote; else the rule that is on, or both
        # named where both are on and only another rank's cause was true
        signalled = f"received {self.signum.name}" if self.signum is not None else None
        timed_out = f"the time limit (--exit-duration-in-mins {self.minutes}) was reached" if self.deadline is not None else None
        if self.received or not timed_out:
            return signalled
        if self._late() or not signalled:
            return timed_out
        return f"another rank received {self.signum.name} or reached the time limit " \
               f"(--exit-duration-in-mins {self.minutes})"


def eval_due(args, iteration: int, stop_at: int) -> bool:
    """Every --eval-interval iterations, except the last one: the final validation follows it."""
    return bool(args.eval_interval) and iteration % args.eval_interval == 0 and iteration != stop_at


def ramped_global_batch(args, consumed: int) -> int:
    """The global batch of the step starting at `consumed` samples under --rampup-batch-size START
    INCREMENT SAMPLES, as Megatron-Core's RampupBatchsizeNumMicroBatchesCalculator computes it (the
    flag checks keep START and INCREMENT multiples of micro-batch x data-parallel size)."""
    if not args.rampup_batch_size:
        return args.global_batch_size
    start, increment, samples = args.rampup_batch_size
    if consumed > samples:
        return args.global_batch_size
    per_increment = samples / ((args.global_batch_size - start) // increment)
    return start + int(consumed / per_increment) * increment


def save_due(args, iteration: int) -> bool:
    return bool(args.save and args.save_interval) and iteration % args.save_interval == 0


def no_subscribers(event: str, **info) -> None:
    pass


def train(args, logger: TrainingLogger, parts: TrainParts, report: RunReport, start: Progress,
          publish: Callable[..., None] = no_subscribers) -> dict:
    """Steps from `start` until the exit rule stops them, then the final save (unless the last
    iteration's interval save has it) and validation; returns the trainer's summary. `publish`
    tells the features' subscribers the loop events (ApplyContext.publish of the applied plan)."""
    stop_at = stop_iteration(args)
    steps = StepRecorder(logger, args, tokens_per_step=args.global_batch_size * args.seq_length, stop_at=stop_at,
                         write_loss_file=report.write_loss_file, device=report.device)
    _announce(args, logger, start.iteration, stop_at)
    progress = dataclasses.replace(start)
    last_saved, early_exit = None, None
    with ExitWatch(args, report.started_at) as watch, ManualGC(args) as collector:
        while not should_stop(progress, stop_at):
            _step(parts, steps, progress, publish)
            collector.after_step(progress.iteration)
            if eval_due(args, progress.iteration, stop_at):
                collector.at_pause()
                _validate(logger, parts, progress.iteration)
            if save_due(args, progress.iteration):
                collector.at_pause()
                _save(args, logger, parts, progress)
                last_saved = progress.iteration
            early_exit = watch.reason(parts.any_rank)
            if early_exit:
                break
        publish(TRAIN_END, iteration=progress.iteration)
        steps.close()
        if args.save and last_saved != progress.iteration:
            _save(args, logger, parts, progress)
        if early_exit:     # as Megatron: saved, no final validation (a scheduler's grace period is short)
            logger.print(f"> exiting at iteration {progress.iteration}: {early_exit}"
                         f"{'' if args.save else ' (no --save: nothing saved)'}")
            return _finish(logger, report, progress.iteration, None, steps)
        valid_loss = _validate(logger, parts, progress.iteration, label="final validation")
    return _finish(logger, report, progress.iteration, valid_loss, steps)


def _announce(args, logger: TrainingLogger, iteration: int, stop_at: int) -> None:
    logger.print(f"> training from iteration {iteration} to {stop_at}")
    if args.rampup_batch_size:
        start_gbs, increment, ramp_samples = args.rampup_batch_size
        logger.print(f"> global batch size ramps up from {start_gbs} by {increment} over {ramp_samples} samples "
                     f"to {args.global_batch_size}")


def _step(parts: TrainParts, steps: StepRecorder, progress: Progress, publish: Callable[..., None]) -> None:
    """One global batch: the events around it, its time (the events, the batch size and the data
    read included), the counts, the step log."""
    start = time.perf_counter()     # the subscribers' work counts in the step's time
    publish(TRAIN_STEP_BEGIN, iteration=progress.iteration + 1)
    batch_size = parts.batch_size(progress.consumed)
    result = parts.step(progress.iteration + 1, progress.consumed, batch_size)
    progress.iteration += 1
    publish(TRAIN_STEP_END, iteration=progress.iteration)
    elapsed = time.perf_counter() - start
    progress.consumed += batch_size
    progress.skipped += 0 if result.applied else 1
    iteration = progress.iteration
    steps.record(iteration, result.loss, elapsed, consumed=progress.consumed, lr=lambda: parts.lr(iteration),
                 grad_norm=result.grad_norm, peak_mem_mb=parts.peak_memory_mb, skipped=progress.skipped,
                 batch_size=batch_size, loss_scale=parts.loss_scale)


def _validate(logger: TrainingLogger, parts: TrainParts, iteration: int, label: str = "validation") -> float | None:
    loss = parts.evaluate()
    if loss is not None:
        logger.validation(iteration, loss, label=label)
    return loss


def _save(args, logger: TrainingLogger, parts: TrainParts, progress: Progress) -> None:
    # what mindspeed.generate / mindspeed.evaluate rebuild the model from; written first, so that the
    # tracker (written by parts.save) is the last file of a save
    if logger.is_writer:
        run_flags.write(args.save, args, trainer=args.backend)
    parts.save(progress.iteration, progress.consumed)
    logger.print(f"> saved checkpoint at iteration {progress.iteration} to {args.save}")


def _finish(logger: TrainingLogger, report: RunReport, iteration: int, valid_loss: float | None,
            steps: StepRecorder) -> dict:
    """The "> done:" line and the trainer's summary: its keys, in its order."""
    baseline = report.unigram_baseline
    vl = f"{valid_loss:.4f}" if valid_loss is not None else "n/a"
    base = f" (unigram baseline {baseline:.4f})" if baseline is not None else ""
    logger.print(f"> done: {iteration} iterations | final validation loss {vl}{base} | "
                 f"throughput {steps.tokens_per_s:.0f} tokens/s")
    known = {"iteration": iteration, "final_valid_loss": valid_loss, "unigram_baseline": baseline,
             "tokens_per_s": steps.tokens_per_s, "parameters": report.parameters,
             "losses": steps.losses, "step_time_s": steps.step_time_s}
    return {key: known[key] for key in report.summary_keys}
