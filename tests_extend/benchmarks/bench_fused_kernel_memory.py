"""The fused kernels' memory against upstream MindSpeed's published figures (fused SwiGLU -16.6 %,
fused RMSNorm -12 % memory in a Llama2-7B run): one Llama2-7B-shaped layer (hidden 4096, ffn 11008,
32 heads, RoPE, RMSNorm, SwiGLU, bf16) runs forward and backward once per variant, each variant in
its own process so that its peak resident set is its own.

    nice -n 19 python tests_extend/benchmarks/bench_fused_kernel_memory.py [--seq 4096 --micro-batch 1]
        [--only fused-swiglu ...]

Printed per variant: bytes autograd holds for backward after the forward (saved-tensor hooks, one
count per storage, parameters excluded), the process's peak resident set (VmHWM) and its growth
over the resident set before the forward (activations + gradients + temporaries), and each
kernel's ratio to the unfused run. Upstream's figures are of a whole 7B training run's device
memory (weights and optimizer states included), so they bound what one layer's activations show
only loosely: the row prints both. Not a test: minutes per variant on a CPU without bf16 units.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

# (name, flags, upstream's published memory change in a Llama2-7B run, or None)
VARIANTS = [
    ("unfused", (), None),
    ("fused-swiglu", ("--use-fused-swiglu",), -0.166),
    ("fused-rmsnorm", ("--use-fused-rmsnorm",), -0.12),
    ("flash-attn", ("--use-flash-attn",), None),
    ("fused-rope", ("--use-fused-rotary-pos-emb",), None),
]


def measure(flags, opts) -> dict:
    """In this (fresh) process: build the layer with `flags`, one forward + backward."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    import torch
    import mindspeed
    from mindspeed.net import free_port
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from tests_extend.benchmarks.bench_memory import batch, build
    from tests_extend.memory_meter import saved_for_backward
    # VmHWM, not ru_maxrss: Linux carries the spawning process's peak into ru_maxrss across exec
    from tests_extend.unit.convert_memory_worker import status_bytes
    os.environ["MASTER_PORT"] = str(free_port())
    mindspeed.adapt(list(flags))
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(123)
    model = build(opts, dict(ffn_hidden_size=opts.ffn, bf16=True, params_dtype=torch.bfloat16))
    params = list(model.parameters())
    tokens, labels, position_ids, mask = batch(opts, 0)
    before = status_bytes("VmRSS")
    with saved_for_backward() as meter:
        loss = model(tokens, position_ids, mask, labels=labels).float().mean()
    saved = meter.nbytes(exclude=params)
    loss.backward()
    peak = status_bytes("VmHWM")
    torch.distributed.destroy_process_group()
    return dict(saved=saved, peak=peak, growth=peak - before, loss=loss.item())


def _run_variant(flags, argv) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(list(flags)), *argv]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=128, help="small: the layer's memory is what is compared")
    parser.add_argument("--only", nargs="*", help="variant names besides 'unfused'")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    opts.layers = 1
    if opts.worker is not None:
        print(json.dumps(measure(json.loads(opts.worker), opts)), flush=True)
        return
    argv = sys.argv[1:]     # the worker ignores --only
    print(f"one Llama2-7B-shaped layer: hidden {opts.hidden}, ffn {opts.ffn}, heads {opts.heads}, seq {opts.seq}, "
          f"micro-batch {opts.micro_batch}, bf16, torch/cpu, forward + backward once per variant, one process "
          f"each; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    print("| variant | saved for backward (GiB) | ratio | peak RSS (GiB) | peak growth in fwd+bwd (GiB) | ratio | "
          "upstream (7B run) |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for name, flags, upstream in VARIANTS:
        if opts.only and name != "unfused" and name not in opts.only:
            continue
        r = _run_variant(flags, argv)
        base = base or r
        print(f"| {name} | {_gib(r['saved'])} | {r['saved'] / base['saved']:.3f} | {_gib(r['peak'])} | "
              f"{_gib(r['growth'])} | {r['growth'] / base['growth']:.3f} | "
              f"{'-' if upstream is None else f'{1 + upstream:.3f} ({upstream:+.1%})'} |", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
