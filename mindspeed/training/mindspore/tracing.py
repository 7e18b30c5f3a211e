"""The trainer's forward traced into a MindSpore graph (`mindspore.jit(capture_mode="trace")`),
and two fixes to MindSpore 2.10's trace that the trainer needs."""
from __future__ import annotations

import re
import sys

import mindspore as ms


_KEPT: list = []
# frames of MindSpore's own front end, left out of a traced op's caller list as MindSpore leaves them out
_MINDSPORE_FRONTEND = re.compile(r"mindspore/common/.*\.py|mindspore/ops/.*\.py|mindspore/nn/.*\.py")


def traced(fn):
    """fn as a traced graph: one launch instead of hundreds of PyNative op dispatches."""
    _tolerate_sourceless_frames()
    _skip_debug_formatting()
    # MindSpore caches a trace under id(fn) for the life of the process: were fn freed, a later
    # function at the same address (a second trainer's forward) would run this one's graph
    _KEPT.append(fn)
    return ms.jit(fn, capture_mode="trace")


def _tolerate_sourceless_frames() -> None:
    """MindSpore 2.10's trace formats every caller frame's source line even with debug logging off,
    and fails on a frame that has none (exec'd or generated code up the stack, e.g. under pytest):
    the same caller list, read from the frames themselves (inspect.stack stats and reads the source
    file of every frame, for every op the trace records)."""
    from mindspore.graph import jit_trace
    if getattr(jit_trace._get_caller_lines, "_mindspeed", False):
        return

    def caller_lines():
        files, lines = [], []
        frame = sys._getframe()
        while frame is not None:
            name = frame.f_code.co_filename
            if _MINDSPORE_FRONTEND.search(name) is None:
                files.append(name)
                lines.append(frame.f_lineno)
            frame = frame.f_back
        return files, lines
    caller_lines._mindspeed = True
    jit_trace._get_caller_lines = caller_lines


def _skip_debug_formatting() -> None:
    """MindSpore 2.10's trace builds a debug message for every recorded op, f-string first, so
    every argument tensor is synchronised and printed even with debug logging off: ~10 s of a
    TP=2 example's first step. The same recording, without the message."""
    from mindspore.common.api import _pynative_executor
    from mindspore.graph import jit_trace
    context = jit_trace.TraceJitContext
    if getattr(context.run_op, "_mindspeed", False):
        return

    def run_op(self, prim, prim_res, *args):
        # what formatting the message did as a side effect: the op's result and arguments are
        # computed (PyNative runs ops asynchronously) before the trace records them
        _pynative_executor.sync()
        prim_res, file_names, linenos, args = self.args_preprocess(prim.name, prim_res, *args)
        jit_trace.tr.get_instance().new_node(prim, (prim_res, file_names, linenos, False), *args)
        return prim_res

    def prepare_op(self, prim_name, prim_res, *args):
        return self.args_preprocess(prim_name, prim_res, *args)
    run_op._mindspeed = True
    context.run_op, context.prepare_op = run_op, prepare_op
