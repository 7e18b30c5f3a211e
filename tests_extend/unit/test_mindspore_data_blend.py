"""--data-path blends on the MindSpore trainer (training/mindspore/data.py): the order in which
samples come from the datasets is Megatron-Core's BlendedDataset's (its own compiled
build_blending_indices is the reference), weighted or by dataset sizes, and datasets preprocessed
with different tokenizers are refused in one line."""
import json
import types

import numpy as np
import pytest

from mindspeed.data.errors import DataError
from mindspeed.data.preprocess import PreprocessConfig, preprocess
from mindspeed.training.mindspore import data


class _Numbered:
    """A stream whose example(i) says which stream and sample it is."""

    def __init__(self, name: str, num_samples: int):
        self.name, self.num_samples = name, num_samples

    def example(self, index: int):
        return (self.name, index)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1.0, 2.0, 5.0], [1.0, 1.0]])
def test_the_order_is_megatron_cores_blending_order(weights):
    helpers_cpp = pytest.importorskip("megatron.core.datasets.helpers_cpp")
    size = 3000
    normalized = np.asarray(weights, np.float64) / sum(weights)
    dataset_index, sample_index = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers_cpp.build_blending_indices(dataset_index, sample_index, normalized, len(weights), size, False)
    blend = data.BlendedStream([_Numbered(str(d), 10) for d in range(len(weights))], weights)
    got = [blend.example(i) for i in range(size)]
    assert got == [(str(int(d)), int(s)) for d, s in zip(dataset_index, sample_index)]


def test_the_flag_reads_as_megatron_reads_it():
    assert data.blend_of(["30", "a", "70", "b"]) == (["a", "b"], [30.0, 70.0])
    assert data.blend_of(["a", "b"]) == (["a", "b"], None)
    assert data.blend_of(["a"]) == (["a"], None)


def _corpus(tmp_path, name: str, text: str) -> str:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(json.dumps({"text": (text + " ") * (5 + i)}) for i in range(30)))
    prefix = str(tmp_path / name)
    preprocess(PreprocessConfig(inputs=[str(src)], output_prefix=prefix), log=lambda *_: None)
    return prefix


def _args(data_path):
    return types.SimpleNamespace(data_path=data_path, mock_data=False, vocab_size=None, split="90,10,0",
                                 seq_length=16, seed=1234, is_instruction_dataset=False, data_cache_path=None)


def test_a_weighted_blend_of_two_datasets_feeds_the_trainer_in_its_weights(tmp_path):
    # one character set in both, so one tokenizer; "a" rich in one, "b" in the other
    heavy_a, heavy_b = _corpus(tmp_path, "a", "aab"), _corpus(tmp_path, "b", "bba")
    vocab, train, valid = data.build_streams(_args(["1", heavy_a, "3", heavy_b]))
    single = data.build_streams(_args([heavy_a]))[1]
    assert vocab == data.build_streams(_args([heavy_a]))[0]
    rows_of_a = {tuple(single.example(j)["tokens"]) for j in range(single.num_samples)}
    rows = [tuple(train.example(i)["tokens"]) for i in range(400)]
    assert sum(row in rows_of_a for row in rows) == 100      # the weight-1 dataset gives 1 in 4
    first_of_a = train.dataset_index.tolist().index(0)       # the dataset's own order, from its first sample
    np.testing.assert_array_equal(train.example(first_of_a)["tokens"], single.example(0)["tokens"])
    assert isinstance(valid, data.BlendedStream)
    sizes = data.build_streams(_args([heavy_a, heavy_b]))[1]     # no weights: by the datasets' sizes
    assert sizes.weights.tolist() == pytest.approx([s.num_samples / sizes.num_samples for s in sizes.streams])


def test_datasets_of_different_tokenizers_are_refused_in_one_line(tmp_path):
    ab, xy = _corpus(tmp_path, "ab", "ab"), _corpus(tmp_path, "xy", "xy")
    with pytest.raises(DataError) as err:
        data.build_streams(_args(["1", ab, "1", xy]))
    assert "different tokenizers" in str(err.value) and "\n" not in str(err.value)
