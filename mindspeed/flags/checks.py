"""Checks of the Megatron flags beyond sizes: implementation switches MindSpeed does not ship
(refused with what to use instead), fp16 loss scaling, batch size ramp-up and tokenizers.
Framework-free; `trainer_flags.validate_args` collects their one-line problems.
"""
from __future__ import annotations

import os
import re

# MindSpeed-LLM's name for Megatron's HuggingFaceTokenizer (--tokenizer-name-or-path for --tokenizer-model)
PRETRAINED_FROM_HF = "PretrainedFromHF"
# Megatron's --tokenizer-type values (and MindSpeed-LLM's); the trainers implement the first six
# (data/flag_tokenizers.py; PretrainedFromHF is HuggingFaceTokenizer: resolve_hf_alias)
TOKENIZER_TYPES = ["CharLevel", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer", PRETRAINED_FROM_HF,
                   "Llama2Tokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "TikTokenizer", "MultimodalTokenizer",
                   "NullMultimodalTokenizer", "SFTTokenizer"]
IMPLEMENTED_TOKENIZERS = TOKENIZER_TYPES[:6]
# Megatron's fp16 dynamic loss scaling defaults (OptimizerConfig's too)
LOSS_SCALE_DEFAULTS = {"initial_loss_scale": 2.0 ** 32, "min_loss_scale": 1.0, "loss_scale_window": 1000.0,
                       "hysteresis": 2}


def cross_flag_problems(args) -> list[str]:
    problems = []
    for check in (_implementation_problems, _loss_scale_problems, _rampup_problems, _tokenizer_problems,
                  padded_vocab_problems,
                  _checkpoint_problems, _moe_problems, instruction_problems, _wsd_problems, _timeout_problems):
        problems.extend(check(args))
    return problems


def _timeout_problems(args) -> list[str]:
    minutes = args.distributed_timeout_minutes
    if not 0 < minutes < float("inf"):     # nan fails both comparisons
        return [f"--distributed-timeout-minutes {minutes:g}: give a positive number of minutes (0.5 is 30 s)"]
    return []


def _wsd_problems(args) -> list[str]:
    """The WSD flags shape only a WSD schedule: with another --lr-decay-style they would be ignored."""
    given = ([_flag("lr_wsd_decay_iters")] if args.lr_wsd_decay_iters is not None else []) + \
        ([_flag("lr_wsd_decay_style")] if args.lr_wsd_decay_style != "exponential" else [])
    if given and args.lr_decay_style != "WSD":
        return [f"{', '.join(given)}: only a WSD schedule reads it (add --lr-decay-style WSD, or drop the flag)"]
    return []


def instruction_problems(args) -> list[str]:
    """An instruction dataset is one prefix of files an instruction handler wrote; the GPTDataset
    options that have no meaning for it are refused rather than ignored."""
    if not args.is_instruction_dataset:
        return ["--neat-pack reads an instruction dataset: add --is-instruction-dataset"] if args.neat_pack else []
    if args.neat_pack and not args.reset_attention_mask:
        # MindSpeed-LLM's rule: the packed samples' separation is an attention-mask reset
        return ["--neat-pack needs --reset-attention-mask (attention restarts at each packed sample)"]
    paths = [p for p in args.data_path or [] if not is_number(p)]
    if args.mock_data or len(paths) != 1:
        return ["--is-instruction-dataset needs --data-path PREFIX: one instruction dataset made by "
                "`python -m mindspeed.data --handler-name AlpacaStyleInstructionHandler ...` (no mock data, no blend)"]
    if args.data_cache_path is not None:
        return ["--data-cache-path: an instruction dataset keeps its sample order in memory; drop the flag"]
    return []


