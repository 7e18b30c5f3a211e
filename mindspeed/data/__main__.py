"""python -m mindspeed.data: build a Megatron indexed dataset from text/JSONL (or the default corpus)."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mindspeed.data", description=__doc__)
    p.add_argument("--input", nargs="+", default=None,
                   help="text/JSONL files, directories or globs; omit for the bundled Shakespeare corpus")
    p.add_argument("--output-prefix", default=None,
                   help="writes PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json (required with --input)")
    p.add_argument("--tokenizer-type", default="CharLevel", choices=["CharLevel", "HuggingFaceTokenizer"])
    p.add_argument("--tokenizer-model", default=None, help="HF tokenizer name/path, available offline")
    p.add_argument("--json-key", default="text", help="field holding the text in JSONL inputs")
    p.add_argument("--chunk-chars", type=int, default=0,
                   help="cut documents into pieces of about this many characters (0: keep whole)")
    p.add_argument("--no-append-eod", action="store_false", dest="append_eod")
    p.add_argument("--cache-dir", default=None, help="cache root for the default corpus "
                                                     "(default $MINDSPEED_DATA_CACHE or ~/.cache/mindspeed)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mindspeed.data.indexed import DataError
    from mindspeed.data.tokenizer import TokenizerError
    try:
        if args.input is None:
            from mindspeed.data.shakespeare import ensure_dataset
            print(f"> default dataset ready: {ensure_dataset(args.cache_dir)}")
            return 0
        if not args.output_prefix:
            raise DataError("--output-prefix is required with --input")
        from mindspeed.data.preprocess import PreprocessConfig, preprocess
        preprocess(PreprocessConfig(inputs=args.input, output_prefix=args.output_prefix,
                                    tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                    json_key=args.json_key, chunk_chars=args.chunk_chars,
                                    append_eod=args.append_eod))
    except (DataError, TokenizerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
