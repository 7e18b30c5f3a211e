"""Tiny Hugging Face Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral models built locally (no download) and the built-in trainer's
model loading a converted checkpoint, for the checkpoint-conversion tests."""
from __future__ import annotations

import contextlib
import io
import json
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # every model here is built locally

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 128, 64, 96, 4, 2, 4


# make_hf_model's kinds: transformers' config and model classes
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
              "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
              "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}


def make_hf_model(out_dir: str, kind: str = "llama", tied: bool = False, seed: int = 0,
                  dtype: torch.dtype = torch.float32, max_shard_size: str | None = None, **overrides) -> None:
    """A random tiny model saved with save_pretrained (safetensors), built from transformers' own
    config class of `kind` (HF_CLASSES). Norm weights (q/k norms too) and q/k/v biases are randomised
    too, so a conversion that drops or swaps them changes the logits."""
    import transformers
    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[kind])
    fields = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=tied,
                  rms_norm_eps=1e-5, max_position_embeddings=64,
                  rope_theta=500000.0 if kind == "llama" else 1000000.0)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_(1 + 0.5 * torch.randn_like(param) if name.endswith("norm.weight")
                            else 0.5 * torch.randn_like(param))
            else:
                param.normal_(0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):      # DeepSeek-V3's routing bias
                buffer.copy_(0.1 * torch.randn_like(buffer))
    shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(out_dir, safe_serialization=True, **shards)


def add_mtp_layer(hf_dir: str, layers: int = LAYERS, hidden: int = HIDDEN) -> None:
    """DeepSeek-V3's MTP layer as its checkpoints hold it (model.layers.<num_hidden_layers>: a decoder layer,
    enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and the output head), random."""
    from safetensors.torch import save_file
    tensors = read_safetensors(hf_dir)
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    g = torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.startswith(last)]:
        tensors[mtp + name[len(last):]] = tensors[name] + 0.05 * torch.randn(tensors[name].shape, generator=g)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{norm}.weight"] = 1 + 0.5 * torch.randn(hidden, generator=g)
    tensors[mtp + "eh_proj.weight"] = 0.2 * torch.randn(hidden, 2 * hidden, generator=g)
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})


def write_tokenizer_json(path: str, size: int) -> None:
    """A word-level tokenizer.json of `size` tokens, the last one an added end-of-text token."""
    vocab = {f"w{i}": i for i in range(size - 1)}
    added = [{"id": size - 1, "content": "<eos>", "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": {"type": "Whitespace"},
                   "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}}, f)


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def convert(*argv: str) -> None:
    """The converter's command line, in this process (output kept quiet)."""
    from mindspeed.convert.cli import main
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(argv))
    assert rc == 0, f"convert_ckpt.py {' '.join(argv)} exited {rc}"


def read_safetensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from mindspeed.convert.hf_io import HFReader
    reader = HFReader(hf_dir)
    try:
        return {name: reader.get(name) for name in sorted(reader.names())}
    finally:
        reader.close()


def trainer_args(mg_dir: str, tp: int = 1, pp: int = 1, world_size: int = 1, extra=(), fp32: bool = False,
                 drop=()):
    """The trainer's own argument parsing for the converted model, as convert_info.json says, less the
    flags in `drop`; with `fp32` the model computes in fp32 whatever dtype the checkpoint stores (the
    loader casts), so its logits compare with Hugging Face's fp32 ones."""
    from mindspeed.convert.sidecar import read_info
    from mindspeed.flags.trainer_flags import parse_args
    info = read_info(mg_dir)
    flags = [f for f in info["trainer_flags"] if not (fp32 and f in ("--bf16", "--fp16")) and f not in drop]
    if pp == 1 and "--decoder-first-pipeline-num-layers" in flags:   # the converted split is for PP > 1
        at = flags.index("--decoder-first-pipeline-num-layers")
        del flags[at:at + 4]
    for name, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp)):
        flags[flags.index(name) + 1] = str(value)
    args = parse_args(flags + ["--load", mg_dir, "--finetune", "--mock-data", "--tokenizer-type", "NullTokenizer",
                               "--vocab-size", str(info["vocab_size"] - 1), "--seq-length", "16",
                               "--backend", "torch", "--device", "cpu", *extra], world_size=world_size)
    from mindspeed.flags.trainer_flags import padded_vocab_size
    args.padded_vocab_size = padded_vocab_size(info["vocab_size"], args.make_vocab_size_divisible_by, tp)
    return args


def load_trainer_model(args):
    """The trainer's model at this rank, loaded by the trainer's checkpointing (--finetune)."""
    from mindspeed.checkpoint import torch_dist as checkpointing
    from mindspeed.training.model import build_model_chunks, transformer_config
    chunks = build_model_chunks(args, transformer_config(args))
    checkpointing.load_checkpoint(args.load, chunks, None, None, finetune=True)
    for chunk in chunks:
        chunk.eval()
    return chunks[0]


