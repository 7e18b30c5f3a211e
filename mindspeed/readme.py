"""Keep README.md's generated sections (support matrix, flags) equal to what the code computes."""
from __future__ import annotations

import os

from mindspeed.support_matrix import readme_sections

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def section(text: str, begin: str, end: str) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"README.md lacks the markers {begin!r} ... {end!r}")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def drift(path: str = README) -> list[str]:
    """Names of generated sections whose README text differs from the code."""
    text = open(path, encoding="utf-8").read()
    return [begin for (begin, end), body in readme_sections().items() if section(text, begin, end) != body]


def update_readme(path: str = README) -> str:
    text = open(path, encoding="utf-8").read()
    for (begin, end), body in readme_sections().items():
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{body}\n{end}{tail}"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return f"updated {path}"
