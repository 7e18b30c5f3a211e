"""Memory the swap features move off the device, and what it costs in step time, on the torch
trainer (Megatron-Core GPT, Megatron's optimizers, mock data), each feature off and on in one
process, interleaved so machine load hits both alike.

    python tests_extend/benchmarks/bench_memory_swap.py [--layers 8 --hidden 1024 --seq 1024 --mbs 1 --steps 2]

One function per feature returns a dict row (merged into bench_memory.py's table later):
  swap_attention_row   activation bytes saved for backward on the device side, off vs on, and the
                       bytes the swap holds on the host after forward (memory layer's ledger)
  swap_optimizer_row   optimizer-state bytes (fp32 master + Adam moments, --bf16) on the device side
                       between updates, off vs on, the most resident during the chunked update, host bytes
  reuse_fp32_param_row  bytes of the model's parameters + fp32 masters (--bf16), off vs on, per bf16
                       parameter and per transformer layer
  reuse_fp32_param_distributed_row  the same with --use-distributed-optimizer at DP=2 (two processes):
                       one rank's bf16 parameter buffer + fp32 master shard (+ residual shard)
On a CPU "device" and "host" are the same RAM: the figures are the bytes each side holds, counted
from tensor storages and the ledger (every swap is a real copy), not an allocator's peak.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

MiB = 2 ** 20


def _base(a) -> list[str]:
    heads = max(1, a.hidden // 64)
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size", str(a.mbs),
            "--global-batch-size", str(a.mbs), "--train-iters", str(4 * a.steps + 8), "--lr", "1e-4",
            "--mock-data", "--tensor-model-parallel-size", "1", "--seed", "1234"]


class _Tok:
    vocab_size = 128
    eod = 0
    unique_identifiers = {"class": "mock"}


def _trainer(base, flags):
    from tests_extend.unit.swap_workers import trainer_for     # the tests' set-up, at this size
    return trainer_for(flags, base, vocab_size=_Tok.vocab_size)


_DATA = {}


def _iterator(args, tr):
    from mindspeed.training import data
    key = (args.seq_length, args.global_batch_size)
    if key not in _DATA:
        _DATA[key] = data.build_datasets(args, _Tok())[0]
    return tr.iterators(_DATA[key], 0)


def _ledger():
    from mindspeed.backends import get_backend
    return get_backend().memory.ledger


def _step_times(args, tr, steps: int) -> list[float]:
    it = _iterator(args, tr)
    tr.train_step(it)                      # warm-up (first-step allocations, lazy optimizer state)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        tr.train_step(it)
        times.append(time.perf_counter() - start)
    return times


def _saved_bytes(args, tr) -> tuple[int, int]:
    """(activation bytes saved for backward on the device side, bytes the swap holds on the host)
    for one micro-batch's forward; then its backward."""
    import torch
    from mindspeed.training.data import get_batch
    seen, total = set(), [0]

    def pack(t):
        if not (t.requires_grad and t.is_leaf) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total[0] += t.untyped_storage().nbytes()
        return t
    batch = get_batch(_iterator(args, tr), "cpu")
    host0 = _ledger().held["host"]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = tr.model[0](batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    host = _ledger().held["host"] - host0
    out.float().mean().backward()
    for chunk in tr.model:
        chunk.zero_grad_buffer()
    return total[0], host


def _state_device_bytes(tr) -> tuple[int, int]:
    """(optimizer-state bytes holding device storage now, parameters): fp32 masters (not the model's
    own parameters) and every per-parameter state tensor."""
    from mindspeed.features.memory.swap_optimizer_megatron import MASTERS
    total, params = 0, 0
    for opt in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]):
        kind = next((k for k in MASTERS if any(c.__name__ == k for c in type(opt).__mro__)), None)
        masters = {id(p) for g in getattr(opt, MASTERS[kind], []) for p in g} if kind else set()
        for g in opt.optimizer.param_groups:
            for p in g["params"]:
                params += p.numel()
                total += p.untyped_storage().nbytes() if id(p) in masters else 0
                total += sum(v.untyped_storage().nbytes() for v in opt.optimizer.state.get(p, {}).values()
                             if hasattr(v, "shape") and tuple(v.shape) == tuple(p.shape))
    return total, params


