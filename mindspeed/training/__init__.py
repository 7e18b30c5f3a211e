"""GPT pretraining on Megatron-Core (torch) and the shared command line."""
