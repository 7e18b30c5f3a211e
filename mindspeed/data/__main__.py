"""python -m mindspeed.data: build Megatron indexed datasets for pretraining or instruction tuning.

With a Hugging Face tokenizer folder (--tokenizer-type PretrainedFromHF --tokenizer-name-or-path
DIR) or --handler-name, it takes MindSpeed-LLM's preprocess_data.py flags (handlers, chat
templates, --map-keys, --workers, --pack, ...). Without them it builds a character-level dataset
(the bundled corpus when --input is omitted). `--config FILE.yaml` (or NAME for
configs/datasets/NAME.yaml) reads the flags from a MindSpeed-RL-style YAML file (keys are the flag
names with underscores); a flag typed on the command line wins over the file.
"""
from __future__ import annotations

import argparse
import difflib
import sys

from mindspeed import deferred_compile
from mindspeed.data.config_file import config_defaults
from mindspeed.data.errors import DataError
from mindspeed.data.shakespeare import ensure_dataset
from mindspeed.data.tokenizer import TokenizerError
from mindspeed.errors import ArgumentError, OneLineParser, hide_fallback_warnings, report
from mindspeed.patching import GLOBAL_PATCHES

# why MindSpeed-LLM's --tokenizer-not-use-fast is refused here (the trainers encode no text: no effect there)
SLOW_TOKENIZER_REFUSAL = ("transformers 5 loads every tokenizer with its fast implementation, the slow one "
                          "cannot be chosen; drop it")
HANDLER_ONLY = ("handler_name", "prompt_type", "map_keys", "json_keys", "seq_length", "pack", "neat_pack",
                "overwrite_cache", "dataset_additional_keys")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m mindspeed.data", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--config", default=None,
                   help="a YAML file of flags (keys: the flag names with underscores, as MindSpeed-RL's "
                        "configs/datasets/NAME.yaml), or NAME for configs/datasets/NAME.yaml; flags typed "
                        "on the command line win")
    for add in (_input_flags, _tokenizer_flags, _output_flags):
        add(p)
    return p


def _input_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("input data")
    g.add_argument("--input", nargs="+", default=None,
                   help="files, directories or globs: .json/.jsonl/.parquet/.arrow/.csv/.txt (character-level mode: "
                        ".txt/.json/.jsonl); omit for the bundled Shakespeare corpus")
    g.add_argument("--handler-name", default=None,
                   help="GeneralPretrainHandler (default with a Hugging Face tokenizer), "
                        "AlpacaStyleInstructionHandler, SharegptStyleInstructionHandler or "
                        "R1AlpacaStyleInstructionHandler (MindSpeed-RL's prompts for RL)")
    g.add_argument("--json-keys", nargs="+", default=None,
                   help="GeneralPretrainHandler: the text fields; one dataset PREFIX_<key>_document each "
                        "(default: text)")
    g.add_argument("--prompt-type", default=None,
                   help="instruction handlers: chat template (llama2, llama3, qwen, qwen_r1, chatml, alpaca, "
                        "default, empty or none, or 'tokenizer' for the tokenizer's own chat_template)")
    g.add_argument("--map-keys", default=None,
                   help='instruction handlers: JSON mapping of roles to columns, e.g. '
                        '\'{"prompt":"instruction","query":"input","response":"output"}\' (Alpaca) or '
                        '\'{"messages":"conversations","tags":{"role_tag":"from"}}\' (ShareGPT)')
    g.add_argument("--dataset-additional-keys", nargs="+", default=None,
                   help="R1AlpacaStyleInstructionHandler: one more dataset PREFIX_packed_<key>_document per key: "
                        "labels holds the answer's tokens, another key the tokens of that text column")
    g.add_argument("--cache-dir", default=None,
                   help="data cache root: the bundled corpus lives there, and with --input the processed "
                        "result is kept there and reused by an identical later run "
                        "(default: MindSpeed's cache root, $MINDSPEED_CACHE_DIR or ~/.cache/mindspeed)")
    g.add_argument("--overwrite-cache", action="store_true", help="process again even when --cache-dir has it")
    g.add_argument("--json-key", default=None, help="character-level mode: field holding the text (default text)")
    g.add_argument("--chunk-chars", type=int, default=0,
                   help="character-level mode: cut documents into pieces of about this many characters")


def _tokenizer_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None, choices=["CharLevel", "HuggingFaceTokenizer", "PretrainedFromHF"],
                   help="PretrainedFromHF: a local Hugging Face tokenizer folder (--tokenizer-name-or-path); "
                        "default CharLevel, or PretrainedFromHF when a tokenizer path is given")
    g.add_argument("--tokenizer-name-or-path", default=None, help="Hugging Face tokenizer folder (offline)")
    g.add_argument("--tokenizer-model", default=None, help="HF tokenizer name/path, available offline")
    g.add_argument("--tokenizer-not-use-fast", action="store_true",
                   help="refused: transformers 5 loads every tokenizer with its fast implementation")
    g.add_argument("--append-eod", action="store_true", default=None,
                   help="end each document (or conversation) with the eod token; default: on in "
                        "character-level mode, off with handlers (as MindSpeed-LLM)")
    g.add_argument("--no-append-eod", action="store_false", dest="append_eod")
    g.add_argument("--seq-length", type=int, default=None,
                   help="instruction handlers: drop samples longer than this; with --pack the packed length")
    g.add_argument("--pack", action="store_true", help="instruction handlers: pack samples into --seq-length")
    g.add_argument("--neat-pack", action="store_true",
                   help="with --pack: attention_mask numbers the samples of each packed sample (0 on padding), "
                        "so training with --neat-pack --reset-attention-mask keeps attention inside each one")
    g.add_argument("--pad-to-multiple-of", type=int, default=1,
                   help="instruction handlers: pad each sample to a multiple of this (label -100)")


