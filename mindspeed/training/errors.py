"""Errors a user can fix (bad flags, data, checkpoints): reported as one line, before work starts.
Framework-free so either trainer and the entry point can import them cheaply."""


class CheckpointError(RuntimeError):
    """A --load directory or checkpoint that cannot be used."""
