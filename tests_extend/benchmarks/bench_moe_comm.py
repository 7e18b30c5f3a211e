"""MoE communication flags benchmark (CPU, torch backend, gloo, 2 processes): one Megatron-Core
MoE layer's forward + backward, in one run, with each flag off and on:

- EP=2 (TP 1), alltoall dispatcher: plain, --moe-permutation-async-comm, --moe-alltoall-overlap-comm,
  both; allgather dispatcher: plain, --moe-permutation-async-comm;
- TP=2 (EP 1, sequence parallel): plain (each expert split over TP), --moe-tp-extend-ep (whole
  experts, 2 ranks x experts/2), --moe-tp-extend-ep with --moe-alltoall-overlap-comm.

The flags' patches act on the class, so one layer serves every flag of its layout: each step
adapts the configuration's flags, times one fwd+bwd, unadapts; the configurations of a layout take
turns step by step (the load drifts less between them). Median of --steps steps on rank 0 after a
warm-up; one thread per process. The load average is printed with the figures (shared machine).

    python tests_extend/benchmarks/bench_moe_comm.py [--tokens 4096] [--hidden 512] [--ffn 512]
                                                     [--experts 8] [--steps 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests_extend.distributed.harness import run_distributed  # noqa: E402

EP_CONFIGS = {"alltoall": {"plain": [], "permutation-async": ["--moe-permutation-async-comm"],
                           "alltoall-overlap": ["--moe-alltoall-overlap-comm"],
                           "overlap + async": ["--moe-alltoall-overlap-comm", "--moe-permutation-async-comm"]},
              "allgather": {"plain": [], "permutation-async": ["--moe-permutation-async-comm"]}}
TP_CONFIGS = {"plain": ([], False), "tp-extend-ep": (["--moe-tp-extend-ep"], True),
              "tp-extend-ep + overlap": (["--moe-tp-extend-ep", "--moe-alltoall-overlap-comm"], True)}


def _layer(tp, ep, dispatcher, tokens, hidden, ffn, experts):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=tp > 1,
                            num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=ffn, ffn_hidden_size=ffn,
                            moe_token_dispatcher_type=dispatcher, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, add_bias_linear=False,
                            bias_activation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)
    layer = MoELayer(cfg, get_gpt_layer_local_spec(num_experts=experts).submodules.mlp.submodules)
    x = torch.randn(tokens // tp, 1, hidden, requires_grad=True)

    def step():
        y, _ = layer(x)
        y.backward(torch.ones_like(y))
    return step


def _flags(flags, tp, ep, dispatcher, experts):
    from mindspeed.flags.trainer_flags import parse_args
    return parse_args(flags + ["--mock-data", "--num-experts", str(experts), "--tensor-model-parallel-size", str(tp),
                               "--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type", dispatcher]
                      + (["--sequence-parallel"] if tp > 1 else []))


def _interleaved(steps_by_name, flags_by_name, steps):
    import torch.distributed as dist

    import mindspeed
    times = {k: [] for k in steps_by_name}
    for i in range(steps + 1):
        for name, fn in steps_by_name.items():
            mindspeed.adapt(flags_by_name[name])
            try:
                dist.barrier()
                t = time.perf_counter()
                fn()
                if i:
                    times[name].append(time.perf_counter() - t)
            finally:
                mindspeed.unadapt()
    return {k: statistics.median(v) for k, v in times.items()}


def _body(rank, world_size, tokens, hidden, ffn, experts, steps):
    import torch
    from megatron.core import parallel_state as ps

    import mindspeed
    from mindspeed.features.moe import async_comm
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results = {}
    for dispatcher, configs in EP_CONFIGS.items():
        mindspeed.adapt(_flags([], 1, 2, dispatcher, experts))          # the device shim for building
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(expert_model_parallel_size=2)
        step = _layer(1, 2, dispatcher, tokens, hidden, ffn, experts)
        mindspeed.unadapt()
        async_comm.reset_counts()
        timed = _interleaved({k: step for k in configs},
                             {k: _flags(f, 1, 2, dispatcher, experts) for k, f in configs.items()}, steps)
        results.update({(f"EP=2 {dispatcher}", k): v for k, v in timed.items()})
        results[(f"EP=2 {dispatcher}", "overlapped computations")] = (
            f"{async_comm.COUNTS['overlapped_compute']} forward, {async_comm.COUNTS['bwd_overlapped_compute']} "
            "expert backward")
    for extended in (False, True):
        names = [k for k, (_, ext) in TP_CONFIGS.items() if ext == extended]
        flags = {k: _flags(TP_CONFIGS[k][0], 2, 1, "alltoall", experts) for k in names}
        mindspeed.adapt(flags[names[0]])                                # extended groups when extended
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        step = _layer(2, 1, "alltoall", tokens, hidden, ffn, experts)
        mindspeed.unadapt()
        timed = _interleaved({k: step for k in names}, flags, steps)
        results.update({("TP=2 alltoall", k): v for k, v in timed.items()})
    return results


def run_sized(body, description, argv=None):
    """The layer sizes from the command line, and body(rank, world, tokens, hidden, ffn, experts, steps)'s
    rank-0 result on 2 processes; also the sizes and the load average before the run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per EP rank (the full sequence at TP 2)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    res = run_distributed(body, world_size=2, args=(args.tokens, args.hidden, args.ffn, args.experts, args.steps),
                          timeout=3000)[0]
    return res, args, load_before


def main(argv=None):
    res, args, load_before = run_sized(_body, __doc__.splitlines()[0], argv)
    print(f"MoE layer fwd+bwd, {args.tokens} tokens, hidden {args.hidden}, expert ffn {args.ffn} (SwiGLU), "
          f"{args.experts} experts top-2, fp32, gloo, 1 thread per rank; median of {args.steps} steps (ms)")
    groups = {}
    for (group, label), v in res.items():
        groups.setdefault(group, {})[label] = v
    for group, rows in groups.items():
        base = rows["plain"]
        print(f"\n{group}:")
        for label, t in rows.items():
            if label == "overlapped computations":
                print(f"  ({label} counted: {t})")
            else:
                print(f"  {label:24s} {t * 1e3:9.1f}   x plain {t / base:5.2f}")
    print(f"\nload average before {tuple(round(v, 2) for v in load_before)}, "
          f"after {tuple(round(v, 2) for v in os.getloadavg())} (2 cores)")


if __name__ == "__main__":
    main()
