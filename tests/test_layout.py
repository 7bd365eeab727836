"""Library vs app: mmgeo/ never imports the entry points, and importing it does no work."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_library_never_imports_the_apps():
    for path in (ROOT / "mmgeo").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in {"train", "eval", "serve"}, f"{path} imports {name}"


def test_import_mmgeo_is_lazy():
    code = "import sys, mmgeo; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["False", "False"]


APP_FILES = ("train.py", "eval.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(dirs: tuple[str, ...] = ("mmgeo", "serve")) -> dict[str, Path]:
    files = [p for d in dirs for p in (ROOT / d).rglob("*.py")] + [ROOT / f for f in APP_FILES]
    return {_module_name(p): p for p in files}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import in the file, top-level or inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:  # `from pkg import sub` imports the submodule pkg.sub
                sub = f"{node.module}.{a.name}"
                out.append((sub, []) if sub in modules else (node.module, [a.name]))
    return [(m, names) for m, names in out if m in modules]


def test_no_import_cycles():
    """Every import counts, lazy ones inside functions too: a cycle through a lazy import is still a cycle.
    Benchmarks count as the package ``benchmarks`` (``benchmarks.X``)."""
    modules = _sources(("mmgeo", "serve", "benchmarks"))
    graph = {m: {dep for dep, _ in _imports(p, modules)} - {m} for m, p in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_private_names_cross_modules():
    """`from a import _x` only inside a's own package; a private module (`_common`) only from its package."""
    modules = _sources()
    bad = []
    for m, path in modules.items():
        package = m.rsplit(".", 1)[0]
        for dep, names in _imports(path, modules):
            private_mod = [part for part in dep.split(".") if part.startswith("_") and part != "__init__"]
            if private_mod and not m.startswith(dep.rsplit(".", 1)[0]):
                bad.append(f"{m} imports private module {dep}")
            bad += [f"{m} imports {dep}.{n}" for n in names if n.startswith("_") and dep.rsplit(".", 1)[0] != package]
    assert not bad, bad


def test_nothing_imports_train_py():
    """train.py is an entry point over mmgeo.training: no module, benchmark or test imports it."""
    files = [p for d in ("mmgeo", "serve", "benchmarks", "tests", "scripts") for p in (ROOT / d).rglob("*.py")]
    bad = []
    for path in files + [ROOT / f for f in APP_FILES]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] == "train"]
    assert not bad, bad


def _code_files() -> list[Path]:
    dirs = ("mmgeo", "serve", "benchmarks", "tests", "scripts")
    return [p for d in dirs for p in (ROOT / d).rglob("*.py")] + [ROOT / f for f in APP_FILES]


def test_design_references_resolve_to_docs_design_md():
    """Code cites the repository's own docs/design.md (§N = its section N), never a file outside the repository
    or an issue number a reader cannot open."""
    import re

    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md").read_text(), flags=re.M))
    bad = []
    for path in _code_files():
        if path == Path(__file__).resolve():
            continue  # this test spells out the patterns it looks for
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            if re.search(r"\bDESIGN\b|\bissues? ?#?\d", line):
                bad.append(f"{where}: {line.strip()[:80]}")
            for ref in re.findall(r"docs/design\.md ((?:§\d+(?:\.\d+)*(?:, )?)+)", line):
                bad += [f"{where}: §{s} is not a section of docs/design.md"
                        for s in re.findall(r"§(\d+)", ref) if s not in sections]
            if "§" in line and "docs/design.md §" not in line:
                bad.append(f"{where}: a § reference that names no document: {line.strip()[:80]}")
    assert not bad, "\n".join(bad)


TOP_LEVEL_MODULES = {"__init__.py", "config.py", "io.py"}  # shared by every package (docs/design.md §7)


def test_nothing_loose_at_the_top_of_mmgeo():
    """Every module lives in its package (kernels, layers, models, data, search, eval, training); only what all of
    them share stays at the top: the config loader and atomic file writing."""
    loose = {p.name for p in (ROOT / "mmgeo").iterdir() if p.is_file()}
    assert loose == TOP_LEVEL_MODULES, f"loose at the top of mmgeo/: {sorted(loose - TOP_LEVEL_MODULES)}"


def test_search_needs_no_evaluation_code():
    """mmgeo.search is the service's engine: it never imports mmgeo.eval, and its two-stage search never imports
    the gallery writers (build); evaluation imports search, not the other way round."""
    modules = _sources()
    bad = []
    for m, path in modules.items():
        if not m.startswith("mmgeo.search"):
            continue
        for dep, _ in _imports(path, modules):
            if dep.startswith("mmgeo.eval") or (m == "mmgeo.search.two_stage" and dep == "mmgeo.search.build"):
                bad.append(f"{m} imports {dep}")
    assert not bad, bad


def _is_sys_path(node) -> bool:
    """``sys.path`` (or ``sys.path[...]``)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def test_nothing_edits_sys_path():
    """Imports resolve from the installed package and the repository root (``python -m``, pytest's rootdir), never
    from a path a file pushes onto sys.path: no call on sys.path (insert, append, ...), no assignment to it."""
    bad = []
    for path in _code_files():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            edits = any(_is_sys_path(t) for t in targets) or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value))
            if edits:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "sys.path edited at " + ", ".join(bad)
