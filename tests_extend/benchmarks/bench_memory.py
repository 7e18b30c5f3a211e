"""Memory features on Megatron-Core (torch backend), each measured off and on in one process:
bytes of activations held for backward (saved-tensor hooks, unique storages, sized after the
forward), parameter bytes, step time, the ratios, and whether the losses are bitwise identical.

    python tests_extend/benchmarks/bench_memory.py [--layers 8 --hidden 1024 --seq 1024 --micro-batch 1]
        [--steps 3] [--only recompute-norm ...]

The first step of each run is warm-up; step time is the median of the others. Off and on runs of a
feature alternate, so machine load hits both alike; the load average is printed. To add a feature,
append a Case to CASES (its own flags on top of `base`, compared with `base` alone).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

FUSED = ("--use-fused-swiglu", "--use-fused-rmsnorm")


@dataclass(frozen=True)
class Case:
    name: str                       # the row's name (a feature id, or a combination)
    flags: tuple                    # what turns the feature on
    base: tuple = ()                # flags both runs share (the "off" run is base alone)
    note: str = ""
    model: dict = field(default_factory=dict)     # model overrides (e.g. bf16) for both runs


CASES = [
    Case("recompute-activation-function", ("--recompute-activation-function",), note="unfused SwiGLU"),
    Case("recompute-activation-function", ("--recompute-activation-function",), FUSED, note="fused SwiGLU"),
    Case("recompute-norm", ("--recompute-norm",), note="unfused RMSNorm"),
    Case("recompute-norm", ("--recompute-norm",), FUSED, note="fused RMSNorm"),
    Case("both", ("--recompute-activation-function", "--recompute-norm"), FUSED, note="fused kernels"),
]


def build(opts, model_overrides):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = dict(num_layers=opts.layers, hidden_size=opts.hidden, num_attention_heads=opts.heads,
               use_cpu_initialization=True, normalization="RMSNorm", gated_linear_unit=True,
               activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
               attention_dropout=0.0)
    cfg.update(model_overrides)
    return GPTModel(TransformerConfig(**cfg), get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=opts.vocab, max_sequence_length=opts.seq, position_embedding_type="rope")


def batch(opts, step):
    import torch
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, opts.vocab, (opts.micro_batch, opts.seq), generator=g)
    causal = torch.triu(torch.ones(opts.seq, opts.seq, dtype=torch.bool), 1)[None, None]
    return tokens, torch.roll(tokens, -1, 1), torch.arange(opts.seq)[None].expand(opts.micro_batch, -1), causal


def measure(flags, opts, model_overrides) -> dict:
    """Train opts.steps SGD steps with `flags` applied; bytes saved for backward in the last step."""
    import torch
    import mindspeed
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from tests_extend.memory_meter import parameter_bytes
    mindspeed.unadapt()
    mindspeed.adapt(list(flags))
    model_parallel_cuda_manual_seed(123)
    model = build(opts, model_overrides)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    losses, times, saved = [], [], 0
    for step in range(opts.steps):
        loss, saved, seconds = sgd_step(model, params, opt, batch(opts, step))
        times.append(seconds)
        losses.append(loss)
    mindspeed.unadapt()
    return dict(saved=saved, params=parameter_bytes(model), losses=losses,
                step_s=statistics.median(times[1:] or times))


def sgd_step(model, params, opt, data, clock=time.perf_counter) -> tuple:
    """One SGD step on `data` (batch()'s tuple): (loss, bytes saved for backward, seconds by `clock`)."""
    from tests_extend.memory_meter import saved_for_backward
    tokens, labels, position_ids, mask = data
    start = clock()
    with saved_for_backward() as meter:
        loss = model(tokens, position_ids, mask, labels=labels).float().mean()
    saved = meter.nbytes(exclude=params)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item(), saved, clock() - start


def mask_census(opts) -> dict:
    """Causal masks saved for backward in one forward: Megatron's fallback softmax builds one per
    layer when no mask is passed (get_default_causal_mask); a mask from the data is one object."""
    import torch
    import mindspeed
    from tests_extend.memory_meter import saved_for_backward
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    mindspeed.unadapt()
    mindspeed.adapt([])
    model_parallel_cuda_manual_seed(123)
    model = build(opts, {})
    tokens, labels, position_ids, mask = batch(opts, 0)
    out = {}
    for name, m in (("no mask passed", None), ("one mask from the data", mask)):
        with saved_for_backward() as meter:
            model(tokens, position_ids, m, labels=labels).float().mean()
        out[name] = (meter.count(torch.bool), meter.nbytes(dtype=torch.bool), meter.nbytes())
    mindspeed.unadapt()
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def init_one_process() -> None:
    """One gloo process with Megatron-Core's process groups, under the cpu device shim."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    import torch
    import mindspeed
    from mindspeed.net import free_port
    from megatron.core import parallel_state
    os.environ["MASTER_PORT"] = str(free_port())
    mindspeed.adapt([])                 # the cpu device shim, so Megatron-Core's process groups come up
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="case names to run")
    parser.add_argument("--no-mask-census", action="store_true")
    opts = parser.parse_args()
    init_one_process()
    print(f"model: {opts.layers} layers, hidden {opts.hidden}, heads {opts.heads}, seq {opts.seq}, "
          f"micro-batch {opts.micro_batch}, vocab {opts.vocab}, fp32, torch/cpu, {opts.steps} steps per run; "
          f"load average at start {os.getloadavg()[0]:.1f}", flush=True)
    print("| feature | with | saved for backward off → on (MiB) | on/off | params (MiB) | step s off → on | "
          "on/off | losses bitwise |")
    print("|---|---|---|---|---|---|---|---|")
    for case in CASES:
        if opts.only and case.name not in opts.only:
            continue
        off = measure(case.base, opts, case.model)
        on = measure(case.base + case.flags, opts, case.model)
        print(f"| {case.name} | {case.note} | {mib(off['saved'])} → {mib(on['saved'])} | "
              f"{on['saved'] / off['saved']:.3f} | {mib(on['params'])} | {off['step_s']:.2f} → {on['step_s']:.2f} | "
              f"{on['step_s'] / off['step_s']:.2f} | {'yes' if on['losses'] == off['losses'] else 'NO'} "
              f"({len(on['losses'])} steps) |", flush=True)
    if not opts.no_mask_census:
        for name, (count, mask_bytes, total) in mask_census(opts).items():
            print(f"causal masks saved for backward, {name}: {count} bool storages, {mib(mask_bytes)} MiB "
                  f"of {mib(total)} MiB saved", flush=True)
    print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
