"""Generation and chat on a checkpoint of either trainer or of the converter
(`python -m mindspeed.generate`): Megatron-Core's GPTModel with its static inference context (KV
cache), rebuilt from the checkpoint's run_flags.json or convert_info.json. See
docs/generate-and-evaluate.md."""
