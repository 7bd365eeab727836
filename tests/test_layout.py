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
