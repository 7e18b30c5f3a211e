"""--is-instruction-dataset and --neat-pack under Megatron-LM's own pretrain_gpt.py.

Megatron-LM's parser has neither flag: they join it with MindSpeed's. With the flag on, the
datasets pretrain_gpt.py asks Megatron-Core's BlendedMegatronDatasetBuilder for are the built-in
trainer's instruction datasets (mindspeed.training.data.InstructionGPTDataset): the same samples,
and a loss mask that is zero on prompt tokens, which Megatron-LM's own loss_func applies. The
builder is patched (not pretrain_gpt.py's provider) because the script binds the class by name.
"""
from __future__ import annotations

BUILD = "megatron.core.datasets.blended_megatron_dataset_builder.BlendedMegatronDatasetBuilder.build"


def add_args(parser) -> None:
    from mindspeed.training import arguments
    existing = set(parser._option_string_actions)
    donor = arguments.build_parser()     # the built-in trainers' definitions: one help text for both
    group = parser.add_argument_group("MindSpeed instruction data")
    for flag in ("--is-instruction-dataset", "--neat-pack"):
        if flag not in existing:
            action = donor._option_string_actions[flag]
            group.add_argument(flag, action="store_true", help=action.help)


def problems(args) -> list[str]:
    from mindspeed.training.flag_checks import _instruction_problems
    found = _instruction_problems(args)
    if not found and getattr(args, "neat_pack", False) and not getattr(args, "create_attention_mask_in_dataloader",
                                                                       True):
        found.append("--neat-pack carries its per-sample attention in the batch's attention mask: "
                     "drop --no-create-attention-mask-in-dataloader")
    if not found and getattr(args, "reset_attention_mask", False) and (getattr(args, "context_parallel_size", 1) or 1) > 1:
        # MindSpeed's CP attention takes the documents' ends, which only the built-in trainer's
        # get_batch computes; Megatron-LM's batches would reach it without them
        found.append("--reset-attention-mask with --context-parallel-size > 1 is not supported under "
                     "Megatron-LM's pretrain_gpt.py (its batches carry no document ends for MindSpeed's CP "
                     "attention); use tests_extend/example/pretrain_gpt.py, which keeps attention inside "
                     "each document with CP, or --context-parallel-size 1")
    if not found and getattr(args, "is_instruction_dataset", False) and getattr(args, "sft", False):
        found.append("--is-instruction-dataset and Megatron-LM's --sft read different datasets: give one")
    return found


def _instruction_build(original):
    def build(self):
        from megatron.training import get_args
        args = get_args()
        if not getattr(args, "is_instruction_dataset", False):
            return original(self)
        if not self.is_built_on_rank():
            return [None, None, None]
        from mindspeed.training.data import build_instruction_datasets
        return list(build_instruction_datasets(args, self.config.tokenizer, [s or 0 for s in self.sizes]))
    return build


def install(patcher) -> None:
    patcher.wrap(BUILD, _instruction_build,
                 reason="--is-instruction-dataset: MindSpeed's instruction samples and prompt loss mask")
