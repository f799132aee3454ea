"""Calls stay swap-safe (STYLE point 15): no function in `pipeline/` takes more than 7 positional parameters and no
call passes more than 7 positional arguments. More values travel in a dataclass built by keyword (`Sampled`,
`Produced`, `ServerStart`, ...) or as keyword-only parameters, so two ints cannot be swapped unnoticed."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA_DIRS = ("pipeline/examples", "pipeline/slurm")  # links to examples/ and slurm/: user code and templates
MAX_POSITIONAL = 7

_TYPER = "a typer command: typer maps each parameter to a CLI argument or option by its name, nobody calls it"
ALLOWED: dict[tuple[str, str], str] = {
    ("pipeline/cli.py", "launch"): _TYPER,
    ("pipeline/cli.py", "inspect"): _TYPER,
    ("pipeline/cli.py", "diff"): _TYPER,
    ("pipeline/cli.py", "make_tiny_model_cmd"): _TYPER,
    ("pipeline/trainer/megatron/sdpa_attention.py", "SDPAAttention.__init__"): (
        "megatron-core builds the `core_attention` module itself, passing its DotProductAttention's arguments "
        "in this order"
    ),
}
"""Functions allowed more than 7 positional parameters (by file and qualified name), each with its reason."""

LOGGING_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "log"}
"""`log.info(fmt, a, b, ...)`: the arguments follow the format string's placeholders, not named parameters."""


def _files() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(tuple(d + "/" for d in DATA_DIRS)):
            yield rel, ast.parse(path.read_text(), filename=rel)


def _positional(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    params = [*node.args.posonlyargs, *node.args.args]
    if params and params[0].arg in ("self", "cls"):
        params = params[1:]
    return len(params)


def _is_logging(call: ast.Call) -> bool:
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr in LOGGING_METHODS and isinstance(func.value, ast.Name)


class _Scan(ast.NodeVisitor):
    """The functions of one file with their qualified names, and the calls with too many positional arguments."""

    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.scope: list[str] = []
        self.defs: dict[str, int] = {}
        self.wide_calls: list[str] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.defs[".".join([*self.scope, node.name])] = _positional(node)
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        count = sum(not isinstance(arg, ast.Starred) for arg in node.args)
        if count > MAX_POSITIONAL and not _is_logging(node):
            self.wide_calls.append(f"{self.rel}:{node.lineno} {ast.unparse(node.func)}(...) with {count} positional")
        self.generic_visit(node)


def _scans() -> list[_Scan]:
    scans = []
    for rel, tree in _files():
        scan = _Scan(rel)
        scan.visit(tree)
        scans.append(scan)
    return scans


def test_no_function_takes_more_than_7_positional_parameters() -> None:
    wide = [
        f"{scan.rel} {name}: {count} positional parameters"
        for scan in _scans()
        for name, count in scan.defs.items()
        if count > MAX_POSITIONAL and (scan.rel, name) not in ALLOWED
    ]
    assert not wide, "group the values in a frozen dataclass, or make the rest keyword-only:\n" + "\n".join(wide)


def test_no_call_passes_more_than_7_positional_arguments() -> None:
    wide = [call for scan in _scans() for call in scan.wide_calls]
    assert not wide, "pass them by keyword (a dataclass: build it by keyword):\n" + "\n".join(wide)


def test_every_allowed_function_still_needs_its_entry() -> None:
    defs = {(scan.rel, name): count for scan in _scans() for name, count in scan.defs.items()}
    stale = [f"{rel} {name}" for rel, name in ALLOWED if defs.get((rel, name), 0) <= MAX_POSITIONAL]
    assert not stale, "remove these from ALLOWED (gone, or no longer wide):\n" + "\n".join(stale)


def test_the_scan_sees_what_it_must_refuse() -> None:
    source = """
class A:
    def m(self, a, b, c, d, e, f, g, h): ...
def fine(a, b, c, d, e, f, g, *, h, i): ...
log.info("%s %s %s %s %s %s %s %s", 1, 2, 3, 4, 5, 6, 7, 8)
f(1, 2, 3, 4, 5, 6, 7, 8)
f(1, 2, 3, 4, 5, 6, 7, *rest)
"""
    scan = _Scan("example.py")
    scan.visit(ast.parse(source))
    assert scan.defs == {"A.m": 8, "fine": 7}
    assert scan.wide_calls == ["example.py:6 f(...) with 8 positional"]
