"""run_flags.json: written by the shared training loop at every save (plain JSON, rank 0 only) and
read back by mindspeed.generate / mindspeed.evaluate into the trainer's arguments at the launch's
tensor-parallel size. Plain Python: the loop with a fake framework, no model."""
from __future__ import annotations

import json
import os

import pytest

from mindspeed.checkpoint import run_flags
from mindspeed.errors import InferenceError
from mindspeed.generate.model_source import read_source
from mindspeed.training import loop
from mindspeed.training.logger import TrainingLogger
from tests_extend.unit.test_training_loop import FakeFramework, _args, _report


def _train_and_save(monkeypatch, save, *extra, writer=True):
    args = _args("--train-iters", "2", "--save", str(save), "--num-layers", "3", "--hidden-size", "96",
                 "--num-attention-heads", "6", "--ffn-hidden-size", "384", "--tensor-model-parallel-size", "1", *extra)
    args.vocab_size, args.padded_vocab_size = 70, 128          # what the trainers set before training
    fake = FakeFramework(monkeypatch)
    loop.train(args, TrainingLogger(args, is_writer=writer), fake.parts(), _report(args), loop.Progress(),
               publish=fake.publish)
    return args


def test_the_loop_writes_the_runs_flags_as_json_and_they_rebuild_the_model(monkeypatch, tmp_path):
    _train_and_save(monkeypatch, tmp_path, "--seed", "7", "--split", "80,20,0")
    with open(tmp_path / run_flags.RUN_FLAGS_FILE) as f:
        body = json.load(f)
    assert body["trainer"] == "torch" and body["args"]["hidden_size"] == 96 and body["args"]["seed"] == 7
    assert oct(os.stat(tmp_path / run_flags.RUN_FLAGS_FILE).st_mode & 0o777) == "0o640"

    source = read_source(str(tmp_path), world_size=2)
    a = source.args
    assert source.origin == "torch" and source.vocab_size == 70
    assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.split, a.seed) == (3, 96, 6, "80,20,0", 7)
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.data_parallel_size) == (2, 1, 1)
    assert a.padded_vocab_size == 128          # the checkpoint's padding: 128 rows split over 2
    assert read_source(str(tmp_path), world_size=3).args.padded_vocab_size == 384   # re-padded for 3


def test_only_the_writer_rank_writes_and_bad_layouts_are_refused(monkeypatch, tmp_path):
    (tmp_path / "a").mkdir()
    _train_and_save(monkeypatch, tmp_path / "a", writer=False)
    assert not os.path.exists(tmp_path / "a" / run_flags.RUN_FLAGS_FILE)
    _train_and_save(monkeypatch, tmp_path)
    with pytest.raises(InferenceError, match="--num-attention-heads 6, which does not split over 4"):
        read_source(str(tmp_path), world_size=4)
    (tmp_path / run_flags.RUN_FLAGS_FILE).write_text("[1, 2]")
    with pytest.raises(InferenceError, match="not a run's flags file"):
        read_source(str(tmp_path), world_size=1)
