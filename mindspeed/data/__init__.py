"""Data preparation: text/JSONL/parquet -> Megatron indexed datasets (pretraining documents or
instruction samples with their loss labels), tokenizers, the default corpus.

`python -m mindspeed.data --help` is the command line.
"""
from mindspeed.data.errors import DataError
from mindspeed.data.indexed_reader import check_dataset
from mindspeed.data.tokenizer import CharLevelTokenizer, HuggingFaceTokenizer, TokenizerError, load_tokenizer


__all__ = ["DataError", "TokenizerError", "check_dataset", "load_tokenizer", "CharLevelTokenizer",
           "HuggingFaceTokenizer"]
