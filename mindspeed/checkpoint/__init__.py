"""Checkpoints on disk, for both trainers and the converter: Megatron's dist-checkpoint I/O
(`torch_dist`), the framework-neutral safetensors format (`neutral`), the iteration scan both
share (`scan`), resuming one framework from the other's checkpoint (`cross_format`) and the
per-tensor reader the converter streams from (`megatron_read`)."""
