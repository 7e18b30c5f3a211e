"""Hugging Face <-> Megatron-Core checkpoint conversion for Llama-family models (Llama 2/3/3.1, Qwen2/2.5,
Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3: --model-type-hf, see arch).

    python convert_ckpt.py --use-mcore-models --model-type GPT --load-model-type hf --save-model-type mg \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2 --model-type-hf llama2 \
        --load-dir HF_DIR --save-dir MG_DIR

Modules: cli (flags), arch (config.json -> architecture, checks, trainer flags), layout (tensor names
and the fused QKV / SwiGLU layouts, q/k norms, experts, multi-latent attention, MTP layers), hf_io
(safetensors in and out), megatron_write (the trainer's own model, on the meta device, and save path;
optionally the MindSpore trainer's neutral copy),
torch_dist_stream (the save strategy that writes torch_dist one chunk at a time), megatron_read (either
trainer's checkpoint -> whole tensors, one layer at a time), tokenizer_vocab (the embedding rows a
tokenizer needs), staging (atomic --save-dir), sidecar (what the Megatron checkpoint carries for the
way back), hf_to_mg and mg_to_hf (the two directions).
"""
