"""run_msrun launches again once when a worker died inside native code (MindSpore 2.10's rare crash
while freeing an autograd graph), and fails at once on anything else."""
import os

import pytest

pytest.importorskip("mindspore")

from tests_extend.distributed.msrun_helper import MsrunError, run_msrun  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "msrun_crash_worker.py")


def test_a_native_crash_is_launched_once_more(tmp_path, capfd):
    out = tmp_path / "out"
    out.mkdir()
    results = run_msrun(WORKER, [str(out), "segfault"], str(out), timeout=120)
    assert results[1]["launch"] == 2      # rank 1 died in the first launch and ran in a second
    # every result is that second launch's: none written late by a worker of the crashed one (rank 0
    # may not have started at all in the first launch when msrun ended it early, so it counts 1 or 2)
    assert results[0]["mark"] == results[1]["mark"] is not None
    assert "crashed inside MindSpore; launching once more" in capfd.readouterr().err


def test_a_python_error_fails_without_a_second_launch(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(MsrunError, match="a Python error in the worker") as failure:
        run_msrun(WORKER, [str(out), "raise"], str(out), timeout=120)
    assert not failure.value.native_crash
    assert (tmp_path / "launched.0").read_text() == "x"        # launched once
