"""Workers for test_lean_decoder: the trainer's GPT in each layout, its logits from Megatron-Core's
own forward against the lean decoder's (cached steps and recomputed prefixes), and the
generator's greedy tokens by both paths."""
from __future__ import annotations

import torch

LAYOUTS = {
    "llama": ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
              "--disable-bias-linear", "--untie-embeddings-and-output-weights"],
    "gpt2": ["--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute", "--add-bias-linear"],
    # grouped queries, q/k/v biases, tied output, RoPE on half of each head
    "qwen2": ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
              "--disable-bias-linear", "--add-qkv-bias", "--group-query-attention", "--num-query-groups", "2",
              "--rotary-percent", "0.5"],
}
PROMPT = [3, 17, 99, 4, 55, 21, 8, 100]
MAX_LENGTH, VOCAB = 48, 128


def build(layout: str, tp: int, extra=()):
    import mindspeed
    from megatron.core import tensor_parallel
    from mindspeed.flags.trainer_flags import parse_args
    from mindspeed.training.model import build_model_chunks, transformer_config
    from tests_extend import megatron_tiny
    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data",
                       "--seq-length", str(MAX_LENGTH), "--backend", "torch", "--tensor-model-parallel-size",
                       str(tp), *LAYOUTS[layout], *extra], world_size=tp)
    args.padded_vocab_size = args.vocab_size = VOCAB
    mindspeed.unadapt()
    device = mindspeed.adapt(["--optimization-level", "0"]).plan.device
    megatron_tiny.init_parallel(tp=tp, seed=7)
    model = build_model_chunks(args, transformer_config(args))[0].to(device)
    g = torch.Generator().manual_seed(11 + torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():         # far from the initialisation: the logits tell layers apart
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    return model.eval(), device


def _decoder(model):
    from megatron.core import parallel_state
    from mindspeed.generate.lean_decoder import LeanDecoder
    return LeanDecoder(model, MAX_LENGTH, parallel_state.get_tensor_model_parallel_group(),
                       parallel_state.get_tensor_model_parallel_world_size())


def logits_against_megatron(rank, world_size, layout: str):
    """The largest difference between Megatron's forward logits at every position after the
    prompt and the lean decoder's (cached steps; a recomputed prefix), and the logits' scale."""
    from mindspeed.generate.lean_decoder import unsupported
    model, _ = build(layout, world_size)
    assert unsupported(model) is None, unsupported(model)
    tokens = torch.tensor([PROMPT + [(7 * i) % VOCAB for i in range(24)]])
    n = tokens.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).triu(1).view(1, 1, n, n)
    with torch.inference_mode():
        ref = model(tokens, torch.arange(n).unsqueeze(0), causal, runtime_gather_output=True)[0, len(PROMPT) - 1:]
        lean = _decoder(model)
        steps = [lean.logits(tokens[:, :len(PROMPT)], 0)]
        steps += [lean.logits(tokens[:, i:i + 1], i) for i in range(len(PROMPT), n)]
        cached = torch.cat(steps)
        recomputed = torch.cat([lean.logits(tokens[:, :i], 0, cache=False) for i in range(len(PROMPT), n + 1)])
    return {"cached": (cached - ref).abs().max().item(), "recomputed": (recomputed - ref).abs().max().item(),
            "scale": ref.abs().max().item(), "vocab": ref.shape[-1]}


def tokens_by_each_path(rank, world_size, layout: str):
    """Greedy tokens of the generator on the lean path and on Megatron-Core's, with and without
    the cache; which path each generator took."""
    from mindspeed.generate.engine import Generator, Sampling
    model, device = build(layout, world_size)
    out = {}
    for lean in (True, False):
        for cache in (True, False):
            gen = Generator(model, max_length=MAX_LENGTH, vocab_size=VOCAB, padded_vocab_size=VOCAB, hidden_size=64,
                            params_dtype=torch.float32, device=device, use_cache=cache, lean=lean)
            out[f"lean={lean} cache={cache}"] = (gen.lean is not None, gen.generate(PROMPT, 32, Sampling()).tokens)
    return out


def refusals(rank, world_size):
    """unsupported()'s reasons for models the lean decoder leaves to Megatron-Core."""
    from mindspeed.generate.lean_decoder import unsupported
    bf16, _ = build("llama", 1, ["--bf16"])
    moe, _ = build("llama", 1, ["--num-experts", "2", "--moe-router-topk", "2"])
    return {"bf16": unsupported(bf16), "moe": unsupported(moe)}
