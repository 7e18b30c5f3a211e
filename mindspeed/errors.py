"""Errors a user can fix (bad flags, data, checkpoints): reported as one line, before work starts.
Framework-free so either trainer and the entry point can import them cheaply."""
from __future__ import annotations

import argparse
import sys
import warnings


class ArgumentError(ValueError):
    """A flag value or combination that cannot work; raised before any work starts."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors (invalid choice, missing value, ...) raise ArgumentError with one line
    instead of printing the usage block and exiting."""

    def error(self, message):
        raise ArgumentError(" ".join(message.split()))


def positive_int(text: str) -> int:
    """argparse `type=` for a count that must be at least 1. Raises ArgumentTypeError, whose text
    argparse keeps (a ValueError of another kind becomes "invalid positive_int value")."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


class CheckpointError(RuntimeError):
    """A --load directory or checkpoint that cannot be used. The message is one line."""

    def __init__(self, message: str):
        super().__init__(one_line(message, limit=2000))   # foreign error texts are cut where they are quoted


class CollectiveTimeout(RuntimeError):
    """A collective that a rank never joined (it hangs, is stopped, or died), in one line naming the
    collective, its ranks and the missing one. Every rank still running stops with it."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


class ConvertError(ValueError):
    """Something the converter's user can fix, said in one line before anything is written."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


class InferenceError(ValueError):
    """Something the user of `python -m mindspeed.generate` / `mindspeed.evaluate` can fix (a
    missing directory, no model flags, an unknown tokenizer, a prompt too long), in one line."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


def one_line(text: str, limit: int = 600) -> str:
    """`text` with its line breaks folded and cut to `limit` characters (an error line, not a log)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def resume_hint(root: str, readable: int | None) -> str:
    """The part of an unreadable-checkpoint message that says what can be loaded instead."""
    if readable is None:
        return f"no readable checkpoint is left in {root}"
    return (f"the last readable checkpoint is iteration {readable}: load it with "
            f"--load {root} --ckpt-step {readable}")


def unreadable(root: str, iteration: int, problem: str, readable: int | None) -> CheckpointError:
    """The one-line error for a checkpoint iteration whose files cannot be read."""
    return CheckpointError(f"checkpoint iteration {iteration} in {root} cannot be read: {problem}; "
                           f"{resume_hint(root, readable)} (nothing was changed)")


def report(message: str, prefix: str = "error: ", stream=None) -> None:
    """Print `prefix + message` as one line with one write: ranks of a job share stderr, and a
    separate write for the newline lets another rank's line land in the middle of this one."""
    stream = sys.stderr if stream is None else stream
    stream.write(f"{prefix}{message}\n")
    stream.flush()


def hide_fallback_warnings() -> None:
    """Megatron-Core warns on import, once per module, that Apex or Transformer Engine is not
    installed and it falls back to torch's own code: noise on every run of a CPU job, and lines
    before an entry point's one-line refusal. Hidden for the rest of the process."""
    warnings.filterwarnings("ignore", message=r"(Transformer Engine|Apex)[\w ]* not installed", category=UserWarning)
