"""A device's peak FLOP/s: the denominator of MFU (model FLOPs utilization).

GPUs whose datasheet peak is known take it from KNOWN_PEAKS (dense, no sparsity). Anything else
(CPUs, Ascend NPUs, other GPUs) is measured once: the best rate of square matmuls in the training
dtype, with the framework the trainer runs and this process's threads, cached in
MindSpeed's cache root (mindspeed/files.py)/peak_flops.json keyed by machine, device model,
threads, framework version and dtype, so later runs on the same machine reuse it.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass

from mindspeed.files import atomic_write, cache_path

# TFLOP/s per device by (device-name fragment, dtype), longest fragment matched first; fp32 is
# plain fp32 (torch leaves TF32 matmuls off by default)
KNOWN_PEAKS = {
    ("H100 PCIe", "bf16"): 756.0, ("H100 PCIe", "fp16"): 756.0, ("H100 PCIe", "fp32"): 51.0,
    ("H100", "bf16"): 989.0, ("H100", "fp16"): 989.0, ("H100", "fp32"): 67.0,
    ("H200", "bf16"): 989.0, ("H200", "fp16"): 989.0, ("H200", "fp32"): 67.0,
    ("A100", "bf16"): 312.0, ("A100", "fp16"): 312.0, ("A100", "fp32"): 19.5,
}
BENCH_SECONDS = 0.3         # per measurement: long enough to be stable, short enough for every start


@dataclass(frozen=True)
class Peak:
    tflops: float
    source: str             # "datasheet (NVIDIA H100 ...)" or "measured: ..."

    def describe(self) -> str:
        return f"{self.tflops:.4g} TFLOP/s per device, {self.source}"


def device_peak(framework: str, device: str, dtype: str) -> Peak:
    """framework: "torch" | "mindspore"; device: cpu | cuda | npu | ascend; dtype: fp32 | bf16 | fp16."""
    model = _device_model(framework, device)
    for fragment, kind in sorted(KNOWN_PEAKS, key=lambda k: -len(k[0])):
        if kind == dtype and fragment in model:
            return Peak(KNOWN_PEAKS[fragment, kind], f"datasheet ({model}, {dtype})")
    threads, version = _threads_and_version(framework)
    key = f"{platform.node()}|{device}:{model}|{threads} threads|{framework} {version}|{dtype}"
    path = cache_path("peak_flops.json")
    cached = _read_json(path)
    note = f"measured: {dtype} matmul with {framework} on {model}, {threads} thread(s)"
    if key in cached:
        return Peak(float(cached[key]), f"{note}, cached in {path}")
    tflops = _measure(framework, device, dtype)
    cached[key] = tflops
    _write_json(path, cached)
    return Peak(tflops, f"{note}, now cached in {path}")


def _dump(data: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def _device_model(framework: str, device: str) -> str:
    if framework == "torch" and device in ("cuda", "npu"):
        import torch
        return getattr(torch, device).get_device_name()
    if device == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
            if names:
                return names[0]
        except OSError:
            pass
        return platform.processor() or platform.machine()
    return device


def _threads_and_version(framework: str) -> tuple[int, str]:
    if framework == "mindspore":
        import mindspore as ms
        return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1), ms.__version__
    import torch
    return torch.get_num_threads(), torch.__version__


def _measure(framework: str, device: str, dtype: str) -> float:
    """Best TFLOP/s of n x n matmuls over BENCH_SECONDS (the first product is a warm-up)."""
    n = 1024 if device == "cpu" else 8192
    matmul = _torch_matmul(device, dtype, n) if framework == "torch" else _mindspore_matmul(device, dtype, n)
    matmul()
    best, deadline = 0.0, time.perf_counter() + BENCH_SECONDS
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        matmul()
        best = max(best, 2 * n ** 3 / (time.perf_counter() - start) / 1e12)
    return best


def _torch_matmul(device: str, dtype: str, n: int):
    import torch
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a, b = (torch.randn(n, n, device=device).to(dt) for _ in range(2))
    sync = getattr(torch, device).synchronize if device in ("cuda", "npu") else (lambda: None)

    def run():
        torch.matmul(a, b)
        sync()
    return run


def _mindspore_matmul(device: str, dtype: str, n: int):
    import mindspore as ms
    import numpy as np
    # MindSpore's CPU MatMul has no bf16 kernel: the trainer's bf16 matmuls run in fp32 there
    # (backends/mindspore/precision.py), so that is the peak its steps can reach
    dt = {"fp32": ms.float32, "bf16": ms.float32 if device == "cpu" else ms.bfloat16, "fp16": ms.float16}[dtype]
    a, b = (ms.Tensor(np.random.default_rng(k).standard_normal((n, n), dtype=np.float32)).astype(dt)
            for k in range(2))
    return lambda: ms.ops.matmul(a, b).asnumpy()   # asnumpy waits for the result


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_json(path: str, data: dict) -> None:
    """Best effort (a read-only home only costs a measurement next time); written whole, then renamed."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, lambda tmp: _dump(data, tmp), mode=0o644)
    except OSError:
        pass
