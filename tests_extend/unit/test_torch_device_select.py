"""The torch backend's device known without importing torch (backends/torch/device_select.py): only
where torch's own selection (backends/torch/device.py) has one answer on the installed build."""
import pytest

from mindspeed.backends.torch import device_select

CPU_BUILD = """from typing import Optional
__version__ = '2.13.0+cpu'
debug = False
cuda: Optional[str] = None
git_version = 'abc'
hip: Optional[str] = None
rocm: Optional[str] = None
xpu: Optional[str] = None
"""


@pytest.mark.parametrize("text, cpu_only", [
    (CPU_BUILD, True),
    (CPU_BUILD.replace("cuda: Optional[str] = None", "cuda: Optional[str] = '12.8'"), False),
    (CPU_BUILD.replace("hip: Optional[str] = None", "hip = '6.2.41133'"), False),
    (CPU_BUILD.replace("xpu: Optional[str] = None", "xpu: Optional[str] = '20250101'"), False),
    (CPU_BUILD.replace("rocm: Optional[str] = None\n", "").replace("xpu: Optional[str] = None\n", ""), True),
    (CPU_BUILD.replace("cuda: Optional[str] = None\n", ""), False),          # an older layout: ask torch
    ("cuda = None\nhip = None +", False),                                      # unreadable
    (CPU_BUILD.replace("cuda: Optional[str] = None", "cuda = _detect()"), False),
])
def test_a_cpu_only_build_is_read_off_torchs_version_file(text, cpu_only):
    assert device_select.names_no_accelerator(text) is cpu_only


@pytest.mark.parametrize("requested", [None, "auto", "cpu", "AUTO"])
def test_the_answer_without_torch_is_torchs_own_here(requested, monkeypatch):
    import torch
    from mindspeed.backends.torch.device import select_device
    monkeypatch.delenv(device_select.DEVICE_ENV, raising=False)
    on_this_build = torch.version.cuda is None and torch.version.hip is None
    assert device_select.cpu_only_torch() is (on_this_build and not device_select.importlib.util.find_spec("torch_npu"))
    known = device_select.device_without_torch(requested)
    assert known in (None, select_device(requested))
    if requested in ("cpu",) or on_this_build:
        assert known == "cpu"


def test_other_requests_are_left_to_torch(monkeypatch):
    monkeypatch.setenv(device_select.DEVICE_ENV, "cuda")
    assert device_select.device_without_torch(None) is None
    assert device_select.device_without_torch("npu") is None
    monkeypatch.setenv(device_select.DEVICE_ENV, "cpu")
    assert device_select.device_without_torch(None) == "cpu"


def test_the_mindspore_backends_cpu_is_known_without_importing_mindspore_where_no_ascend_device_is():
    """/dev/davinciN: how an Ascend device shows (its driver's nodes); without one, 'auto' is the cpu, and a
    MindSpore preflight stays as light as torch's."""
    import glob
    import subprocess
    import sys
    pytest.importorskip("mindspore")
    from mindspeed.backends.mindspore import device_select as ms_select
    assert ms_select._no_ascend_device_nodes() is (not glob.glob("/dev/davinci[0-9]*"))
    code = ("import sys; from mindspeed.backends.mindspore.device_select import select_device as s; "
            "print(s('auto'), s('cpu'), 'mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.split()
    if ms_select._no_ascend_device_nodes():
        assert out == ["cpu", "cpu", "False"], out
    else:
        assert out[1:] == ["cpu", "False"], out
