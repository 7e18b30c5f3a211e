"""Generation speed with and without the KV cache, at the default example's model size.

    python tests_extend/benchmarks/bench_generate_kv_cache.py [--new-tokens 256] [--rounds 3]

One process, fp32, the default example's GPT (4 layers, hidden 128, 4 heads, RMSNorm, SwiGLU,
RoPE, vocabulary 128) with random weights, built by the trainer's model builder; an 8-token prompt
and `--new-tokens` greedy tokens through mindspeed.generate.engine.Generator four ways per round:
each of its two paths (the lean decoder, the default; Megatron-Core's GPTInferenceWrapper with its
static inference context) with the KV cache (one token per step) and recomputing the whole prefix
every step. All four must give the same tokens (else the run stops). Prints, per path, tokens/s
with and without the cache (medians over rounds, after one short warm-up generation each) and
their ratio, and the load average before and after: rerun when it is above 1. Also the process's
CPU time per new token (median) and its ratio: with OMP_NUM_THREADS=1 it moves far less with other
jobs' load than tokens/s does (with more threads it counts their waiting too).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import mindspeed  # noqa: E402
from mindspeed.flags.trainer_flags import parse_args  # noqa: E402
from mindspeed.generate.engine import Generator, Sampling  # noqa: E402
from mindspeed.generate.loading import quiet_frameworks, start_processes, stop_processes  # noqa: E402
from mindspeed.training.model import build_model_chunks, transformer_config  # noqa: E402

EXAMPLE = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--normalization", "RMSNorm",
           "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear", "--mock-data"]
PATHS = {"lean": "lean decoder (the default)", "megatron": "Megatron-Core's inference path"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    opts = p.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    length = 8 + opts.new_tokens
    args = parse_args(EXAMPLE + ["--seq-length", str(length), "--backend", "torch"], world_size=1)
    args.padded_vocab_size = args.vocab_size = 128
    args.device_name = mindspeed.adapt(["--optimization-level", "0"]).plan.device
    ways = [(path, cached) for path in PATHS for cached in (True, False)]
    with quiet_frameworks():
        start_processes(args)
        try:
            model = build_model_chunks(args, transformer_config(args))[0].to(args.device_name)
            prompt = torch.randint(0, 128, (8,), generator=torch.Generator().manual_seed(0)).tolist()
            generators = {(path, cached): Generator(
                model, max_length=length, vocab_size=128, padded_vocab_size=128, hidden_size=128,
                params_dtype=torch.float32, device=args.device_name, use_cache=cached, lean=path == "lean")
                for path, cached in ways}
            for gen in generators.values():      # warm-up: first-call allocations and dispatch caches
                gen.generate(prompt, 8, Sampling())
            speeds, cpu_ms = {way: [] for way in ways}, {way: [] for way in ways}
            for _ in range(opts.rounds):
                tokens = {}
                for way, gen in generators.items():
                    cpu_start = time.process_time()
                    result = gen.generate(prompt, opts.new_tokens, Sampling())
                    cpu_ms[way].append((time.process_time() - cpu_start) * 1000 / len(result.tokens))
                    tokens[way] = result.tokens
                    speeds[way].append(result.tokens_per_s)
                if len({tuple(t) for t in tokens.values()}) != 1:
                    print("the four ways gave different greedy tokens", file=sys.stderr)
                    return 1
        finally:
            stop_processes()
    print(f"{opts.new_tokens} new tokens, {torch.get_num_threads()} thread(s); medians of {opts.rounds} rounds")
    for path, what in PATHS.items():
        cached, recomputed = (statistics.median(speeds[path, c]) for c in (True, False))
        cached_cpu, recomputed_cpu = (statistics.median(cpu_ms[path, c]) for c in (True, False))
        print(f"{what}: KV cache {cached:.1f} tokens/s, recomputed prefix {recomputed:.1f} tokens/s: "
              f"{cached / recomputed:.2f}x; CPU ms per new token {cached_cpu:.2f} / {recomputed_cpu:.2f}: "
              f"{recomputed_cpu / cached_cpu:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
