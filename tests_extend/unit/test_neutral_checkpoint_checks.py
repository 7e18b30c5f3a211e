"""The neutral (safetensors) checkpoint of the MindSpore trainer refuses every kind of damage with
one line naming the file and the newest readable iteration with the flag that loads it, and
--ckpt-step picks an iteration. numpy + safetensors only: no MindSpore, no processes."""
import os

import numpy as np
import pytest

from mindspeed.errors import CheckpointError
from mindspeed.checkpoint import neutral as nf


@pytest.fixture
def root(tmp_path):
    """Iterations 4 and 8 of a tiny model with optimizer moments; the tracker names 8."""
    rng = np.random.default_rng(0)
    for it in (4, 8):
        model = {"embedding.word_embeddings.weight": rng.standard_normal((16, 8)).astype(np.float32),
                 "decoder.final_layernorm.weight": np.ones(8, np.float32)}
        moments = {f"exp_avg/{k}": np.zeros_like(v) for k, v in model.items()}
        nf.save(str(tmp_path), it, model, moments, {"consumed_samples": it * 4})
    return str(tmp_path)


def _refused(path, step=None):
    with pytest.raises(CheckpointError) as info:
        nf.load(path, step)
    message = str(info.value)
    assert "\n" not in message
    return message


def _snapshot(root):
    return {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(root) for f in fs}


def test_intact_checkpoint_loads_latest_or_the_step_asked_for(root):
    assert nf.load(root)[2]["iteration"] == 8
    assert nf.load(root, 4)[2]["iteration"] == 4
    assert nf.load(os.path.join(root, "iter_0000004"))[2]["iteration"] == 4
    assert nf.resolve(root, 4) == os.path.join(root, "iter_0000004")


@pytest.mark.parametrize("damage, expected", [
    (lambda p: os.truncate(p, 100), "is truncated (100 bytes"),
    (lambda p: os.truncate(p, 5), "is truncated (5 bytes: not even a safetensors header)"),
    (lambda p: os.truncate(p, os.path.getsize(p) - 1), "is truncated"),
    (lambda p: open(p, "ab").write(b"xx"), "has 2 bytes more than its header accounts for"),
    (lambda p: _poke(p, 9, b"\xff\xfe"), "has a damaged safetensors header"),
    (os.remove, "model.safetensors is missing"),
])
def test_damaged_model_file_is_named_with_the_last_readable_iteration(root, damage, expected):
    model = os.path.join(root, "iter_0000008", "model.safetensors")
    damage(model)
    before = _snapshot(root)
    message = _refused(root)
    assert model in message and expected in message, message
    assert f"the last readable checkpoint is iteration 4: load it with --load {root} --ckpt-step 4" in message
    assert _snapshot(root) == before                   # nothing written
    assert nf.load(root, 4)[2]["iteration"] == 4       # the named flag works


def _poke(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_damaged_optimizer_file_and_meta_are_named(root):
    opt = os.path.join(root, "iter_0000008", "optimizer.safetensors")
    os.truncate(opt, 50)
    assert f"{opt} is truncated" in _refused(root)
    meta = os.path.join(root, "iter_0000004", "meta.json")
    with open(meta, "w") as f:
        f.write("{not json")
    message = _refused(root, 4)
    assert f"{meta} is unreadable" in message and f"no readable checkpoint is left in {root}" in message


def test_tracker_and_step_errors_name_a_readable_iteration(root):
    with open(os.path.join(root, nf.TRACKER_FILE), "w") as f:
        f.write("garbage")
    message = _refused(root)
    assert "should hold an iteration number" in message and "--ckpt-step 8" in message
    message = _refused(root, 5)
    assert "iter_0000005 does not exist" in message and "--ckpt-step 8" in message
    message = _refused(os.path.join(root, "iter_0000004"), 8)
    assert f"pass the checkpoint root: --load {root} --ckpt-step 8" in message


def test_a_torch_dist_checkpoint_is_checked_as_one(tmp_path):
    """The MindSpore trainer loads the torch trainer's checkpoints (cross_format): a damaged one is
    refused by the torch_dist checks, naming the missing file."""
    it = tmp_path / "iter_0000002"
    it.mkdir()
    (it / ".metadata").write_bytes(b"")
    (tmp_path / nf.TRACKER_FILE).write_text("2")
    assert f"cannot be read: {it / 'metadata.json'} is missing; no readable checkpoint is left" in _refused(str(tmp_path))

