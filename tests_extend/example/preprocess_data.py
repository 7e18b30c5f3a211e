"""Turn text/JSONL into a Megatron indexed dataset (thin wrapper of `python -m mindspeed.data`).

    python tests_extend/example/preprocess_data.py --input my_corpus/ --output-prefix data/my_corpus
    python tests_extend/example/preprocess_data.py            # build the bundled Shakespeare dataset
Then train on it with `DATA_PATH=data/my_corpus bash tests_extend/example/train_distributed.sh`.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # run from source

from mindspeed.data.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