def is_number(text: str) -> bool:
    """A weight of --data-path's 'w1 p1 w2 p2' (or a negative number among unknown flags)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


# MoE settings and their defaults: changing one configures MoE layers, which only --num-experts makes
MOE_DEFAULTS = {"moe_router_topk": 2, "moe_ffn_hidden_size": None, "moe_token_dispatcher_type": "alltoall",
                "moe_aux_loss_coeff": 0.0}


def _moe_problems(args) -> list[str]:
    if args.num_experts:
        return []
    changed = [f"--{name.replace('_', '-')}" for name, default in MOE_DEFAULTS.items()
               if getattr(args, name) != default]
    return [f"{', '.join(changed)} configure MoE layers: add --num-experts or drop them"] if changed else []


def _checkpoint_problems(args) -> list[str]:
    """--ckpt-step picks an iteration of the --load root: without --load nothing would read it."""
    if args.ckpt_step is None:
        return []
    if not args.load:
        return [f"--ckpt-step needs --load (the checkpoint root to take iteration {args.ckpt_step} from): "
                "add --load DIR or drop --ckpt-step"]
    if args.ckpt_step < 0:
        return [f"--ckpt-step must be a non-negative iteration number (got {args.ckpt_step})"]
    return []


def _implementation_problems(args) -> list[str]:
    problems = []
    if args.transformer_impl == "transformer_engine":
        problems.append("--transformer-impl transformer_engine needs NVIDIA Transformer Engine, which MindSpeed "
                        "does not use: use --transformer-impl local (fused kernels come from --use-flash-attn, "
                        "--use-fused-rmsnorm, --use-fused-swiglu, --use-fused-rotary-pos-emb)")
    if args.use_legacy_models:
        problems.append("--use-legacy-models: the built-in trainer builds Megatron-Core's GPTModel only; "
                        "drop the flag")
    backend = args.attention_backend
    if backend == "fused":
        problems.append("--attention-backend fused needs Transformer Engine's cuDNN fused attention, which "
                        "MindSpeed does not use: use --attention-backend flash (MindSpeed's flash-attention "
                        "kernel) or auto")
    if backend in ("local", "unfused") and args.use_flash_attn:
        problems.append(f"--attention-backend {backend} (Megatron-Core's unfused attention) contradicts "
                        "--use-flash-attn: drop one, or use --attention-backend flash")
    if not args.bias_swiglu_fusion and args.use_fused_swiglu:
        problems.append("--no-bias-swiglu-fusion contradicts --use-fused-swiglu (MindSpeed's bias-SwiGLU "
                        "fusion): drop one")
    if not args.apply_rope_fusion and args.use_fused_rotary_pos_emb:
        problems.append("--no-rope-fusion contradicts --use-fused-rotary-pos-emb (MindSpeed's RoPE fusion): "
                        "drop one")
    return problems


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _loss_scaling(args) -> dict:
    """--loss-scale and the dynamic scaling flags given (None: not given)."""
    return {n: getattr(args, n) for n in ("loss_scale", *LOSS_SCALE_DEFAULTS)}


def dynamic_loss_scaling(args) -> dict:
    """The dynamic loss-scaling settings: each flag given, else Megatron's default."""
    given = _loss_scaling(args)
    return {n: default if given[n] is None else given[n] for n, default in LOSS_SCALE_DEFAULTS.items()}


def _loss_scale_problems(args) -> list[str]:
    scaling = _loss_scaling(args)
    dynamic = [_flag(n) for n in LOSS_SCALE_DEFAULTS if scaling[n] is not None]
    given = dynamic + (["--loss-scale"] if args.loss_scale is not None else [])
    if given and not args.fp16:     # no effect, as in Megatron: said in one line (loss_scale_note)
        return []
    if dynamic and args.loss_scale is not None:
        return [f"--loss-scale sets a static scale, so {', '.join(dynamic)} (dynamic scaling) would be "
                "unused: give one or the other"]
    return [f"{_flag(n)} must be positive (got {scaling[n]})"
            for n in ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window")
            if scaling[n] is not None and scaling[n] <= 0]


