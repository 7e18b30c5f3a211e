"""Build Megatron indexed datasets (thin wrapper of `python -m mindspeed.data`; MindSpeed-LLM's flags).

    # instruction data, as MindSpeed-LLM's guide: PREFIX_packed_{input_ids,attention_mask,labels}_document
    python tests_extend/example/preprocess_data.py --input alpaca.parquet --tokenizer-type PretrainedFromHF \
        --tokenizer-name-or-path HF_DIR --handler-name AlpacaStyleInstructionHandler --prompt-type llama2 \
        --output-prefix data/alpaca --workers 4 --log-interval 1000
    # pretraining documents (PREFIX_text_document) with a Hugging Face tokenizer
    python tests_extend/example/preprocess_data.py --input corpus/ --tokenizer-name-or-path HF_DIR \
        --handler-name GeneralPretrainHandler --json-keys text --output-prefix data/corpus
    python tests_extend/example/preprocess_data.py --input my_corpus/ --output-prefix data/my_corpus   # char level
    python tests_extend/example/preprocess_data.py            # build the bundled Shakespeare dataset
Then train: `DATA_PATH=data/corpus_text_document bash tests_extend/example/train_distributed.sh`, or
fine-tune with `--data-path data/alpaca --is-instruction-dataset --finetune --load MG_DIR`.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # run from source

from mindspeed.data.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
