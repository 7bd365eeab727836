"""Ids, vectors, metadata and codes reach SQL only as parameters or COPY data: read from the source of every module
that talks to the database gallery. No statement is ``%``-formatted or an f-string of anything but a loop over
constant names; ``str.format`` composes SQL only from the modules' own constants and what ``psycopg.sql`` quotes
(``Literal``, ``Identifier``)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "mmgeo" / "search").glob("db*.py")) + [ROOT / "mmgeo" / "search" / "database.py"]


def _constant(node) -> bool:
    """A string constant, an UPPER_CASE module constant, or a choice between them."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id.isupper()
    if isinstance(node, ast.IfExp):
        return _constant(node.body) and _constant(node.orelse)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _constant(node.left) and _constant(node.right)
    return False


def _safe_piece(node) -> bool:
    """What may fill a ``.format`` slot: a constant, ``sql.SQL(constant)``, ``sql.Literal(...)`` or
    ``sql.Identifier(...)`` (psycopg quotes those)."""
    if _constant(node):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
        if node.func.attr == "SQL":
            return _constant(node.args[0])
        return node.func.attr in ("Literal", "Identifier")
    return False


def _loop_constants(tree) -> set[str]:
    """Names bound by ``for NAME in (constant, ...)``: what an f-string may name (a table among fixed ones)."""
    return {n.target.id for n in ast.walk(tree) if isinstance(n, ast.For) and isinstance(n.target, ast.Name)
            and isinstance(n.iter, (ast.Tuple, ast.List)) and all(isinstance(e, ast.Constant) for e in n.iter.elts)}


def test_sql_is_composed_from_constants_only():
    bad = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        fixed = _loop_constants(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if node.func.attr in ("execute", "copy") and node.args:
                first = node.args[0]
                parts = list(ast.walk(first))
                if any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in parts) or any(
                        isinstance(n, ast.FormattedValue)
                        and not (isinstance(n.value, ast.Name) and n.value.id in fixed) for n in parts):
                    bad.append(f"{where}: a statement built by % or from an f-string of values")
            if node.func.attr == "format":
                recv = node.func.value
                sql_call = isinstance(recv, ast.Call) and isinstance(recv.func, ast.Attribute) and \
                    recv.func.attr == "SQL" and _constant(recv.args[0])
                if not (_constant(recv) or sql_call):
                    continue  # not SQL (a message)
                pieces = list(node.args) + [k.value for k in node.keywords]
                if not all(_safe_piece(p) for p in pieces):
                    bad.append(f"{where}: SQL .format() with a value that is not a constant or Literal(int(...))")
    assert not bad, bad
    assert len(MODULES) >= 5