def no_effect_notes(args) -> list[str]:
    """One line each for flags a run accepts, as Megatron does, but never reads (MindSpeed-LLM's recipes pass
    them): loss scaling without --fp16, --vocab-size with a tokenizer that knows its vocabulary, the slow
    tokenizer switch (training reads token ids; `python -m mindspeed.data`, which encodes, refuses it)."""
    notes = []
    given = _loss_scaling(args)
    scaling = [_flag(n) for n in LOSS_SCALE_DEFAULTS if given[n] is not None] + \
        (["--loss-scale"] if args.loss_scale is not None else [])
    if scaling and not args.fp16:
        notes.append(f"> {', '.join(scaling)} has no effect here: loss scaling is for --fp16 (bf16 and fp32 train "
                     "without it)")
    if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer":
        notes.append("> --vocab-size has no effect here: only --tokenizer-type NullTokenizer reads it (this "
                     "tokenizer knows its vocabulary; --padded-vocab-size sets the embedding's rows)")
    if args.tokenizer_not_use_fast:
        notes.append("> --tokenizer-not-use-fast has no effect here: training reads token ids, it encodes no text")
    return notes


def _rampup_problems(args) -> list[str]:
    if args.rampup_batch_size is None:
        return []
    start, increment, samples = args.rampup_batch_size
    gbs, step = args.global_batch_size, args.micro_batch_size * max(args.data_parallel_size, 1)
    if start < 1 or increment < 1 or samples < 0:
        return [f"--rampup-batch-size {start} {increment} {samples}: start and increment must be positive "
                "and the ramp-up samples non-negative"]
    if not start < gbs or (gbs - start) % increment:
        return [f"--rampup-batch-size start {start} must be below --global-batch-size {gbs} and reach it in "
                f"steps of {increment}"]
    if start % step or increment % step:
        return [f"--rampup-batch-size start {start} and increment {increment} must be multiples of "
                f"micro-batch-size x data-parallel size = {step} (every batch of the ramp must split evenly)"]
    return []


def _tokenizer_problems(args) -> list[str]:
    kind = args.tokenizer_type
    if kind is not None and kind not in IMPLEMENTED_TOKENIZERS:
        return [f"--tokenizer-type {kind} is not available in the built-in trainer: use GPT2BPETokenizer "
                "(--vocab-file/--merge-file), NullTokenizer (--vocab-size), HuggingFaceTokenizer "
                "(--tokenizer-model DIR, offline; MindSpeed-LLM's PretrainedFromHF --tokenizer-name-or-path DIR), "
                "Llama2Tokenizer (--tokenizer-model FILE, a SentencePiece model) or CharLevel"]
    if kind == "Llama2Tokenizer":
        model = args.tokenizer_model
        if not model or not os.path.isfile(model):
            return [f"--tokenizer-type Llama2Tokenizer needs --tokenizer-model FILE (a SentencePiece tokenizer.model)"
                    + (f": {model!r} is not a file" if model else "")]
        return [] if args.data_path or args.mock_data else [
            "--tokenizer-type Llama2Tokenizer needs --data-path (or --mock-data): the bundled default dataset is "
            "character-level"]
    problems = hf_tokenizer_problems(args)
    if kind == "GPT2BPETokenizer":
        for flag, path in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if not path:
                problems.append(f"--tokenizer-type GPT2BPETokenizer needs {flag}")
            elif not os.path.isfile(path):
                problems.append(f"{flag} {path!r} does not exist")
    elif args.vocab_file or args.merge_file:
        problems.append("--vocab-file/--merge-file are read only by --tokenizer-type GPT2BPETokenizer "
                        "(give both files, or drop them)")
    if kind == "NullTokenizer" and (args.vocab_size is None or args.vocab_size < 1):
        problems.append("--tokenizer-type NullTokenizer needs --vocab-size N (a positive integer)")
    if kind in ("GPT2BPETokenizer", "NullTokenizer") and not args.data_path and not args.mock_data:
        problems.append(f"--tokenizer-type {kind} needs --data-path (or --mock-data): the bundled default "
                        "dataset is character-level")
    return problems


# --- Hugging Face tokenizer folders, in Megatron's spelling and MindSpeed-LLM's ---------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")     # a Hugging Face Hub name: NAME or ORG/NAME


def resolve_hf_alias(args) -> None:
    """MindSpeed-LLM's --tokenizer-type PretrainedFromHF --tokenizer-name-or-path DIR is Megatron's
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR: rewritten to it here, so that one
    tokenizer (data/tokenizer.py's HuggingFaceTokenizer) and one code path serve both spellings.
    args.tokenizer_type_given keeps what was typed, for the messages; a --tokenizer-model that
    differs from --tokenizer-name-or-path is kept for hf_tokenizer_problems to refuse."""
    args.tokenizer_type_given = args.tokenizer_type
    if args.tokenizer_type == PRETRAINED_FROM_HF:
        args.tokenizer_type = "HuggingFaceTokenizer"
    if args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model is None:
        args.tokenizer_model = args.tokenizer_name_or_path


