"""Soak run (not part of CI): each trainer for 3,000 iterations, then 20 short trainings back to back.

Checks what a long job needs and a short test cannot show: no native crash over many iterations and
launches, and resident memory that does not grow (each worker's RSS at the last logged iteration within
5% of its RSS at iteration 300). Uses README command 1's launch scripts on a small model.
Usage: python tests_extend/soak/soak.py [--iters 3000] [--short 20] [--out soak.json]
What was measured, and what is still owed: docs/soak.md."""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests_extend", "stress"))
from ms_native_crash import NATIVE_CRASH_SIGNS  # noqa: E402  (one list of what a native crash prints)
sys.path.insert(0, ROOT)
from mindspeed.net import free_port  # noqa: E402
from tests_extend.system.interrupted_run import descendants  # noqa: E402

SCRIPTS = {"torch": "train_distributed.sh", "mindspore": "train_distributed_ms.sh"}
MODEL = dict(NUM_LAYERS="2", HIDDEN_SIZE="64", NUM_HEADS="4", SEQ_LENGTH="64", MICRO_BATCH="4", GLOBAL_BATCH="8")
ITERATION = re.compile(r"iteration\s+(\d+)/")
GROWTH_LIMIT = 1.05


def _worker_rss_mb(launcher: int) -> dict[int, float]:
    """RSS of each training worker (a process running pretrain_gpt.py) under the launcher."""
    rss = {}
    for pid in descendants(launcher):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pretrain_gpt.py" not in f.read():
                    continue
            with open(f"/proc/{pid}/status") as f:
                kb = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        rss[pid] = kb / 1024
    return rss


def _launch(backend: str, iters: int, workdir: str, log_interval: int):
    env = dict(os.environ, PATH=os.path.join(ROOT, ".venv", "bin") + os.pathsep + os.environ["PATH"],
               TRAIN_ITERS=str(iters), LOG_INTERVAL=str(log_interval), EVAL_INTERVAL=str(max(iters // 3, 10)),
               EVAL_ITERS="2", LOG_DIR=os.path.join(workdir, "msrun_log"), PYTHONFAULTHANDLER="1",
               MASTER_PORT=str(free_port()), **MODEL)   # the scripts' default ports may be another job's
    log = open(os.path.join(workdir, f"{backend}.log"), "w")
    script = os.path.join(ROOT, "tests_extend", "example", SCRIPTS[backend])
    proc = subprocess.Popen(["bash", script], cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, log


def long_run(backend: str, iters: int, workdir: str) -> dict:
    """Train `iters` iterations; record every worker's RSS at each logged iteration."""
    os.makedirs(workdir, exist_ok=True)
    start = time.time()
    proc, log = _launch(backend, iters, workdir, log_interval=100)
    samples = {}
    for line in proc.stdout:
        log.write(line)
        match = ITERATION.search(line)
        if match:
            it = int(match.group(1))
            if it not in samples:
                samples[it] = _worker_rss_mb(proc.pid)
    rc = proc.wait()
    log.close()
    text = open(log.name, errors="replace").read()
    at_300 = samples.get(300, {})
    last = max(samples) if samples else 0
    growth = {pid: samples[last].get(pid, 0) / mb for pid, mb in at_300.items() if mb}
    return {"backend": backend, "rc": rc, "iterations_logged": last, "seconds": round(time.time() - start, 1),
            "native_crash": any(sign in text for sign in NATIVE_CRASH_SIGNS),
            "rss_mb_at_300": {str(p): round(v, 1) for p, v in at_300.items()},
            "rss_mb_at_last": {str(p): round(v, 1) for p, v in samples.get(last, {}).items()},
            "max_growth": round(max(growth.values()), 4) if growth else None}


def short_runs(count: int, iters: int, workdir: str) -> list[dict]:
    """`count` short trainings, alternating the trainers, each a fresh launch."""
    results = []
    for n in range(count):
        backend = ("torch", "mindspore")[n % 2]
        run_dir = os.path.join(workdir, f"short{n:02d}")
        os.makedirs(run_dir, exist_ok=True)
        start = time.time()
        proc, log = _launch(backend, iters, run_dir, log_interval=5)
        out, _ = proc.communicate()
        log.write(out)
        log.close()
        results.append({"backend": backend, "rc": proc.returncode, "seconds": round(time.time() - start, 1),
                        "native_crash": any(sign in out for sign in NATIVE_CRASH_SIGNS)})
        print(f"short run {n + 1}/{count} ({backend}): rc {proc.returncode}, {results[-1]['seconds']} s", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--short", type=int, default=20)
    parser.add_argument("--short-iters", type=int, default=20)
    parser.add_argument("--workdir", default="soak_work")
    parser.add_argument("--out", default="soak.json")
    parser.add_argument("--backends", default="torch,mindspore")
    args = parser.parse_args(argv)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": os.getloadavg()[0],
              "python": sys.version.split()[0], "long": [], "short": []}
    for backend in args.backends.split(","):
        result = long_run(backend, args.iters, os.path.join(args.workdir, f"long_{backend}"))
        print(json.dumps(result), flush=True)
        report["long"].append(result)
    report["short"] = short_runs(args.short, args.short_iters, os.path.join(args.workdir, "short")) if args.short else []
    report["load_after"] = os.getloadavg()[0]
    crashes = sum(r["native_crash"] for r in report["long"] + report["short"])
    failed = [r for r in report["long"] + report["short"] if r["rc"] != 0]
    grown = [r for r in report["long"] if r["max_growth"] is None or r["max_growth"] > GROWTH_LIMIT]
    report["summary"] = {"native_crashes": crashes, "failed_runs": len(failed), "memory_grew": len(grown)}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"soak: {crashes} native crashes, {len(failed)} failed runs, {len(grown)} long runs whose RSS grew "
          f"more than {GROWTH_LIMIT - 1:.0%} from iteration 300 | load {report['load_before']:.2f} -> "
          f"{report['load_after']:.2f} | {args.out}")
    return 0 if not (crashes or failed or grown) else 1


if __name__ == "__main__":
    sys.exit(main())
