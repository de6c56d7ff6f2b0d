"""The size rules of the tree (issues 39 and 48): no module of ``hvd_spark/`` over 600 lines, and no
function body over 80 lines (its signature and docstring aside) anywhere in ``hvd_spark/``. A module
or a function that outgrows them is split along what it does (named steps; small frozen records where
several values travel between them)."""

import ast
import pathlib

import hvd_spark

ROOT = pathlib.Path(hvd_spark.__file__).parent
MODULE_LINES = 600
BODY_LINES = 80


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def long_functions(path: pathlib.Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({_body_lines(node)} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > limit
    ]


def test_no_module_is_over_600_lines():
    long = sorted(
        f"{p.relative_to(ROOT.parent)} ({n} lines)"
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MODULE_LINES
    )
    assert long == [], f"split these modules by what they do: {long}"


def test_no_function_body_is_over_80_lines():
    files = sorted(ROOT.rglob("*.py"))
    assert ROOT / "_internal" / "rank" / "train.py" in files  # every package, the ranks' code too
    long = [f for p in files for f in long_functions(p, BODY_LINES)]
    assert long == [], f"split these functions along their steps: {long}"


def test_the_rule_counts_a_body_without_its_docstring(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    src = tmp_path / "m.py"
    src.write_text(
        f'def f(\n    a,\n):\n    """Doc\n\n    more."""\n{body}\n\n\ndef g():\n    """Doc."""\n    return 1\n'
    )
    tree = ast.parse(src.read_text())
    f, g = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert (_body_lines(f), _body_lines(g)) == (81, 1)