def hf_tokenizer_problems(args, local_only: bool = True) -> list[str]:
    """The Hugging Face tokenizer flags, either spelling (after resolve_hf_alias). local_only: a
    --tokenizer-model folder must be on this machine too (the built-in trainers load offline;
    Megatron-LM's own HuggingFaceTokenizer may download, so there only MindSpeed-LLM's
    --tokenizer-name-or-path, which MindSpeed-LLM loads offline, is checked)."""
    problems = []
    named, model = args.tokenizer_name_or_path, args.tokenizer_model
    if named and model and named != model:
        return problems + [f"--tokenizer-name-or-path {named} and --tokenizer-model {model} name different "
                           "tokenizers: give one (--tokenizer-name-or-path is MindSpeed-LLM's name for "
                           "--tokenizer-model)"]
    if args.tokenizer_type != "HuggingFaceTokenizer":
        if named:
            problems.append(f"--tokenizer-name-or-path is read only by --tokenizer-type {PRETRAINED_FROM_HF} "
                            f"(Megatron's HuggingFaceTokenizer): add --tokenizer-type {PRETRAINED_FROM_HF}, or drop it")
        return problems
    typed = args.tokenizer_type_given or args.tokenizer_type      # (resolve_hf_alias ran first)
    flag = "--tokenizer-name-or-path" if named or (not model and typed == PRETRAINED_FROM_HF) else "--tokenizer-model"
    if not model:
        problems.append(f"--tokenizer-type {typed} needs {flag} DIR (a Hugging Face tokenizer folder on this machine)")
    elif local_only or named:
        problems.extend(filter(None, [tokenizer_folder_problem(flag, model)]))
    return problems


def tokenizer_folder_problem(flag: str, path: str) -> str | None:
    """None when `path` is a folder with a Hugging Face tokenizer's files (or a Hub name already in
    the local Hugging Face cache), else the one line that says what is wrong."""
    if os.path.isdir(path):
        try:
            names = os.listdir(path)
        except OSError as err:
            return f"{flag} {path!r} cannot be read ({err.strerror or err})"
        if any(n in TOKENIZER_FILES or n.startswith("vocab") or n.endswith((".model", ".tiktoken")) for n in names):
            return None
        return (f"{flag} {path!r} holds no tokenizer files (tokenizer.json, tokenizer_config.json or a vocabulary "
                "file): give the Hugging Face model's folder")
    if os.path.exists(path):
        return f"{flag} {path!r} is a file, not a tokenizer folder: give the folder that holds it"
    if _in_hub_cache(path):
        return None
    return (f"{flag} {path!r} does not exist: give a Hugging Face tokenizer folder on this machine "
            "(tokenizer.json / tokenizer_config.json)")


def _in_hub_cache(name: str) -> bool:
    """A Hub name (ORG/NAME) that Hugging Face's local cache holds: loadable offline."""
    if not HUB_ID.fullmatch(name):
        return False
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:
        return False
    return os.path.isdir(os.path.join(HF_HUB_CACHE, "models--" + name.replace("/", "--")))


def padded_vocab_problems(args) -> list[str]:
    """--padded-vocab-size N (MindSpeed-LLM's; Megatron-LM 0.16's): the embedding and output rows
    instead of the padded vocabulary. N below the tokenizer's vocabulary is refused once the
    tokenizer is read (flag_tokenizers.model_vocab_size)."""
    padded = args.padded_vocab_size
    if padded is None:
        return []
    tp = args.tensor_model_parallel_size or 1
    if padded < 1:
        return [f"--padded-vocab-size must be a positive integer (got {padded})"]
    if padded % tp:
        return [f"--padded-vocab-size {padded} is not divisible by --tensor-model-parallel-size {tp} (each "
                "tensor-parallel rank holds an equal share of the vocabulary rows)"]
    return []
