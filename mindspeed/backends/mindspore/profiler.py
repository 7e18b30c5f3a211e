"""MindSpore's own profiler (mindspore.profiler.profile) behind the ProfilerAPI.

MindSpore writes its run into a directory of its own under save_path
(`<host>_<pid>_<time>_ascend_ms/`): the timeline `ASCEND_PROFILER_OUTPUT/trace_view.json` (Chrome
trace format, as torch's) and per-operator tables (`FRAMEWORK/cpu_op_*` on CPU, kernel tables on
Ascend). stop() parses the run (MindSpore's analysis step) and returns the trace and the tables.
"""
from __future__ import annotations

import contextlib
import glob
import os
import tempfile

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
        with _no_cann_search(device):
            self._prof = profiler.profile(
                activities=activities, start_profile=False,
                record_shapes=record_shapes or level in ("level1", "level2"),
                with_stack=with_stack or level == "level2", profile_memory=with_memory or level == "level2",
                on_trace_ready=profiler.tensorboard_trace_handler(dir_name=self.save_path))
        self._device = device

    def start(self) -> None:
        os.makedirs(self.save_path, mode=PRIVATE_DIR, exist_ok=True)
        self._prof.start()

    def stop(self) -> list[str]:
        with _no_cann_search(self._device):
            self._prof.stop()    # runs on_trace_ready: MindSpore parses its raw data into the files below
        run = os.path.join(self.save_path, "*_ascend_ms")
        paths = sorted(glob.glob(os.path.join(run, "ASCEND_PROFILER_OUTPUT", "trace_view.json"))
                       + glob.glob(os.path.join(run, "FRAMEWORK", "*op_type_info*.csv"))
                       + glob.glob(os.path.join(run, "ASCEND_PROFILER_OUTPUT", "*op_statistic*.csv")))
        for path in paths:
            os.chmod(path, PRIVATE_FILE)
        return paths


@contextlib.contextmanager
def _no_cann_search(device: str):
    """MindSpore 2.10's profiler looks for the CANN version file under $ASCEND_HOME_PATH, and with
    the variable unset it walks the current directory instead: seconds from a project folder with a
    virtual environment in it. Off Ascend there is no CANN to find: it walks an empty folder."""
    if device == "npu" or "ASCEND_HOME_PATH" in os.environ:
        yield
        return
    with tempfile.TemporaryDirectory() as empty:
        os.environ["ASCEND_HOME_PATH"] = empty
        try:
            yield
        finally:
            del os.environ["ASCEND_HOME_PATH"]
