"""--data-cache-path on the MindSpore trainer (training/mindspore/order_cache.py): each split's
per-epoch sample order is written under the flag's folder and read back by the next run (which
follows the file, not its own seed); a moved cache is reused, a file that is not an order of the
split's samples or a description of other settings is refused in one line; the trainer's losses
with the cache, written or read, equal those without it."""
import json
import os
import shutil
import types

import numpy as np
import pytest

from mindspeed.data.errors import DataError
from mindspeed.data.preprocess import PreprocessConfig, preprocess
from mindspeed.training.mindspore import data
from tests_extend.system.one_process_run import run_pretrain_gpt

SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cache_corpus")
    src = tmp / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"the fox {i} jumps over the lazy dog. " * (2 + i % 3)})
                             for i in range(30)))
    prefix = str(tmp / "docs")
    preprocess(PreprocessConfig(inputs=[str(src)], output_prefix=prefix), log=lambda *_: None)
    return prefix


def _args(prefix, cache=None, seed=1234):
    return types.SimpleNamespace(data_path=[prefix], mock_data=False, vocab_size=None, split="90,10,0",
                                 seq_length=SEQ, seed=seed, is_instruction_dataset=False, data_cache_path=cache)


def _samples(stream, n):
    return np.stack([stream.example(i)["tokens"] for i in range(n)])


def _files(cache):
    return sorted(os.listdir(cache))


def test_the_orders_are_written_then_read_back_and_followed(corpus, tmp_path):
    _, plain, _ = data.build_streams(_args(corpus))
    cache = str(tmp_path / "cache")
    _, train, valid = data.build_streams(_args(corpus, cache))
    n = train.num_samples
    np.testing.assert_array_equal(_samples(train, 2 * n), _samples(plain, 2 * n))     # two epochs
    assert (train.cache.written, valid.cache.written) == (2, 1) and train.cache.read == 0
    names = _files(cache)
    assert len(names) == 5 and sum(name.endswith("-train-shuffle_epoch1.npy") for name in names) == 1, names

    _, again, _ = data.build_streams(_args(corpus, cache))
    assert again.cache.read == 1 and again.cache.written == 0
    first = os.path.join(cache, next(name for name in names if name.endswith("-train-shuffle_epoch0.npy")))
    swapped = np.load(first)[::-1].copy()          # another order of the same samples
    with open(first, "wb") as f:
        np.save(f, swapped)
    _, follows, _ = data.build_streams(_args(corpus, cache))
    np.testing.assert_array_equal(follows.example(0)["tokens"], plain.tokens[swapped[0] * SEQ:swapped[0] * SEQ + SEQ])
    assert not np.array_equal(_samples(follows, n), _samples(plain, n))


def test_a_moved_cache_is_reused_and_other_settings_write_their_own(corpus, tmp_path):
    cache, moved = str(tmp_path / "cache"), str(tmp_path / "elsewhere")
    data.build_streams(_args(corpus, cache))
    shutil.move(cache, moved)
    _, train, valid = data.build_streams(_args(corpus, moved))
    assert (train.cache.read, valid.cache.read, train.cache.written, valid.cache.written) == (1, 1, 0, 0)
    _, other, _ = data.build_streams(_args(corpus, moved, seed=99))
    assert other.cache.read == 0 and other.cache.written == 1 and len(_files(moved)) == 8


@pytest.mark.parametrize("damage", ["not an order", "cut short", "other settings"])
def test_a_damaged_cache_is_refused_in_one_line(corpus, tmp_path, damage):
    cache = str(tmp_path / "cache")
    data.build_streams(_args(corpus, cache))
    train_files = [os.path.join(cache, n) for n in _files(cache) if "-train-" in n]
    order = next(p for p in train_files if p.endswith("epoch0.npy"))
    description = next(p for p in train_files if p.endswith("description.json"))
    if damage == "not an order":
        bad = np.load(order)
        bad[0] = bad[1]
        with open(order, "wb") as f:
            np.save(f, bad)
    elif damage == "cut short":
        with open(order, "r+b") as f:
            f.truncate(os.path.getsize(order) // 2)
    else:
        text = open(description).read().replace('"seq_length": 16', '"seq_length": 17')
        open(description, "w").write(text)
    with pytest.raises(DataError) as err:
        data.build_streams(_args(corpus, cache))
    message = str(err.value)
    assert "\n" not in message and message.startswith("--data-cache-path: ") and "delete it" in message
    assert (description if damage == "other settings" else order) in message


def _losses(result, path):
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line)["lm_loss"] for line in open(path)]


def test_the_trainers_losses_with_the_cache_equal_those_without(corpus, tmp_path):
    pytest.importorskip("mindspore")
    tiny = ["--backend", "mindspore", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--micro-batch-size", "4",
            "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-3", "--log-interval", "1",
            "--eval-iters", "0", "--data-path", corpus, "--split", "90,10,0"]
    cache = str(tmp_path / "cache")
    plain = _losses(run_pretrain_gpt(*tiny, "--log-loss-file", str(tmp_path / "plain.jsonl")), tmp_path / "plain.jsonl")
    runs = []
    for name in ("write", "read"):
        result = run_pretrain_gpt(*tiny, "--data-cache-path", cache, "--log-loss-file", str(tmp_path / f"{name}.jsonl"))
        runs.append((_losses(result, tmp_path / f"{name}.jsonl"), result.stdout))
    (written, write_log), (read, read_log) = runs
    assert written == plain and read == plain and len(plain) == 6
    assert f"> data cache {cache}: read 0, wrote 2 sample-order files" in write_log, write_log[-2000:]
    assert f"> data cache {cache}: read 2, wrote 0 sample-order files" in read_log, read_log[-2000:]
