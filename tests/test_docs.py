"""The docs as a reader meets them: a short README that shows the two commands before any results, a manual
without commit hashes or dates, a measurement log whose every entry says how it was measured, and links that
lead somewhere."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LOG = DOCS / "measurements"
README = ROOT / "README.md"
TWO_COMMANDS = ("bash scripts/demo.sh", "bash scripts/test.sh")
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
NEXT_TO_COMMIT = re.compile(r"(?i)\bcommits?\W{0,3}[0-9a-f]{7,40}\b|\b[0-9a-f]{7,40}\W{0,3}commit\b")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def manual_files() -> list[Path]:
    return [p for p in sorted(DOCS.rglob("*.md")) if LOG not in p.parents]


def resolving_commits(words: set[str]) -> set[str]:
    """The words that name a commit of this repository (none when git or the history is not there)."""
    if not words:
        return set()
    try:
        query = "".join(f"{w}^{{commit}}\n" for w in sorted(words))
        out = subprocess.run(["git", "cat-file", "--batch-check"], input=query, capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    if out.returncode:
        return set()
    lines = out.stdout.splitlines()
    return {w for w, line in zip(sorted(words), lines) if line.split()[1:2] == ["commit"]}


def test_readme_is_short_and_shows_the_two_commands_before_any_table():
    lines = README.read_text().splitlines()
    assert len(lines) <= 100, f"README.md has {len(lines)} lines; the front door stays at 100 or fewer"
    first_table = next((i for i, line in enumerate(lines) if line.lstrip().startswith("|")), len(lines))
    for command in TWO_COMMANDS:
        where = next((i for i, line in enumerate(lines) if command in line), None)
        assert where is not None, f"README.md does not show `{command}`"
        assert where < first_table, f"`{command}` (line {where + 1}) comes after a table (line {first_table + 1})"


def test_the_manual_has_no_commit_hashes_or_dates():
    """Outside docs/measurements/ nothing dates: no YYYY-MM-DD, no commit of this repository (a hex word git resolves,
    or any 7+ hex characters next to the word "commit")."""
    found, words = [], {}
    for path in manual_files():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            found += [f"{where}: date {m.group(0)}" for m in DATE.finditer(line)]
            found += [f"{where}: commit {m.group(0)!r}" for m in NEXT_TO_COMMIT.finditer(line)]
            for m in HEX.finditer(line):
                words.setdefault(m.group(0), []).append(where)
    for word in resolving_commits(set(words)):
        found += [f"{where}: commit hash {word}" for where in words[word]]
    assert not found, "the manual carries dates or commits (they belong in docs/measurements/):\n" + "\n".join(found)


def entries(path: Path) -> list[tuple[str, str]]:
    """(heading, text) of every `## ` section of a log file; the text before the first one counts as an entry too
    when it holds a table (a file written whole by a script, e.g. sweep_da.md)."""
    text = path.read_text()
    code_free = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # same offsets, no headings in code
    starts = [m.start() for m in re.finditer(r"^## ", code_free, re.M)]
    head = text[:starts[0]] if starts else text
    out = [(head.splitlines()[0], head)] if re.search(r"^\|", head, re.M) else []
    for a, b in zip(starts, [*starts[1:], len(text)]):
        out.append((text[a:].splitlines()[0], text[a:b]))
    return out


COMMAND = re.compile(r"(`|^ {4}).*?\b(python|bash|torchrun)\b", re.M)
COMMIT = re.compile(r"(?i)\bcommits?\b[^\n]{0,60}?\b[0-9a-f]{7,40}\b")
MACHINE = re.compile(r"(?i)\bmachines?\b[^\n]{0,80}?(AMD|Intel|EPYC|Xeon|NVIDIA|GPU|H100|H200|A100|CPU|core)")


def test_every_measurement_names_its_command_commit_machine_and_date():
    files = [p for p in sorted(LOG.glob("*.md")) if p.name != "README.md"]
    assert files, "docs/measurements/ holds no log files"
    missing = []
    for path in files:
        for heading, text in entries(path):
            lacks = [what for what, pattern in (("command", COMMAND), ("commit", COMMIT), ("machine", MACHINE),
                                                ("date", DATE)) if not pattern.search(text)]
            if lacks:
                missing.append(f"{path.relative_to(ROOT)} {heading!r}: no {', '.join(lacks)}")
    assert not missing, "measurement entries without their provenance:\n" + "\n".join(missing)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", path.read_text()), re.M):
        base = slug(m.group(1).replace("`", ""))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_every_relative_link_resolves():
    """README.md and docs/**/*.md: every relative link and image names an existing file, and an anchor into a
    markdown file names one of its headings."""
    broken = []
    for path in markdown_files():
        for m in LINK.finditer(FENCE.sub("", path.read_text())):  # a link's text may hold `code`: keep inline code
            target = m.group(1)
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no heading with that anchor in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize(("doc", "section"), [("retrieval.md", "compare"), ("serving.md", "codecs")])
def test_the_log_keeps_the_sections_the_scripts_fill(doc, section):
    """`experiments.compare --report-to` and `benchmarks.codecs --report-to` fill these marked sections."""
    from benchmarks.harness import check_markers

    check_markers(LOG / doc, section)


def test_what_the_scripts_write_into_the_log_passes_its_check():
    """The provenance line benchmarks and experiments write beside their tables (``measured_on``) names a
    command, commit, machine and date as the entry check reads them."""
    from benchmarks.harness import environment, measured_on

    env = {**environment(), "commit": "0123abc"}  # a checkout without git history says "unknown"
    line = f"`python -m benchmarks.codecs --ckpt m.pt` — {measured_on(env)}"
    assert all(p.search(line) for p in (COMMAND, COMMIT, MACHINE, DATE)), line
