"""MindSpore's own profiler (mindspore.profiler.profile) behind the ProfilerAPI.

MindSpore writes its run into a directory of its own under save_path
(`<host>_<pid>_<time>_ascend_ms/`): the timeline `ASCEND_PROFILER_OUTPUT/trace_view.json` (Chrome
trace format, as torch's) and per-operator tables (`FRAMEWORK/cpu_op_*` on CPU, kernel tables on
Ascend). stop() parses the run (MindSpore's analysis step) and returns the trace and the tables.
"""
from __future__ import annotations

import glob
import os

from mindspeed.backends.base import ProfilerAPI
from mindspeed.files import PRIVATE_DIR, PRIVATE_FILE


class MsProfiler(ProfilerAPI):
    def __init__(self, device: str, save_path: str, *, level="level0", with_cpu=True, with_stack=False,
                 with_memory=False, record_shapes=False, tag=""):
        from mindspore import profiler
        self.save_path = os.path.join(save_path, tag.rstrip("_") or "profile")
        activities = [profiler.ProfilerActivity.NPU] if device == "npu" else []
        if with_cpu or not activities:
            activities.append(profiler.ProfilerActivity.CPU)
        # the same meaning as the torch backend's levels: level1 adds shapes, level2 also stacks and memory
        self._prof = profiler.profile(
            activities=activities, start_profile=False,
            record_shapes=record_shapes or level in ("level1", "level2"),
            with_stack=with_stack or level == "level2", profile_memory=with_memory or level == "level2",
            on_trace_ready=profiler.tensorboard_trace_handler(dir_name=self.save_path))

    def start(self) -> None:
        os.makedirs(self.save_path, mode=PRIVATE_DIR, exist_ok=True)
        self._prof.start()

    def stop(self) -> list[str]:
        self._prof.stop()        # runs on_trace_ready: MindSpore parses its raw data into the files below
        run = os.path.join(self.save_path, "*_ascend_ms")
        paths = sorted(glob.glob(os.path.join(run, "ASCEND_PROFILER_OUTPUT", "trace_view.json"))
                       + glob.glob(os.path.join(run, "FRAMEWORK", "*op_type_info*.csv"))
                       + glob.glob(os.path.join(run, "ASCEND_PROFILER_OUTPUT", "*op_statistic*.csv")))
        for path in paths:
            os.chmod(path, PRIVATE_FILE)
        return paths
