"""Data preparation: text/JSONL/parquet -> Megatron indexed datasets (pretraining documents or
instruction samples with their loss labels), tokenizers, the default corpus.

`python -m mindspeed.data --help` is the command line.
"""
from mindspeed.data.errors import DataError
from mindspeed.data.tokenizer import CharLevelTokenizer, HuggingFaceTokenizer, TokenizerError, load_tokenizer


def __getattr__(name):
    # the indexed-dataset code needs Megatron-Core (and torch): loaded on first use only, so the
    # MindSpore trainer runs where neither is installed
    if name == "check_dataset":
        from mindspeed.data.indexed import check_dataset
        return check_dataset
    raise AttributeError(f"module 'mindspeed.data' has no attribute {name!r}")


__all__ = ["DataError", "TokenizerError", "check_dataset", "load_tokenizer", "CharLevelTokenizer",
           "HuggingFaceTokenizer"]
