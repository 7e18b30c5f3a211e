"""common.pt is read with torch's weights-only unpickler and Megatron-LM's few extra types
(mindspeed.checkpoint.common_state): what Megatron-LM stores loads, a pickle that names anything
else is refused without running it."""
from __future__ import annotations

import argparse
import os
import signal

import pytest
import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.enums import AttnBackend

from mindspeed.checkpoint import common_state, torch_dist


@pytest.fixture
def only_our_allow_list():
    """Megatron-Core registers its own safe types with torch on import; without them the file must
    still load, on our list alone."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.add_safe_globals(saved)


def megatron_lm_common(path):
    # what Megatron-LM core_v0.16's pretrain_gpt.py puts in common.pt beyond tensors: its args
    args = argparse.Namespace(model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
                              exit_signal=signal.SIGTERM, params_dtype=torch.bfloat16, hidden_size=64)
    torch.save({"args": args, "iteration": 2, "checkpoint_version": 3.0,
                "optimizer": {"state": {"common_step": torch.tensor(2.0)}}}, path)


def test_megatron_lm_common_state_loads(tmp_path, only_our_allow_list):
    megatron_lm_common(tmp_path / "common.pt")
    common = common_state.load_common(str(tmp_path / "common.pt"))
    assert common["args"].attention_backend is AttnBackend.auto and common["args"].exit_signal is signal.SIGTERM
    assert common["args"].model_type is ModelType.encoder_or_decoder and common["iteration"] == 2


def test_a_type_off_the_list_is_refused(tmp_path, only_our_allow_list, monkeypatch):
    monkeypatch.setattr(common_state, "COMMON_GLOBALS", [g for g in common_state.COMMON_GLOBALS if g is not AttnBackend])
    megatron_lm_common(tmp_path / "common.pt")
    with pytest.raises(common_state.UnsafeCommonState, match="names megatron.core.transformer.enums.AttnBackend"):
        common_state.load_common(str(tmp_path / "common.pt"))


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_runs_code_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "payload-ran"
    torch.save({"iteration": _Payload(marker)}, tmp_path / "common.pt")
    with pytest.raises(common_state.UnsafeCommonState) as refused:
        common_state.load_common(str(tmp_path / "common.pt"))
    message = str(refused.value)
    assert message == (f"{tmp_path}/common.pt names posix.system, which a checkpoint's common state never "
                       "holds (not loaded: it could run code)")
    assert not marker.exists()


def test_a_damaged_common_pt_is_unreadable_not_unsafe(tmp_path):
    (tmp_path / "common.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(Exception) as raised:
        common_state.load_common(str(tmp_path / "common.pt"))
    assert not isinstance(raised.value, common_state.UnsafeCommonState)


def test_no_checkpoint_reader_unpickles_freely():
    """No weights_only=False anywhere in MindSpeed."""
    root = os.path.dirname(os.path.dirname(torch_dist.__file__))
    found = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name)) as f:
                    if "weights_only=False" in f.read():
                        found.append(os.path.join(dirpath, name))
    assert not found, found