def _output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output and runtime")
    g.add_argument("--output-prefix", default=None,
                   help="PREFIX of the output datasets (required with --input)")
    g.add_argument("--workers", type=int, default=1, help="worker processes that tokenize")
    g.add_argument("--n-subs", type=int, default=1,
                   help="cut the records into this many parts written in parallel, then joined")
    g.add_argument("--log-interval", type=int, default=100, help="a progress line every this many records")


def handler_mode(args) -> bool:
    return bool(args.handler_name or args.tokenizer_type == "PretrainedFromHF" or args.tokenizer_name_or_path)


def _tokenizer_folder(args) -> str | None:
    if args.tokenizer_name_or_path and args.tokenizer_model and args.tokenizer_name_or_path != args.tokenizer_model:
        raise DataError("--tokenizer-name-or-path and --tokenizer-model name different tokenizers: give one")
    if args.tokenizer_type not in (None, "PretrainedFromHF", "HuggingFaceTokenizer"):
        raise DataError(f"--handler-name needs a Hugging Face tokenizer, not --tokenizer-type {args.tokenizer_type}: "
                        "--tokenizer-type PretrainedFromHF --tokenizer-name-or-path DIR")
    return args.tokenizer_name_or_path or args.tokenizer_model


def _run_handler(args) -> None:
    from mindspeed.data.pipeline import HandlerConfig, run  # imports Megatron-Core: --help and refusals stay light
    if args.json_key is not None or args.chunk_chars:
        raise DataError("--json-key / --chunk-chars are character-level options; with handlers use --json-keys")
    run(HandlerConfig(inputs=args.input, output_prefix=args.output_prefix, tokenizer_path=_tokenizer_folder(args),
                      handler_name=args.handler_name or "GeneralPretrainHandler", json_keys=args.json_keys,
                      prompt_type=args.prompt_type, map_keys=args.map_keys,
                      dataset_additional_keys=args.dataset_additional_keys, append_eod=bool(args.append_eod),
                      seq_length=args.seq_length, pack=args.pack, neat_pack=args.neat_pack,
                      pad_to_multiple_of=args.pad_to_multiple_of,
                      workers=args.workers, n_subs=args.n_subs, log_interval=args.log_interval,
                      cache_dir=args.cache_dir, overwrite_cache=args.overwrite_cache))


def _run_char_level(args) -> None:
    from mindspeed.data.preprocess import PreprocessConfig, preprocess  # imports Megatron-Core (as pipeline)
    defaults = build_parser().parse_args([])
    given = [f"--{name.replace('_', '-')}" for name in HANDLER_ONLY + ("workers", "n_subs", "pad_to_multiple_of",
                                                                      "log_interval", "cache_dir")
             if getattr(args, name) != getattr(defaults, name)]
    if given:
        raise DataError(f"{', '.join(given)} need a Hugging Face tokenizer and a handler: add --tokenizer-type "
                        "PretrainedFromHF --tokenizer-name-or-path DIR [--handler-name ...]")
    preprocess(PreprocessConfig(inputs=args.input, output_prefix=args.output_prefix,
                                tokenizer_type=args.tokenizer_type or "CharLevel",
                                tokenizer_model=args.tokenizer_model, json_key=args.json_key or "text",
                                chunk_chars=args.chunk_chars,
                                append_eod=True if args.append_eod is None else args.append_eod))


def parse(argv=None) -> argparse.Namespace:
    """The flags, or ArgumentError in one line (a misspelt flag with the one it was probably meant to be)."""
    parser = build_parser()
    first, _ = parser.parse_known_args(argv)
    from_file = config_defaults(parser, first.config) if first.config else {}
    # the file's values are the defaults: a flag on the command line replaces them
    args, extras = parser.parse_known_args(argv, namespace=argparse.Namespace(**from_file))
    unknown = [tok.split("=", 1)[0] for tok in extras if tok.startswith("--")]
    if extras:
        flag = unknown[0] if unknown else extras[0]
        near = difflib.get_close_matches(flag, list(parser._option_string_actions), n=1, cutoff=0.75)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ArgumentError(f"unknown {'flag' if unknown else 'argument'} {flag}{hint}: "
                            "`python -m mindspeed.data --help` lists the flags")
    if args.tokenizer_not_use_fast:
        raise ArgumentError(f"--tokenizer-not-use-fast (tokenizer_not_use_fast: true): {SLOW_TOKENIZER_REFUSAL}")
    args.overridden = sorted(key for key, value in from_file.items() if getattr(args, key) != value)
    return args


def main(argv=None) -> int:
    hide_fallback_warnings()
    try:
        args = parse(argv)
    except ArgumentError as err:
        report(err)
        return 2
    deferred_compile.install(GLOBAL_PATCHES)   # before the builders import Megatron-Core: ~4 s of the start
    if args.overridden:
        print(f"> the command line overrides {', '.join(args.overridden)} of --config {args.config}")
    try:
        if args.input is None:
            if handler_mode(args):
                raise DataError("--input is required with a tokenizer folder or --handler-name")
            print(f"> default dataset ready: {ensure_dataset(args.cache_dir)}")
            return 0
        if not args.output_prefix:
            raise DataError("--output-prefix is required with --input")
        _run_handler(args) if handler_mode(args) else _run_char_level(args)
    except (DataError, TokenizerError) as err:
        report(err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
