"""The data layer's user error, importable without torch or Megatron (the MindSpore trainer needs it)."""


class DataError(ValueError):
    """Missing, truncated or corrupt dataset files, or input that cannot be turned into one."""
