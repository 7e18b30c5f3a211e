"""The built-in trainer's step time against a minimal plain-PyTorch GPT of the same architecture.

    python tests_extend/benchmarks/bench_plain_gpt.py [--iters 40] [--level 2] [-- extra trainer flags]

One process, fp32, one compute thread, the default example's model (4 layers, hidden 128, 4 heads,
seq 128, SwiGLU, RoPE, RMSNorm, tied output, micro-batch 16, global batch 32 = 2 micro-batches,
Adam with weight decay 0.1, gradient clipping at 1.0), random tokens. Three runs, interleaved
`--rounds` times so machine load hits them alike:

- trainer: tests_extend/example/pretrain_gpt.py (Megatron-Core GPTModel, MindSpeed's device shim,
  --optimization-level L), median "elapsed time per iteration" after warm-up;
- plain: the model below, written for this comparison (nn.Linear, F.scaled_dot_product_attention,
  torch.optim.AdamW), median step time after warm-up;
- plain + shim mode: the same plain step inside MindSpeed's CudaToCpuMode (the TorchFunctionMode
  that maps Megatron's literal "cuda" devices to the CPU), the per-op cost the shim adds.

The plain model's parameter count must equal the trainer's (same architecture), or the run stops.
Prints the medians, the ratios and the load average (rerun when it is above 1).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([\d.]+)")
PARAMS = re.compile(r"parameters on rank 0: (\d+)")
MODEL = dict(num_layers=4, hidden=128, heads=4, seq=128, micro_batch=16, global_batch=32, vocab=128)
WARMUP = 5


def ffn_size(hidden: int) -> int:
    return max(64, int(8 * hidden / 3 / 64) * 64)     # the trainer's SwiGLU default


# --- the plain model ----------------------------------------------------------------------------
def build_plain(m: dict):
    import torch
    import torch.nn.functional as F
    from torch import nn

    H, nh, S = m["hidden"], m["heads"], m["seq"]
    d, ffn = H // nh, ffn_size(H)

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(H))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(x):                                     # [b, nh, s, d], rotate_half as Megatron-Core
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = RMSNorm(), RMSNorm()
            self.qkv, self.proj = nn.Linear(H, 3 * H, bias=False), nn.Linear(H, H, bias=False)
            self.fc1, self.fc2 = nn.Linear(H, 2 * ffn, bias=False), nn.Linear(ffn, H, bias=False)

        def forward(self, x):                        # [b, s, H]
            b = x.shape[0]
            q, k, v = self.qkv(self.norm1(x)).view(b, S, 3, nh, d).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, S, H))
            gate, up = self.fc1(self.norm2(x)).chunk(2, -1)
            return x + self.fc2(F.silu(gate) * up)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(m["vocab"], H)
            self.layers = nn.ModuleList(Layer() for _ in range(m["num_layers"]))
            self.final_norm = RMSNorm()
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens, labels):
            x = self.embedding(tokens)
            for layer in self.layers:
                x = layer(x)
            logits = self.final_norm(x) @ self.embedding.weight.t()     # tied output layer
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))

    return GPT()


def run_plain(m: dict, iters: int, with_shim: bool) -> tuple[float, int]:
    import contextlib

    import torch
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    model = build_plain(m)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0)],
                            lr=3e-4, betas=(0.9, 0.999), eps=1e-8)
    micro = m["global_batch"] // m["micro_batch"]
    mode = contextlib.nullcontext()
    if with_shim:
        from mindspeed.backends.torch.megatron_shim import CudaToCpuMode
        mode = CudaToCpuMode()
    times = []
    with mode:
        for _ in range(iters):
            batches = [torch.randint(0, m["vocab"], (m["micro_batch"], m["seq"] + 1)) for _ in range(micro)]
            start = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            for batch in batches:
                (model(batch[:, :-1], batch[:, 1:]) / micro).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:]) * 1000, sum(p.numel() for p in model.parameters())


# --- the trainer --------------------------------------------------------------------------------
def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_trainer(m: dict, iters: int, level: int, extra: list[str]) -> tuple[float, int]:
    fused = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", _port(),
           os.path.join(ROOT, "tests_extend", "example", "pretrain_gpt.py"),
           "--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden"]),
           "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]),
           "--max-position-embeddings", str(m["seq"]), "--normalization", "RMSNorm", "--swiglu",
           "--position-embedding-type", "rope", "--disable-bias-linear",
           "--micro-batch-size", str(m["micro_batch"]), "--global-batch-size", str(m["global_batch"]),
           "--train-iters", str(iters), "--lr", "3e-4", "--lr-warmup-iters", "0", "--weight-decay", "0.1",
           "--clip-grad", "1.0", "--log-interval", "1", "--eval-iters", "0", "--mock-data",
           "--optimization-level", str(level), *(fused if level >= 1 else []), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    text = out.stdout + out.stderr
    steps = [float(ms) for it, ms in STEP.findall(text) if int(it) > WARMUP]
    params = PARAMS.search(text)
    if out.returncode != 0 or not steps or params is None:
        raise SystemExit(f"trainer run failed:\n{text[-3000:]}")
    return statistics.median(steps), int(params.group(1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--level", type=int, default=2, choices=[0, 1, 2])
    p.add_argument("--hidden", type=int, default=MODEL["hidden"])
    p.add_argument("--seq", type=int, default=MODEL["seq"])
    p.add_argument("extra", nargs="*", help="after --: more trainer flags")
    a = p.parse_args(argv)
    m = dict(MODEL, hidden=a.hidden, seq=a.seq)
    if a.iters <= WARMUP + 2:
        p.error(f"--iters must be > {WARMUP + 2} (the first {WARMUP} steps are warm-up)")
    results = {"trainer": [], "plain": [], "plain + shim mode": []}
    for _ in range(a.rounds):
        ms, trainer_params = run_trainer(m, a.iters, a.level, a.extra)
        results["trainer"].append(ms)
        ms, plain_params = run_plain(m, a.iters, with_shim=False)
        results["plain"].append(ms)
        results["plain + shim mode"].append(run_plain(m, a.iters, with_shim=True)[0])
        if plain_params != trainer_params:
            raise SystemExit(f"architectures differ: trainer {trainer_params} parameters, plain {plain_params}")
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"model: {m} ffn {ffn_size(m['hidden'])}, {plain_params} parameters, trainer at "
          f"--optimization-level {a.level}, {a.iters} iterations (median after {WARMUP}), {a.rounds} round(s)")
    for k, v in med.items():
        print(f"  {k:20s} {v:8.1f} ms/step")
    print(f"  trainer / plain          {med['trainer'] / med['plain']:.2f}x")
    print(f"  shim mode cost on plain  {med['plain + shim mode'] / med['plain']:.2f}x")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
