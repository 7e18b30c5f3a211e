"""Megatron-LM's legacy checkpoint files (--ckpt-format torch, mindspeed/checkpoint/legacy.py) without a
process group: the per-rank directory names, the check every rank runs before a load (a missing rank, a
truncated file, a file that would run code), the converter's reader of the format, and the MindSpore trainer,
which refuses it in one line. Saving and resuming: tests_extend/distributed/test_legacy_checkpoint.py and
tests_extend/system/test_pretrain_gpt.py; converting: tests_extend/unit/test_convert_legacy.py."""
import argparse
import fractions
import os

import pytest
import torch

from mindspeed.checkpoint import legacy, neutral, scan, torch_dist
from mindspeed.errors import CheckpointError, ConvertError


def _checkpoint(root, names=("mp_rank_00", "mp_rank_01"), iteration=3) -> str:
    """A legacy checkpoint as torch.save writes it: per rank a dict with Megatron-LM's keys."""
    directory = os.path.join(root, f"iter_{iteration:07d}")
    for name in names:
        os.makedirs(os.path.join(directory, name))
        torch.save({"args": argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                               consumed_train_samples=24),
                    "checkpoint_version": 3.0, "iteration": iteration, "model": {"w": torch.zeros(2)}},
                   os.path.join(directory, name, legacy.MODEL_FILE))
    with open(os.path.join(root, torch_dist.TRACKER), "w") as f:
        f.write(str(iteration))
    return directory


def test_rank_directories_are_megatron_lms():
    assert legacy.rank_dir_name(1, 0, 0, pp_size=1, ep_size=1) == "mp_rank_01"
    assert legacy.rank_dir_name(1, 2, 0, pp_size=4, ep_size=1) == "mp_rank_01_002"
    assert legacy.rank_dir_name(0, 0, 3, pp_size=1, ep_size=4) == "mp_rank_00_003"
    assert legacy.rank_dir_name(0, 1, 3, pp_size=2, ep_size=4) == "mp_rank_00_001_003"
    assert legacy.expected_rank_dirs(2, 2, 1) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                                  "mp_rank_01_001"]


def test_a_whole_checkpoint_passes_and_reads(tmp_path):
    directory = _checkpoint(str(tmp_path))
    assert scan.is_legacy(directory) and not scan.is_legacy(str(tmp_path))
    assert torch_dist.read_tracker(str(tmp_path)) == 3
    common = torch_dist.read_common(str(tmp_path))
    assert (common["iteration"], common["consumed_train_samples"], common["no_optimizer"]) == (3, 24, True)
    assert legacy.saved_sizes(directory) == (2, 1, 1)


def test_a_missing_rank_or_a_damaged_file_is_named(tmp_path):
    directory = _checkpoint(str(tmp_path / "a"), names=("mp_rank_00_000", "mp_rank_01_001"))
    assert legacy.check_iteration(directory) == f"{os.path.join(directory, 'mp_rank_00_001')} is missing"
    directory = _checkpoint(str(tmp_path / "b"))
    path = os.path.join(directory, "mp_rank_01", legacy.MODEL_FILE)
    os.truncate(path, os.path.getsize(path) - 10)
    with pytest.raises(CheckpointError) as err:
        torch_dist.read_tracker(str(tmp_path / "b"))
    assert f"{path} is unreadable" in str(err.value) and "no readable checkpoint is left" in str(err.value)


def test_a_file_that_would_run_code_is_not_unpickled(tmp_path):
    directory = _checkpoint(str(tmp_path))
    torch.save({"args": fractions.Fraction(1, 3), "iteration": 3}, os.path.join(directory, "mp_rank_00", legacy.MODEL_FILE))
    with pytest.raises(ValueError, match="names fractions.Fraction, which a checkpoint's common state never holds"):
        legacy.read_file(os.path.join(directory, "mp_rank_00", legacy.MODEL_FILE))


def test_the_converter_reads_it_and_the_mindspore_trainer_refuses_it_in_one_line(tmp_path):
    from mindspeed.checkpoint.legacy_read import LegacyReader
    from mindspeed.checkpoint.megatron_read import open_checkpoint
    directory = _checkpoint(str(tmp_path))
    reader = open_checkpoint(str(tmp_path))
    assert isinstance(reader, LegacyReader) and not reader.grouped
    assert torch.equal(reader.get("w"), torch.zeros(2))      # not a tensor-parallel one: each rank's whole copy
    os.remove(os.path.join(directory, "mp_rank_01", legacy.MODEL_FILE))
    with pytest.raises(ConvertError, match="mp_rank_01/model_optim_rng.pt is missing"):
        open_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError) as err:
        neutral.resolve(str(tmp_path))
    assert "which the MindSpore trainer does not read: resume it once with --backend torch --ckpt-format " \
           "torch_dist" in str(err.value) and "\n" not in str(err.value)
    assert directory
