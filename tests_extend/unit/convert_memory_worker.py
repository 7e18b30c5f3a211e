"""Converts a Hugging Face model (hf->mg, with --neutral-copy) in a fresh process and reports its
peak memory growth over the process after its imports: python -m tests_extend.unit.convert_memory_worker
HF_DIR SAVE_DIR [converter flags...] -> one JSON line {"rss_after_imports": .., "peak": .., "growth": ..} (bytes)."""
import json
import sys


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def rss_bytes() -> int:
    return status_bytes("VmRSS")


def main(hf_dir: str, save_dir: str, *flags: str) -> None:
    import contextlib
    import io
    # everything the conversion imports, before the baseline is taken
    import megatron.core.dist_checkpointing  # noqa: F401
    import mindspeed.checkpoint.torch_dist  # noqa: F401
    import mindspeed.training.model  # noqa: F401
    from mindspeed.convert import hf_to_mg, megatron_write, torch_dist_stream  # noqa: F401
    from mindspeed.convert.cli import main as convert
    from mindspeed.checkpoint import neutral as neutral_format  # noqa: F401
    base = rss_bytes()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = convert(["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", hf_dir,
                      "--save-dir", save_dir, *flags])
    # VmHWM: this process image's peak. Not getrusage's ru_maxrss: Linux carries into it, across
    # exec, the peak of the process that spawned this one (a pytest process of a GiB, say)
    peak = status_bytes("VmHWM")
    print(json.dumps({"rc": rc, "rss_after_imports": base, "peak": peak, "growth": peak - base}))


if __name__ == "__main__":
    main(*sys.argv[1:])
