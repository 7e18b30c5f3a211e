"""--moe-fb-overlap benchmark (CPU, torch backend, gloo, 2 processes, EP 2): the all-to-all time the
combined-1F1B schedule hides per step, from the recorded intervals of one run (not wall time).

The built-in trainer runs --steps steps with the flag; the side stream records when each all-to-all
node (dispatch, combine; forward, backward) ran on its worker thread and when each compute node
(attn, mlp, pre/post-process, loss) ran on the host thread. Hidden = the all-to-all nodes' time that
lies under host compute (side_stream.hidden_seconds). Printed per rank: the all-to-all nodes'
seconds per step, the hidden seconds per step and their ratio, with the load average (shared machine).
The combine node also holds the unpermute and the residual add (Megatron puts them there).

    python tests_extend/benchmarks/bench_moe_fb_overlap.py [--steps 10] [--hidden 256] [--seq 256]
                                                           [--micro-batches 4]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests_extend.distributed.harness import run_distributed  # noqa: E402
from tests_extend.distributed.test_moe_fb_overlap import EP2, ON, _train  # noqa: E402


def _base(a) -> list:
    batch = 2 * a.micro_batches * 2           # micro-batch 2, DP 2
    return ["--num-layers", "2", "--hidden-size", str(a.hidden), "--num-attention-heads", "4",
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--micro-batch-size", "2",
            "--global-batch-size", str(batch), "--eval-iters", "0", "--eval-interval", "1000",
            "--log-interval", "1000", "--lr", "1e-3", "--mock-data", "--seed", "7", "--num-experts", "4",
            "--moe-token-dispatcher-type", "alltoall", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _body(rank, world_size, tmp, base, steps):
    return _train(rank, tmp, "bench", ON + ["--train-iters", str(steps)], EP2, base)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=4, help="per step and data-parallel rank")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = run_distributed(_body, world_size=2, args=(tmp, _base(a), a.steps), timeout=600)
    print(f"load average {os.getloadavg()[0]:.1f}; {a.steps} steps, hidden {a.hidden}, seq {a.seq}, "
          f"{a.micro_batches} micro-batches per step and rank, 2 MoE layers, EP 2")
    for rank, r in enumerate(runs):
        comm, hidden = r["comm_seconds"] / a.steps, r["hidden"] / a.steps
        print(f"rank {rank}: all-to-all nodes {comm * 1e3:.1f} ms/step, hidden under compute "
              f"{hidden * 1e3:.1f} ms/step, ratio {hidden / comm:.2f} ({r['comm_count'] // a.steps} nodes/step)")


if __name__ == "__main__":
    main()
