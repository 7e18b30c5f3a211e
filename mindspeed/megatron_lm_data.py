"""--is-instruction-dataset and --neat-pack, and packed documents, under Megatron-LM's own pretrain_gpt.py.

Megatron-LM's parser has neither flag: they join it with MindSpeed's. With the flag on, the
datasets pretrain_gpt.py asks Megatron-Core's BlendedMegatronDatasetBuilder for are the built-in
trainer's instruction datasets (mindspeed.training.data.InstructionGPTDataset): the same samples,
and a loss mask that is zero on prompt tokens, which Megatron-LM's own loss_func applies. The
builder is patched (not pretrain_gpt.py's provider) because the script binds the class by name.

Packed documents (--reset-attention-mask with flash attention or CP): Megatron-LM's batches carry
no document ends, so they are computed from the tokens (the EOD id of Megatron-LM's tokenizer) when
its get_batch hands the whole sequences to get_batch_on_this_cp_rank, before CP sharding, and
travel as the batch's attention_mask to every attention layer; the dataset then builds no [s, s]
mask. Only where every stage sees the tokens: with PP > 1 the middle stages get no batch
(Megatron's dense mask stays there), and --neat-pack's sample numbers do not pass Megatron-LM's
get_batch (its dense mask stays too).

MindSpeed-LLM's tokenizer flags (--tokenizer-type PretrainedFromHF --tokenizer-name-or-path DIR,
--padded-vocab-size N) join Megatron-LM's parser too, and become Megatron's own HuggingFaceTokenizer
--tokenizer-model DIR and preset padded_vocab_size before its checks (add_tokenizer_args,
tokenizer_problems).
"""
from __future__ import annotations

import os
import sys

from mindspeed.features import documents
from mindspeed.flags import trainer_flags
from mindspeed.flags.checks import (PRETRAINED_FROM_HF, hf_tokenizer_problems, instruction_problems,
                                    padded_vocab_problems, resolve_hf_alias)

BUILD = "megatron.core.datasets.blended_megatron_dataset_builder.BlendedMegatronDatasetBuilder.build"


def add_args(parser) -> None:
    existing = set(parser._option_string_actions)
    donor = trainer_flags.build_parser()     # the built-in trainers' definitions: one help text for both
    group = parser.add_argument_group("MindSpeed instruction data")
    for flag in ("--is-instruction-dataset", "--neat-pack"):
        if flag not in existing:
            action = donor._option_string_actions[flag]
            group.add_argument(flag, action="store_true", help=action.help)


def add_tokenizer_args(parser) -> None:
    """MindSpeed-LLM's tokenizer flags join Megatron-LM's: --tokenizer-type PretrainedFromHF with
    --tokenizer-name-or-path (Megatron's HuggingFaceTokenizer --tokenizer-model, tokenizer_problems),
    --tokenizer-not-use-fast (no effect in training: said in one line) and --padded-vocab-size (Megatron-LM's own from core_v0.16;
    its build_tokenizer keeps a padded_vocab_size that is already set)."""
    existing = set(parser._option_string_actions)
    kind = parser._option_string_actions.get("--tokenizer-type")
    if kind is not None and kind.choices is not None and PRETRAINED_FROM_HF not in kind.choices:
        kind.choices = [*kind.choices, PRETRAINED_FROM_HF]
    donor = trainer_flags.build_parser()._option_string_actions     # one help text with the built-in trainers
    group = parser.add_argument_group("MindSpeed-LLM tokenizer flags")
    if "--tokenizer-name-or-path" not in existing:
        group.add_argument("--tokenizer-name-or-path", default=None, help=donor["--tokenizer-name-or-path"].help)
    if "--tokenizer-not-use-fast" not in existing:
        group.add_argument("--tokenizer-not-use-fast", action="store_true", help=donor["--tokenizer-not-use-fast"].help)
    if "--padded-vocab-size" not in existing:
        group.add_argument("--padded-vocab-size", type=int, default=None, help=donor["--padded-vocab-size"].help)


def tokenizer_problems(args) -> list[str]:
    """Before Megatron's checks: MindSpeed-LLM's spelling becomes Megatron's HuggingFaceTokenizer
    --tokenizer-model DIR (what its build_tokenizer loads), and the flags are checked as the built-in
    trainers check them; a --padded-vocab-size below a tokenizer.json's vocabulary (or NullTokenizer's)
    is refused too (Megatron would build the smaller embedding)."""
    resolve_hf_alias(args)
    if args.tokenizer_not_use_fast and int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.write("> --tokenizer-not-use-fast has no effect here: training reads token ids, it encodes no text\n")
    found = hf_tokenizer_problems(args, local_only=False) + padded_vocab_problems(args)
    padded = args.padded_vocab_size
    if not found and padded is not None:
        vocab = _flag_vocab_size(args)
        if vocab is not None and padded < vocab:
            found.append(f"--padded-vocab-size {padded} is smaller than the tokenizer's vocabulary ({vocab} "
                         f"tokens): give at least {vocab}, or drop it to pad the vocabulary as Megatron does")
    return found


