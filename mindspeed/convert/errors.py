"""The converter's one error: something the user can fix, said in one line before anything is written."""
from __future__ import annotations

from mindspeed.errors import one_line


class ConvertError(ValueError):
    def __init__(self, message: str):
        super().__init__(one_line(message))
