"""Keep the docs' generated sections equal to what the code computes: the support matrix in
docs/support-matrix.md, the flag table in docs/flags.md and upstream's MindSpore list in
docs/mindspore.md (`python -m mindspeed docs`, alias `readme`, rewrites them)."""
from __future__ import annotations

import os

from mindspeed import upstream_mindspore
from mindspeed.support_matrix import FLAGS_BEGIN, FLAGS_END, README_BEGIN, README_END, readme_sections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (begin marker, end marker) -> the docs file, relative to the repository root, that holds that section
SECTION_FILES = {
    (README_BEGIN, README_END): os.path.join("docs", "support-matrix.md"),
    (FLAGS_BEGIN, FLAGS_END): os.path.join("docs", "flags.md"),
    (upstream_mindspore.BEGIN, upstream_mindspore.END): os.path.join("docs", "mindspore.md"),
}


def _sections() -> dict:
    return {**readme_sections(), (upstream_mindspore.BEGIN, upstream_mindspore.END): upstream_mindspore.table()}


def section(text: str, begin: str, end: str, where: str = "the file") -> str:
    if begin not in text or end not in text:
        raise ValueError(f"{where} lacks the markers {begin!r} ... {end!r}")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def _file(markers: tuple[str, str], root: str) -> str:
    if markers not in SECTION_FILES:
        raise KeyError(f"no docs file is assigned to the generated section {markers[0]!r} (mindspeed/readme.py)")
    return os.path.join(root, SECTION_FILES[markers])


def drift(root: str = ROOT) -> list[str]:
    """The generated sections whose docs text differs from the code, as 'docs/FILE: begin marker'."""
    stale = []
    for (begin, end), body in _sections().items():
        path = _file((begin, end), root)
        text = open(path, encoding="utf-8").read()
        if section(text, begin, end, os.path.relpath(path, root)) != body:
            stale.append(f"{os.path.relpath(path, root)}: {begin}")
    return stale


def update_docs(root: str = ROOT) -> str:
    """Rewrite every generated section in its docs file; returns the files rewritten."""
    written = []
    for (begin, end), body in _sections().items():
        path = _file((begin, end), root)
        text = open(path, encoding="utf-8").read()
        section(text, begin, end, os.path.relpath(path, root))      # both markers present
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        new = f"{head}{begin}\n{body}\n{end}{tail}"
        if new != text:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(new)
        written.append(os.path.relpath(path, root))
    return "updated " + ", ".join(written)

