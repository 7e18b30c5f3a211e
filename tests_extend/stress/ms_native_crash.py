"""Stress driver for the MindSpore trainer's rare native crash (docs/native-crash.md).

One process (or each msrun worker) repeats the former crash recipe ROUNDS times: train with a
save, load that checkpoint and train on; with the features named by --features among
recompute, dropout, tp (TP=2 over the shared-memory collectives: run under msrun with 2 workers).
Each round prints one line, so a crash names its round. Not a pytest test (no test_ prefix).

In one process:   python tests_extend/stress/ms_native_crash.py --rounds 50 --features recompute,dropout
Under msrun (TP=2): python tests_extend/stress/ms_native_crash.py --launches 20 --workers 2 --rounds 10 --features tp,dropout
(--launches: start that many fresh processes/jobs, with glibc's heap checks on, and count the crashes)
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--eval-iters", "1", "--eval-interval", "3", "--log-interval", "1", "--lr", "1e-3", "--seed", "7",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--backend", "mindspore"]
FEATURES = {
    "recompute": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
    "dropout": ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"],
    "tp": ["--tensor-model-parallel-size", "2"],
    "sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "fp16": ["--fp16"],
}
# glibc's heap checks: abort at the first inconsistency; freed and new blocks filled with a pattern
CHECKED_ENV = {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165", "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1",
               "GLOG_v": "3"}

# what a native crash leaves in a worker's log (faulthandler, glibc, msrun's report of a signal)
NATIVE_CRASH_SIGNS = ("Fatal Python error", "Segmentation fault", "corrupted", "free():", "malloc():",
                      "double free", "core dumped", "Error code: -", "exit code -", "Aborted")


def _gc_watch(stats: dict) -> None:
    """Count collections that run off the main thread (inside a MindSpore runtime thread)."""
    main = threading.main_thread().ident

    def callback(phase, info):
        if phase == "stop" and threading.get_ident() != main:
            stats["off_main"] += 1
            stats["collected_off_main"] += info.get("collected", 0)
            if len(stats["where"]) < 5:
                frames = traceback.extract_stack()[-6:-1]
                stats["where"].add(f"{threading.current_thread().name}: " + " <- ".join(
                    f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames)))
    gc.callbacks.append(callback)


def rounds(n: int, features: list[str], workdir: str, gc_threshold: int = 0) -> int:
    sys.path.insert(0, os.path.join(ROOT, "tests_extend", "example"))
    from pretrain_gpt import main
    extra = [flag for name in features for flag in FEATURES[name]]
    rank = os.environ.get("RANK_ID", "0")
    stats = {"off_main": 0, "collected_off_main": 0, "where": set()}
    _gc_watch(stats)
    if gc_threshold:
        gc.set_threshold(gc_threshold)
    said = set()
    for r in range(n):
        ckpt = os.path.join(workdir, f"ckpt{r % 2}")
        shutil.rmtree(ckpt, ignore_errors=True) if rank == "0" else None
        started = time.time()
        rc = main(TINY + extra + ["--train-iters", "4", "--save", ckpt, "--save-interval", "2"])
        rc = rc or main(TINY + extra + ["--train-iters", "6", "--load", ckpt])
        print(f"[stress rank {rank}] round {r + 1}/{n} rc {rc} {time.time() - started:.1f}s "
              f"gc off main thread: {stats['off_main']} ({stats['collected_off_main']} objects)",
              file=sys.stderr, flush=True)
        for where in sorted(stats["where"] - said):
            print(f"[stress rank {rank}] a collection ran off the main thread at: {where}", file=sys.stderr)
        said |= stats["where"]
        if rc:
            return rc
    return 0


def launches(args) -> int:
    """Start --launches fresh jobs with glibc's heap checks; print each exit code and the crash count."""
    bindir = os.path.dirname(sys.executable)     # msrun starts `python` from PATH
    env = dict(os.environ, PYTHONPATH=ROOT, WORLD_SIZE=str(args.workers), **CHECKED_ENV,
               PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    if args.perturb == "0":
        env.pop("MALLOC_PERTURB_")
    inner = [__file__, "--rounds", str(args.rounds), "--features", ",".join(args.features),
             "--gc-threshold", str(args.gc_threshold)]
    crashes = 0
    for k in range(args.launches):
        work = tempfile.mkdtemp(prefix="ms_stress_")
        log_dir = os.path.join(work, "logs")
        if args.workers > 1:
            from mindspeed.net import free_port
            cmd = [os.path.join(os.path.dirname(sys.executable), "msrun"), f"--worker_num={args.workers}",
                   f"--local_worker_num={args.workers}", f"--master_port={free_port()}", "--join=True",
                   f"--log_dir={log_dir}", "--cluster_time_out=120", *inner, "--workdir", work]
        else:
            cmd = [sys.executable, *inner, "--workdir", work]
        started = time.time()
        p = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        logs = p.stdout
        if os.path.isdir(log_dir):
            logs += "".join(open(os.path.join(log_dir, f), errors="replace").read() for f in sorted(os.listdir(log_dir)))
        crashed = any(s in logs for s in NATIVE_CRASH_SIGNS)
        crashes += crashed
        verdict = "CRASH" if crashed else "FAILED" if p.returncode else "ok"
        # each rank's count is cumulative over its rounds: its last line holds its total
        last = dict(re.findall(r"\[stress rank (\d+)\] round .* gc off main thread: (\d+)", logs))
        off_main = sum(int(v) for v in last.values())
        print(f"launch {k + 1}/{args.launches}: rc {p.returncode} {time.time() - started:.0f}s {verdict}; "
              f"collections started off the main thread: {off_main}", flush=True)
        if p.returncode or crashed:
            keep = os.path.join(args.keep, f"crash_{os.getpid()}_{k + 1}.log")
            with open(keep, "w") as f:
                f.write(logs)
            print(f"  log kept: {keep}", flush=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"crashes: {crashes}/{args.launches} launches of {args.rounds} rounds each, features {args.features}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--features", type=lambda s: [f for f in s.split(",") if f], default=[])
    p.add_argument("--workdir", default=None)
    p.add_argument("--launches", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--perturb", default="165")
    p.add_argument("--keep", default=tempfile.gettempdir())
    p.add_argument("--gc-threshold", type=int, default=0,
                   help="Python's generation-0 GC threshold (small: collections far more often)")
    args = p.parse_args()
    unknown = [f for f in args.features if f not in FEATURES]
    if unknown:
        p.error(f"unknown feature(s) {unknown}; choose from {sorted(FEATURES)}")
    if args.launches:
        return launches(args)
    workdir = args.workdir or tempfile.mkdtemp(prefix="ms_stress_")
    return rounds(args.rounds, args.features, workdir, args.gc_threshold)


if __name__ == "__main__":
    sys.exit(main())