def _timing(row: dict, off: list[float], on: list[float]) -> dict:
    row.update(step_s_off=statistics.median(off), step_s_on=statistics.median(on))
    row["time_ratio_on_off"] = row["step_s_on"] / row["step_s_off"]
    return row


def swap_attention_row(a) -> dict:
    base = _base(a)
    res, times = {}, {"off": [], "on": []}
    for name, flags in (("off", []), ("on", ["--swap-attention"])):
        args, tr = _trainer(base, flags)
        res[name] = _saved_bytes(args, tr)
        times[name] = _step_times(args, tr, a.steps)
    moved = res["on"][1]
    row = {"feature": "swap-attention", "device_bytes_off": res["off"][0], "device_bytes_on": res["on"][0],
           "host_bytes_on": moved, "device_ratio_on_off": res["on"][0] / res["off"][0],
           "host_bytes_per_layer": moved / a.layers, "what": "activations saved for backward, one micro-batch"}
    return _timing(row, times["off"], times["on"])


def swap_optimizer_row(a) -> dict:
    base = _base(a) + ["--bf16"]
    res, times = {}, {}
    for name, flags in (("off", []), ("on", ["--swap-optimizer", "--swap-optimizer-times", str(a.times)])):
        args, tr = _trainer(base, flags)
        led_host0 = 0                       # a fresh backend per trainer: its ledger is this one's
        times[name] = _step_times(args, tr, a.steps)
        dev, params = _state_device_bytes(tr)
        swaps = [getattr(o, "mindspeed_swap", None) for o in getattr(tr.optimizer, "chained_optimizers",
                                                                     [tr.optimizer])]
        layer = sum(p.numel() for p in tr.model[0].module.decoder.layers[0].parameters())
        res[name] = dict(device=dev, params=params, host=_ledger().held["host"] - led_host0, layer=layer,
                         peak=max(s.device_peak for s in swaps) if all(swaps) else dev)
    off, on = res["off"], res["on"]
    row = {"feature": "swap-optimizer", "device_bytes_off": off["device"], "device_bytes_on": on["device"],
           "host_bytes_on": on["host"], "device_peak_during_update_on": on["peak"],
           "bytes_per_param_device_off": off["device"] / off["params"],
           "bytes_per_param_device_on": on["device"] / on["params"],
           "bytes_per_param_host_on": on["host"] / on["params"],
           "host_bytes_per_layer": on["host"] / on["params"] * on["layer"],
           "what": f"bf16 optimizer states between updates (--swap-optimizer-times {a.times})"}
    return _timing(row, times["off"], times["on"])


def reuse_fp32_param_row(a) -> dict:
    """Bytes of the model's parameters plus the optimizer's fp32 masters (--bf16, Megatron's Float16
    optimizer), each storage once, off and on; per bf16 parameter and per transformer layer."""
    import torch
    from mindspeed.features.memory.reuse_fp32_param_megatron import parameter_and_master_bytes
    base = _base(a) + ["--bf16"]
    res, times = {}, {}
    for name, flags in (("off", []), ("on", ["--reuse-fp32-param"])):
        args, tr = _trainer(base, flags)
        times[name] = _step_times(args, tr, a.steps)
        total, bf16, params = parameter_and_master_bytes(tr.model, tr.optimizer)
        per_bf16 = (total - 4 * (params - bf16)) / bf16      # the norms' weights: fp32 parameters, no master
        layer = list(tr.model[0].module.decoder.layers[0].parameters())
        layer_bf16 = sum(p.numel() for p in layer if p.dtype == torch.bfloat16)
        res[name] = dict(total=total, per_bf16=per_bf16,
                         layer=layer_bf16 * per_bf16 + 4 * sum(p.numel() for p in layer) - 4 * layer_bf16)
    off, on = res["off"], res["on"]
    row = {"feature": "reuse-fp32-param", "device_bytes_off": off["total"], "device_bytes_on": on["total"],
           "device_ratio_on_off": on["total"] / off["total"],
           "bytes_per_bf16_param_off": off["per_bf16"], "bytes_per_bf16_param_on": on["per_bf16"],
           "bytes_per_layer_off": off["layer"], "bytes_per_layer_on": on["layer"],
           "what": "model parameters + fp32 master copies (--bf16, Float16 optimizer)"}
    return _timing(row, times["off"], times["on"])


