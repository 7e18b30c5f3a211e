"""--profile: profile a window of training steps on the ranks asked for, written per rank.

Written against the backend's ProfilerAPI; the trainer only publishes step events (ApplyContext.publish).
"""
from __future__ import annotations

import logging
import os

from mindspeed.backends.base import Cap
from mindspeed.features.base import (TRAIN_END, TRAIN_STEP_BEGIN, TRAIN_STEP_END, Feature, FeatureConfigError, Flag,
                                     switch)
from mindspeed.features.registry import register

log = logging.getLogger("mindspeed")


class StepProfiler:
    """Starts before step `start`, stops after step `end - 1` (Megatron's convention)."""

    def __init__(self, backend, args, rank: int | None = None):
        """rank None: asked of the backend at the first step, once the process group exists
        (features are applied before the trainer initializes it, when every process is rank 0)."""
        self.backend, self.args, self._rank = backend, args, rank
        self.active = None
        self.paths: list[str] = []

    @property
    def rank(self) -> int:
        if self._rank is None:
            self._rank = self.backend.comm.rank()
        return self._rank

    @property
    def enabled_here(self) -> bool:
        ranks = list(self.args.profile_ranks)
        return -1 in ranks or self.rank in ranks

    def on_step_begin(self, iteration: int, **_):
        if iteration == self.args.profile_step_start and self.active is None and self.enabled_here:
            a = self.args
            self.active = self.backend.profiler(
                os.path.join(a.profile_save_path, f"rank{self.rank}"), level=a.profile_level,
                with_cpu=a.profile_with_cpu, with_stack=a.profile_with_stack,
                with_memory=a.profile_with_memory, record_shapes=a.profile_record_shapes,
                tag=f"steps{a.profile_step_start}-{a.profile_step_end}_")
            self.active.start()

    def on_step_end(self, iteration: int, **_):
        if self.active is not None and iteration >= self.args.profile_step_end - 1:
            self._finish()

    def on_train_end(self, **_):
        if self.active is not None:
            self._finish()

    def _finish(self):
        self.paths = self.active.stop()
        self.active = None
        log.warning("MindSpeed profiling: wrote %s", ", ".join(self.paths))


@register
class Profiling(Feature):
    id = "profile"
    category = "observability"
    optimization_level = 0
    description = "profile a window of steps (torch.profiler / torch_npu.profiler / mindspore.profiler)"
    example = ("--profile", "--profile-step-start", "1", "--profile-step-end", "2", "--profile-ranks", "1",
               "--profile-save-path", "TMP")
    flags = (
        switch("--profile", "profile steps [--profile-step-start, --profile-step-end)"),
        Flag("--profile-step-start", dict(type=int, default=10, help="first profiled step")),
        Flag("--profile-step-end", dict(type=int, default=12, help="step at which profiling stops (exclusive)")),
        Flag("--profile-level", dict(choices=["level0", "level1", "level2"], default="level0",
                                     help="level1 adds shapes; level2 adds shapes, stacks and memory")),
        switch("--profile-with-cpu", "include host (CPU) activity"),
        switch("--profile-with-stack", "record Python stacks"),
        switch("--profile-with-memory", "record memory allocations"),
        switch("--profile-record-shapes", "record operator input shapes"),
        Flag("--profile-save-path", dict(default="./profile_dir", help="output directory (one folder per rank)")),
        Flag("--profile-ranks", dict(type=int, nargs="+", default=[0], help="ranks to profile; -1 = all")),
    )
    requires = (Cap.PROFILER,)

    def validate(self, args) -> None:
        if args.profile_step_start < 0 or args.profile_step_end <= args.profile_step_start:
            raise FeatureConfigError(f"--profile-step-end ({args.profile_step_end}) must be greater than "
                                     f"--profile-step-start ({args.profile_step_start}) >= 0")
        if any(r < -1 for r in args.profile_ranks):
            raise FeatureConfigError(f"--profile-ranks takes ranks >= 0 or -1 for all, got {args.profile_ranks}")

    def apply(self, ctx, args) -> None:
        profiler = StepProfiler(ctx.backend, args)
        ctx.subscribe(TRAIN_STEP_BEGIN, profiler.on_step_begin)
        ctx.subscribe(TRAIN_STEP_END, profiler.on_step_end)
        ctx.subscribe(TRAIN_END, profiler.on_train_end)
        ctx.provide("profiler", profiler)
