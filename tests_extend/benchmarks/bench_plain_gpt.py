"""The built-in trainer's step time against a minimal plain-PyTorch GPT of the same architecture.

    python tests_extend/benchmarks/bench_plain_gpt.py [--rounds 3] [--iters 40] [--level 2]
        [--sizes issue,example] [--layouts llama,gpt2] [--threads 1,2] [-- extra trainer flags]

One process, fp32, 4 layers, hidden 128, 4 heads, vocabulary 128, tied output layer, Adam with weight
decay 0.1, gradient clipping at 1.0, random tokens, at two sizes:
- issue: seq 64, micro-batch 12 = global batch;
- example: the default example's seq 128, micro-batch 16, global batch 32 (2 micro-batches);
and two layouts:
- llama (the trainer's default): RMSNorm, SwiGLU, RoPE, no biases;
- gpt2: LayerNorm, GELU MLP (4 x hidden), learned absolute positions, biases.

Each row runs the two loops interleaved `--rounds` times, taking turns at going first (machine load
hits them alike):
- trainer: tests_extend/example/pretrain_gpt.py (Megatron-Core GPTModel, MindSpeed's device shim,
  --optimization-level L, --log-interval 10): the median of its "elapsed time per iteration" lines
  after the first one (warm-up);
- plain: the model below, written for this comparison (nn.Linear, F.scaled_dot_product_attention,
  torch.optim.AdamW, torch's clip_grad_norm_): the median of its 10-step means after the first 10.
A row's figure is the median over rounds. The plain model's parameter count must equal the
trainer's (same architecture), or the run stops. Prints the load average before and after: rerun
when it is above 1.
"""
from __future__ import annotations

import argparse
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
MODEL = dict(num_layers=4, hidden=128, heads=4, vocab=128)
SIZES = {"issue": dict(seq=64, micro_batch=12, global_batch=12),
         "example": dict(seq=128, micro_batch=16, global_batch=32)}
LAYOUTS = ("llama", "gpt2")
LOG_INTERVAL = 10


def ffn_size(m: dict) -> int:
    if m["layout"] == "gpt2":
        return 4 * m["hidden"]
    return max(64, int(8 * m["hidden"] / 3 / 64) * 64)     # the trainer's SwiGLU default


# --- the plain model ----------------------------------------------------------------------------
def build_plain(m: dict):
    import torch
    import torch.nn.functional as F
    from torch import nn

    H, nh, S, gpt2 = m["hidden"], m["heads"], m["seq"], m["layout"] == "gpt2"
    d, ffn = H // nh, ffn_size(m)

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(H))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

    def norm():
        return nn.LayerNorm(H, eps=1e-5) if gpt2 else RMSNorm()

    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(x):                                     # [b, nh, s, d], rotate_half as Megatron-Core
        if gpt2:
            return x
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = norm(), norm()
            self.qkv, self.proj = nn.Linear(H, 3 * H, bias=gpt2), nn.Linear(H, H, bias=gpt2)
            self.fc1 = nn.Linear(H, ffn if gpt2 else 2 * ffn, bias=gpt2)
            self.fc2 = nn.Linear(ffn, H, bias=gpt2)

        def mlp(self, x):
            if gpt2:
                return self.fc2(F.gelu(self.fc1(x)))
            gate, up = self.fc1(x).chunk(2, -1)
            return self.fc2(F.silu(gate) * up)

        def forward(self, x):                        # [b, s, H]
            b = x.shape[0]
            q, k, v = self.qkv(self.norm1(x)).view(b, S, 3, nh, d).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, S, H))
            return x + self.mlp(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(m["vocab"], H)
            self.positions = nn.Embedding(S, H) if gpt2 else None
            self.layers = nn.ModuleList(Layer() for _ in range(m["num_layers"]))
            self.final_norm = norm()
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens, labels):
            x = self.embedding(tokens)
            if self.positions is not None:
                x = x + self.positions.weight
            for layer in self.layers:
                x = layer(x)
            logits = self.final_norm(x) @ self.embedding.weight.t()     # tied output layer
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))

    return GPT()


def interval_means(step_s: list[float]) -> list[float]:
    """Mean step time of each full --log-interval window after the first (warm-up), in ms."""
    windows = [step_s[i:i + LOG_INTERVAL] for i in range(LOG_INTERVAL, len(step_s), LOG_INTERVAL)]
    return [1000 * sum(w) / len(w) for w in windows if len(w) == LOG_INTERVAL]


