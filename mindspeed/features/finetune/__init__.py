"""Fine-tuning features: LoRA adapters (lora.py; the Megatron-Core hook is lora_megatron.py)."""