def tp1_logits(mg_dir: str, tokens: torch.Tensor, extra=(), fp32: bool = False) -> torch.Tensor:
    """[b, s, V] logits of the trainer's model loaded at TP1 x PP1 in this process."""
    from mindspeed.convert.megatron_write import adapted, world_of_one
    args = trainer_args(mg_dir, extra=extra, fp32=fp32)
    with adapted(args), world_of_one():
        return stage_forward(load_trainer_model(args), tokens)


def stage_forward(model, tokens: torch.Tensor, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
    """One pipeline stage: hidden states [s, b, h] out of a non-last stage, TP-local logits
    [b, s, V/tp] out of the last one."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    if hidden_in is not None:
        model.set_input_tensor(hidden_in)
    with torch.no_grad():
        return model(tokens, positions, None)


def ms_load(mg_dir: str, backend, tp: int = 1, world_size: int = 1, train: bool = False, seq_length: int = 16,
            extra=()):
    """The MindSpore trainer's GPT (in a Trainer, with Adam, when `train`) for a converted checkpoint
    at TP `tp`, loaded by the MindSpore trainer's own loader with its defaults (optimizer state
    wanted): the neutral copy when the directory has one, else the torch_dist files."""
    from mindspeed.training.mindspore import checkpoint as ms_checkpoint
    from mindspeed.training.mindspore.model import GPTConfig, GPTModel
    from mindspeed.training.mindspore.parallel import build_parallel_state
    from mindspeed.training.mindspore.trainer import Trainer
    # Adam's eps far above the gradients' rounding noise: an element whose gradient is noise moves by
    # about lr * g / eps, not by +-lr whichever way the noise fell, so TP layouts agree on every element
    args = trainer_args(mg_dir, tp=tp, world_size=world_size, extra=("--lr", "0.01", "--lr-decay-style", "constant",
                                                                           "--adam-eps", "1e-3",
                                                                           "--seq-length", str(seq_length), *extra))
    ps = build_parallel_state(backend.comm, tp)
    cfg = GPTConfig.from_args(args, args.padded_vocab_size, [])
    trainer = Trainer(args, backend, ps, cfg) if train else None
    model = trainer.model if train else GPTModel(cfg, backend, ps)
    ms_checkpoint.load(mg_dir, model, trainer.optimizer if train else None)
    return trainer or model


def ms_logits(model, tokens) -> "np.ndarray":
    """[b, s, V] logits of the MindSpore GPT (TP shards gathered)."""
    import mindspore as ms
    import numpy as np
    local = model.logits(ms.Tensor(np.asarray(tokens, np.int32)))            # [s, b, V/tp]
    if model.ps.tp_size > 1:
        every = model.backend.comm.all_gather(local.expand_dims(0), 0, model.ps.tp_group).asnumpy()
        local = np.concatenate(list(every), axis=-1)
    else:
        local = local.asnumpy()
    return local.transpose(1, 0, 2)


def ms_train_steps(trainer, tokens, steps: int = 2) -> tuple[list, "np.ndarray"]:
    """Adam steps on `tokens` (next-token loss) -> (losses, layer 0's whole q/k/v bias before and after)."""
    import numpy as np
    from mindspeed.training.mindspore.checkpoint import _gather_tp
    tokens = np.asarray(tokens, np.int32)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": np.ones_like(tokens[:, 1:], np.float32)}
    name = "decoder.layers.0.self_attention.linear_qkv.bias"
    whole = lambda: _gather_tp(trainer.backend, trainer.ps, {name: trainer.model.params[name].asnumpy().copy()})[name]
    before = whole()
    losses = [trainer.train_step([batch], it + 1)[0] for it in range(steps)]
    return losses, np.stack([before, whole()])


def write_plain_llama(out_dir: str, hidden: int, layers: int, ffn: int, vocab: int, heads: int = 8) -> int:
    """A Llama config.json and model.safetensors written straight from tensors (no transformers
    model: quick at a few hundred MB), tensor k filled with the value k; returns the weights' bytes."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=hidden, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=256,
                  hidden_act="silu", torch_dtype="float32")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    from mindspeed.convert.arch import arch_from_config
    from mindspeed.convert.layout import hf_shapes
    shapes = hf_shapes(arch_from_config(config, "llama2", add_qkv_bias=False))
    tensors = {name: torch.full(shape, float(k)) for k, (name, shape) in enumerate(shapes.items())}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return sum(t.numel() * t.element_size() for t in tensors.values())