def _flag_vocab_size(args) -> int | None:
    """The vocabulary the flags give without building the tokenizer: NullTokenizer's, or a Hugging
    Face folder's tokenizer.json (as len(tokenizer) counts it); None otherwise."""
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size:
        return args.vocab_size + 1          # Megatron's NullTokenizer adds its end-of-document id
    if args.tokenizer_type == "HuggingFaceTokenizer" and args.tokenizer_model and os.path.isfile(
            os.path.join(args.tokenizer_model, "tokenizer.json")):
        from mindspeed.data.tokenizer_vocab import tokenizer_vocab_size
        from mindspeed.errors import ConvertError
        try:
            return tokenizer_vocab_size(args.tokenizer_model)
        except ConvertError:
            return None                     # Megatron's own tokenizer load reports an unreadable one
    return None


def problems(args) -> list[str]:
    found = instruction_problems(args)
    if not found and args.neat_pack and not args.create_attention_mask_in_dataloader:
        found.append("--neat-pack carries its per-sample attention in the batch's attention mask: "
                     "drop --no-create-attention-mask-in-dataloader")
    cp = (args.context_parallel_size or 1) > 1
    if not found and args.reset_attention_mask and cp \
            and not (documents_possible(args) and args.attention_mask_type != "general"):
        # MindSpeed's CP attention takes the documents' ends, which get_batch gives it only where
        # documents_possible; elsewhere the batches would reach it without them
        found.append("--reset-attention-mask with --context-parallel-size > 1 under Megatron-LM's pretrain_gpt.py "
                     "needs the document ends from the tokens: not with --pipeline-model-parallel-size > 1, "
                     "--neat-pack or --attention-mask-type general; use tests_extend/example/pretrain_gpt.py, "
                     "which keeps attention inside each document there, or --context-parallel-size 1")
    # --sft: Megatron-LM's from core_v0.13 on
    if not found and args.is_instruction_dataset and getattr(args, "sft", False):
        found.append("--is-instruction-dataset and Megatron-LM's --sft read different datasets: give one")
    return found


def documents_possible(args) -> bool:
    """Every stage's get_batch sees the tokens (PP 1) and the documents are EOD-separated."""
    return (args.pipeline_model_parallel_size or 1) == 1 and not args.neat_pack


def install_documents(ctx) -> None:
    """At import (before pretrain_gpt.py runs): Session.packed_documents consults this host's limit."""
    ctx.provide("documents_possible", documents_possible)


def after_plan(args, session) -> None:
    """Once the plan is applied: with documents on, Megatron-LM's dataset builds no [s, s] mask."""
    if session.packed_documents(args):
        args.create_attention_mask_in_dataloader = False


def publish_documents(batch: dict, session) -> None:
    """Megatron-LM's get_batch, whole sequences in hand: each sample's document ends, from its EOD
    tokens, become the batch's attention_mask (features/documents.py; Megatron-LM built no mask)."""
    from megatron.training import get_args, get_tokenizer
    tokens = batch.get("tokens")
    if tokens is not None and session.packed_documents(get_args()):
        from mindspeed.training.data import documents_mask  # Megatron-Core: megatron_lm loads us first
        eod = get_tokenizer().eod
        batch["attention_mask"] = documents_mask([documents.ends_from_eod(row, eod) for row in tokens])


def _instruction_build(session):
    """Megatron-Core's dataset builder returning MindSpeed's instruction datasets (their masks as the
    session's packed-documents rule says)."""
    return lambda original: _build_instructions(original, session)


def _build_instructions(original, session):
    def build(self):
        from megatron.training import get_args
        args = get_args()
        if not args.is_instruction_dataset:
            return original(self)
        if not self.is_built_on_rank():
            return [None, None, None]
        from mindspeed.training.data import build_instruction_datasets  # Megatron-Core: megatron_lm loads us first
        return list(build_instruction_datasets(args, self.config.tokenizer, [s or 0 for s in self.sizes],
                                               session.packed_documents(args)))
    return build


def install(session) -> None:
    session.patcher.wrap(BUILD, _instruction_build(session),
                 reason="--is-instruction-dataset: MindSpeed's instruction samples and prompt loss mask")