def run_plain(m: dict, iters: int, threads: int) -> tuple[float, int]:
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(1234)
    model = build_plain(m)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=no_decay, weight_decay=0.0)],
                            lr=3e-4, betas=(0.9, 0.999), eps=1e-8)
    micro = m["global_batch"] // m["micro_batch"]
    times = []
    for _ in range(iters):
        batches = [torch.randint(0, m["vocab"], (m["micro_batch"], m["seq"] + 1)) for _ in range(micro)]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        for batch in batches:
            (model(batch[:, :-1], batch[:, 1:]) / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(interval_means(times)), sum(p.numel() for p in model.parameters())


# --- the trainer --------------------------------------------------------------------------------
def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


LAYOUT_FLAGS = {"llama": ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                          "--disable-bias-linear"],
                "gpt2": ["--normalization", "LayerNorm", "--no-swiglu", "--position-embedding-type",
                         "learned_absolute", "--add-bias-linear"]}
FUSED_FLAGS = {"llama": ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn"],
               "gpt2": ["--use-flash-attn"]}


def run_trainer(m: dict, iters: int, threads: int, level: int, extra: list[str]) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", _port(),
           os.path.join(ROOT, "tests_extend", "example", "pretrain_gpt.py"),
           "--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden"]),
           "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]),
           "--max-position-embeddings", str(m["seq"]), *LAYOUT_FLAGS[m["layout"]],
           "--micro-batch-size", str(m["micro_batch"]), "--global-batch-size", str(m["global_batch"]),
           "--train-iters", str(iters), "--lr", "3e-4", "--lr-warmup-iters", "0", "--weight-decay", "0.1",
           "--clip-grad", "1.0", "--log-interval", str(LOG_INTERVAL), "--eval-iters", "0", "--mock-data",
           "--optimization-level", str(level), *(FUSED_FLAGS[m["layout"]] if level >= 1 else []), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    text = out.stdout + out.stderr
    steps = [float(ms) for it, ms in STEP.findall(text) if int(it) > LOG_INTERVAL]
    params = PARAMS.search(text)
    if out.returncode != 0 or not steps or params is None:
        raise SystemExit(f"trainer run failed:\n{text[-3000:]}")
    return statistics.median(steps), int(params.group(1))


def run_row(m: dict, a) -> tuple[float, float]:
    """Median trainer and plain ms/step over interleaved rounds; the trainer runs first in even
    rounds and second in odd ones: which of two back-to-back runs came first moved them on this
    machine (docs/performance.md)."""
    loops = {"trainer": lambda: run_trainer(m, a.iters, m["threads"], a.level, a.extra),
             "plain": lambda: run_plain(m, a.iters, m["threads"])}
    ms = {"trainer": [], "plain": []}
    for round_ in range(a.rounds):
        params = {}
        for name in (("trainer", "plain") if round_ % 2 == 0 else ("plain", "trainer")):
            step_ms, params[name] = loops[name]()
            ms[name].append(step_ms)
        if params["plain"] != params["trainer"]:
            raise SystemExit(f"{m}: architectures differ: trainer {params['trainer']} parameters, "
                             f"plain {params['plain']}")
    return statistics.median(ms["trainer"]), statistics.median(ms["plain"])


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--level", type=int, default=2, choices=[0, 1, 2])
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--threads", default="1,2")
    p.add_argument("extra", nargs="*", help="after --: more trainer flags")
    a = p.parse_args(argv)
    if a.iters < 3 * LOG_INTERVAL:
        p.error(f"--iters must be at least {3 * LOG_INTERVAL} (the first {LOG_INTERVAL} steps are warm-up)")
    sizes, layouts = a.sizes.split(","), a.layouts.split(",")
    for name in sizes:
        if name not in SIZES:
            p.error(f"--sizes: unknown size {name!r} (known: {', '.join(SIZES)})")
    for name in layouts:
        if name not in LAYOUTS:
            p.error(f"--layouts: unknown layout {name!r} (known: {', '.join(LAYOUTS)})")
    print(f"trainer at --optimization-level {a.level}, {a.iters} iterations, --log-interval {LOG_INTERVAL} "
          f"(first interval is warm-up), median of {a.rounds} interleaved round(s); load average {_load()}")
    print(f"{'size':8s} {'layout':7s} {'threads':>7s} {'trainer ms':>11s} {'plain ms':>9s} {'trainer/plain':>14s}")
    for size in sizes:
        for layout in layouts:
            for threads in (int(t) for t in a.threads.split(",")):
                m = dict(MODEL, **SIZES[size], layout=layout, threads=threads)
                trainer, plain = run_row(m, a)
                print(f"{size:8s} {layout:7s} {threads:7d} {trainer:11.1f} {plain:9.1f} {trainer / plain:13.3f}x",
                      flush=True)
    print(f"load average: {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
