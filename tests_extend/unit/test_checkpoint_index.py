"""The restricted reader of torch.distributed.checkpoint's index (.metadata): what every supported
Python writes loads, and nothing that could run code does. Python 3.11.0-3.11.4 (Debian 12 has
3.11.2) pickle an enum member as getattr(EnumClass, 'NAME'); later ones as EnumClass(value)."""
import enum
from collections import OrderedDict
import os
import pickle
import subprocess
import sys

import pytest

from mindspeed.checkpoint import torch_dist as ck


class _EnumsByGetattr(pickle.Pickler):
    """Pickles as 3.11.2 does, on any Python: an enum member becomes getattr(EnumClass, 'NAME')."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    """A real index, written by Megatron-Core's dist-checkpoint save in a process of its own."""
    directory = str(tmp_path_factory.mktemp("dcp"))
    worker = os.path.join(os.path.dirname(__file__), "checkpoint_index_worker.py")
    done = subprocess.run([sys.executable, worker, directory], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return directory


def _rewrite_index(directory, pickler_class, obj):
    with open(os.path.join(directory, ck.INDEX_FILE), "wb") as f:
        pickler_class(f, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)


@pytest.mark.parametrize("pickler", [pickle.Pickler, _EnumsByGetattr], ids=["enum-by-value", "enum-by-getattr"])
def test_an_index_from_every_supported_python_loads(index_dir, tmp_path, pickler):
    with open(os.path.join(index_dir, ck.INDEX_FILE), "rb") as f:
        original = pickle.load(f)
    copy = tmp_path / "copy"
    copy.mkdir()
    _rewrite_index(str(copy), pickler, original)
    if pickler is _EnumsByGetattr:
        assert b"getattr" in (copy / ck.INDEX_FILE).read_bytes()      # the 3.11.2 form is really there
    assert ck.read_index(str(copy)) == original


class _Evil:
    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return getattr, (self.target, self.name)


@pytest.mark.parametrize("target,name", [
    (OrderedDict, "fromkeys"),                # a class the index may name, but not an enum
    (set(), "__class__"),                     # not a class at all
    (enum.Enum, "__new__"),                   # an enum class outside torch's checkpoint
])
def test_getattr_outside_the_checkpoint_enums_is_refused(tmp_path, target, name):
    _rewrite_index(str(tmp_path), pickle.Pickler, {"x": _Evil(target, name)})
    with pytest.raises(pickle.UnpicklingError, match="could run code"):
        ck.read_index(str(tmp_path))


def test_getattr_reaching_os_system_runs_nothing(tmp_path):
    """getattr(os-module, 'system')('touch MARKER'), spelled out in pickle opcodes (a module
    cannot be pickled by Pickler): the unpickler must refuse before anything runs."""
    marker = tmp_path / "ran"
    payload = (b"cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\ntR(V"
               + f"touch {marker}".encode() + b"\ntR.")
    (tmp_path / ck.INDEX_FILE).write_bytes(payload)
    with pytest.raises(pickle.UnpicklingError, match="could run code"):
        ck.read_index(str(tmp_path))
    assert not marker.exists()
    pickle.loads(payload)               # the payload is live: a plain unpickler runs it
    assert marker.exists()


def test_getattr_of_a_checkpoint_enum_is_limited_to_its_members(tmp_path):
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as encoding
    _rewrite_index(str(tmp_path), pickle.Pickler, [_Evil(encoding, encoding.TORCH_CONTIGUOUS_FORMAT.name)])
    assert ck.read_index(str(tmp_path)) == [encoding.TORCH_CONTIGUOUS_FORMAT]
    for name in ("__init_subclass__", "_missing_", "mro"):
        _rewrite_index(str(tmp_path), pickle.Pickler, [_Evil(encoding, name)])
        with pytest.raises(pickle.UnpicklingError, match="could run code"):
            ck.read_index(str(tmp_path))
    from torch.distributed.checkpoint.metadata import Metadata      # a class, but not an enum
    _rewrite_index(str(tmp_path), pickle.Pickler, [_Evil(Metadata, "__init__")])
    with pytest.raises(pickle.UnpicklingError, match="could run code"):
        ck.read_index(str(tmp_path))
