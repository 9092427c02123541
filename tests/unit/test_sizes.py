"""Rooms a reader can hold in their head: no module of the shipped code over 800 lines, no function
over 120 (docs/design.md, "Sizes", lists what remains over 80 lines and why).

Measured from the source with `ast` (a function's lines run from its `def` to its last statement,
decorators and docstring included); generated protobuf stubs are not read.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("ntp_manager", "agent", "migrations")  # the packages and the scripts the wheels carry
MODULE_MAX = 800
FUNCTION_MAX = 120
# Explicit exceptions, each with its reason. A listed one that is back under the limit fails the
# test, so the list cannot go stale: delete its line when it is cut up.
EXCEPTIONS: dict[str, str] = {}  # none


def _sources() -> list[Path]:
    out = []
    for top in SHIPPED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "proto" in rel.parts and rel.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            out.append(path)
    return out


def measure(source: str, name: str) -> tuple[int, list[tuple[str, int]]]:
    """(lines of the module, [(qualified function name, lines)] for every function in it)."""
    tree = ast.parse(source)
    funcs: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                funcs.append((f"{name}:{prefix}{child.name}", child.end_lineno - start + 1))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return len(source.splitlines()), funcs


def _over() -> list[str]:
    bad = []
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        lines, funcs = measure(path.read_text(), rel)
        if lines > MODULE_MAX:
            bad.append(f"{rel}: {lines} lines")
        bad += [f"{f}: {n} lines" for f, n in funcs if n > FUNCTION_MAX]
    return sorted(bad)


def test_sources_are_found() -> None:
    names = {str(p.relative_to(ROOT)) for p in _sources()}
    assert "ntp_manager/planner/plan.py" in names
    assert "agent/ntp_agent/core.py" in names
    assert "migrations/versions/0001_initial_schema.py" in names


def test_no_module_or_function_over_the_limits() -> None:
    bad = _over()
    assert [b for b in bad if b.split(": ")[0] not in EXCEPTIONS] == []
    assert sorted(set(EXCEPTIONS) - {b.split(": ")[0] for b in bad}) == []  # a fixed exception leaves the list


def test_the_measure_counts_nested_and_decorated_functions() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(130))  # 130 statements, two levels in
    src = f"class A:\n    @staticmethod\n    def f():\n{body}\n\ndef g():\n    def h():\n{body}\n"
    lines, funcs = measure(src, "m")
    sizes = dict(funcs)
    assert sizes["m:A.f"] == 132  # decorator, def, 130 statements
    assert sizes["m:g.h"] == 131
    assert sizes["m:g"] == 132
    assert lines == len(src.splitlines())
