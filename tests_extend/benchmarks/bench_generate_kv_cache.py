"""Generation speed with and without the KV cache, at the default example's model size.

    python tests_extend/benchmarks/bench_generate_kv_cache.py [--new-tokens 256] [--rounds 3]

One process, fp32, the default example's GPT (4 layers, hidden 128, 4 heads, RMSNorm, SwiGLU,
RoPE, vocabulary 128) with random weights, built by the trainer's model builder; an 8-token prompt
and `--new-tokens` greedy tokens through mindspeed.generate.engine.Generator twice per round: with
Megatron-Core's static inference context (the KV cache: one token per step) and recomputing the
whole prefix every step. Both must give the same tokens (else the run stops). Prints tokens/s of
each (the median over rounds, after one short warm-up generation each), their ratio, and the load average before and after: rerun when it is
above 1. Also the process's CPU time per new token (median) and its ratio: with OMP_NUM_THREADS=1
it moves far less with other jobs' load than tokens/s does (with more threads it counts their
waiting too).
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
    with quiet_frameworks():
        start_processes(args)
        try:
            model = build_model_chunks(args, transformer_config(args))[0].to(args.device_name)
            prompt = torch.randint(0, 128, (8,), generator=torch.Generator().manual_seed(0)).tolist()
            generators = {cached: Generator(model, max_length=length, vocab_size=128, padded_vocab_size=128,
                                            hidden_size=128, params_dtype=torch.float32, device=args.device_name,
                                            use_cache=cached) for cached in (True, False)}
            for gen in generators.values():      # warm-up: first-call allocations and dispatch caches
                gen.generate(prompt, 8, Sampling())
            speeds, cpu_ms = {True: [], False: []}, {True: [], False: []}
            for _ in range(opts.rounds):
                tokens = {}
                for cached, gen in generators.items():
                    cpu_start = time.process_time()
                    result = gen.generate(prompt, opts.new_tokens, Sampling())
                    cpu_ms[cached].append((time.process_time() - cpu_start) * 1000 / len(result.tokens))
                    tokens[cached] = result.tokens
                    speeds[cached].append(result.tokens_per_s)
                if tokens[True] != tokens[False]:
                    print("the KV cache changed the greedy tokens", file=sys.stderr)
                    return 1
        finally:
            stop_processes()
    cached, recomputed = statistics.median(speeds[True]), statistics.median(speeds[False])
    print(f"{opts.new_tokens} new tokens, {torch.get_num_threads()} thread(s): KV cache {cached:.1f} tokens/s, "
          f"recomputed prefix {recomputed:.1f} tokens/s: {cached / recomputed:.2f}x")
    cached_cpu, recomputed_cpu = statistics.median(cpu_ms[True]), statistics.median(cpu_ms[False])
    print(f"CPU time per new token: KV cache {cached_cpu:.2f} ms, recomputed prefix {recomputed_cpu:.2f} ms: "
          f"{recomputed_cpu / cached_cpu:.2f}x")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
