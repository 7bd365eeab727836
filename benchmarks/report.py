"""Filling a marked section of a markdown file with a benchmark's table (``--report-to``): the lines
``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` bound it; everything outside them is kept as it is."""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def check_markers(path: Path, name: str) -> str:
    """The file's text, or a SystemExit naming the markers it lacks (check before the long work, not after)."""
    start, end = markers(name)
    if not path.is_file():
        raise SystemExit(f"--report-to {path}: no such file")
    doc = path.read_text()
    if start not in doc or end not in doc or doc.index(start) > doc.index(end):
        raise SystemExit(f"--report-to {path}: it has no section marked by the lines `{start}` and `{end}`; add "
                         "both where the table belongs, then rerun")
    return doc


def report_to(path: Path, name: str, text: str) -> None:
    """Replace what lies between ``name``'s markers in ``path`` by ``text``."""
    start, end = markers(name)
    head, rest = check_markers(path, name).split(start, 1)
    path.write_text(f"{head}{start}\n{text.rstrip()}\n{end}{rest.split(end, 1)[1]}")