def _reuse_distributed_body(rank, world_size, a):
    """One rank of reuse_fp32_param_distributed_row: (bytes, bf16 params, step times) off and on."""
    import types
    import mindspeed
    from mindspeed.features.memory.reuse_fp32_param_megatron import parameter_and_master_bytes
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    from tests_extend.unit.swap_workers import trainer_for
    a = types.SimpleNamespace(**a)
    base = _base(a) + ["--bf16", "--use-distributed-optimizer", "--global-batch-size", str(2 * a.mbs)]
    args = parse_args(base, world_size=world_size)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, rank)
    out = {}
    for name, flags in (("off", []), ("on", ["--reuse-fp32-param"])):
        args, tr = trainer_for(flags, base, vocab_size=_Tok.vocab_size, world_size=world_size)
        times = _step_times(args, tr, a.steps)
        (opt,) = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
        other = sum(b.param_data.untyped_storage().nbytes() for b in opt.buffers if b.param_dtype.itemsize == 4)
        total, bf16, _ = parameter_and_master_bytes(tr.model, tr.optimizer)
        out[name] = dict(total=total, bf16_bytes=total - other, bf16=bf16, times=times)
    mindspeed.unadapt()
    return out


def reuse_fp32_param_distributed_row(a) -> dict:
    """--reuse-fp32-param with --use-distributed-optimizer at DP=2 (two processes): bytes one rank holds
    for the bf16 parameter buffer, its fp32 master shard and (on) the residuals, per bf16 parameter."""
    from tests_extend.distributed.harness import run_distributed
    res = run_distributed(_reuse_distributed_body, world_size=2, args=(vars(a),), timeout=3600)[0]
    off, on = res["off"], res["on"]
    row = {"feature": "reuse-fp32-param (distributed optimizer, DP=2)", "device_bytes_off": off["total"],
           "device_bytes_on": on["total"], "device_ratio_on_off": on["total"] / off["total"],
           "bytes_per_bf16_param_off": off["bf16_bytes"] / off["bf16"],
           "bytes_per_bf16_param_on": on["bf16_bytes"] / on["bf16"],
           "what": "one rank: bf16 parameter buffer + fp32 master shard (+ residual shard)"}
    return _timing(row, off["times"], on["times"])


def format_row(row: dict) -> str:
    def cell(k, v):
        if k.startswith(("device_bytes", "host_bytes", "device_peak", "bytes_per_layer")) and isinstance(v, (int, float)):
            return f"{k}={v / MiB:.1f}MiB"
        return f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
    return " | ".join(cell(k, v) for k, v in row.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per case (after one warm-up)")
    parser.add_argument("--times", type=int, default=16, help="--swap-optimizer-times")
    parser.add_argument("--only", nargs="*", choices=["swap-attention", "swap-optimizer", "reuse-fp32-param",
                                                        "reuse-fp32-param-distributed"])
    a = parser.parse_args()
    os.environ.pop("RANK", None)
    import mindspeed
    from mindspeed.training import pretrain
    from mindspeed.flags.trainer_flags import parse_args
    args = parse_args(_base(a), world_size=1)
    mindspeed.adapt(args)
    pretrain._init_distributed(args, "cpu")
    pretrain.init_batch_schedule(args, 0)
    print(f"model: {a.layers} layers, hidden {a.hidden}, seq {a.seq}, micro-batch {a.mbs}; {os.cpu_count()} CPUs",
          flush=True)
    cases = {"swap-attention": swap_attention_row, "swap-optimizer": swap_optimizer_row,
             "reuse-fp32-param": reuse_fp32_param_row,
             "reuse-fp32-param-distributed": reuse_fp32_param_distributed_row}
    for name in a.only or list(cases):
        load0 = os.getloadavg()[0]
        row = cases[name](a)
        row["load_avg_1min"] = f"{load0:.1f}->{os.getloadavg()[0]:.1f}"
        print(format_row(row), flush=True)
    mindspeed.unadapt()


if __name__ == "__main__":
    main()
