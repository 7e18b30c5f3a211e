"""torch.profiler (torch_npu.profiler on Ascend) behind the ProfilerAPI."""
from __future__ import annotations

import os

import torch

from mindspeed.backends.base import ProfilerAPI


class TorchProfiler(ProfilerAPI):
    def __init__(self, device: str, save_path: str, *, level="level0", with_cpu=True, with_stack=False,
                 with_memory=False, record_shapes=False, tag=""):
        self.save_path, self.tag = save_path, tag
        if device == "npu":
            import torch_npu  # only on Ascend
            prof_mod = torch_npu.profiler
            activities = [prof_mod.ProfilerActivity.NPU]
        else:
            prof_mod = torch.profiler
            activities = [prof_mod.ProfilerActivity.CUDA] if device == "cuda" else []
        if with_cpu or not activities:
            activities.append(prof_mod.ProfilerActivity.CPU)
        # level1 adds shapes, level2 adds shapes + stacks + memory (explicit flags add to that)
        record_shapes = record_shapes or level in ("level1", "level2")
        with_stack = with_stack or level == "level2"
        with_memory = with_memory or level == "level2"
        self._prof = prof_mod.profile(activities=activities, record_shapes=record_shapes,
                                      profile_memory=with_memory, with_stack=with_stack)

    def start(self) -> None:
        self._prof.__enter__()

    def stop(self) -> list[str]:
        self._prof.__exit__(None, None, None)
        os.makedirs(self.save_path, mode=0o750, exist_ok=True)
        trace = os.path.join(self.save_path, f"{self.tag}trace.json")
        summary = os.path.join(self.save_path, f"{self.tag}summary.txt")
        self._prof.export_chrome_trace(trace)
        with open(summary, "w") as fh:
            fh.write(self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        for path in (trace, summary):
            os.chmod(path, 0o640)
        return [trace, summary]
