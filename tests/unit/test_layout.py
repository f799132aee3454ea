"""The package's rooms (docs/architecture.md, "Folders"): which folder may import which, how many flat modules
`pipeline/` keeps, and which file names are used twice. Imports made lazily inside functions count too: they
hide an arrow, they do not remove it."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "stages", "schemas")
DATA_DIRS = ("pipeline/examples", "pipeline/slurm")  # links to examples/ and slurm/: user code and templates

# Each folder's layer: a module may import its own folder, its folder's parent or children (one room), and any
# folder of a lower layer. Two folders of one layer are peers that never import each other (rollout and
# trainer, the hf and vllm backends, the engine's client and server sides).
LAYERS: dict[str, int] = {
    "pipeline.errors": 0,
    "pipeline.templates": 0,  # chat templates, package data only
    "schemas": 1,
    "pipeline.run": 2,
    "pipeline.net": 3,
    "pipeline.engine": 4,
    "pipeline.engine.client": 5,
    "pipeline.engine.server": 5,
    "pipeline.engine.server.hf": 6,
    "pipeline.engine.server.vllm": 6,
    "pipeline.engine.inference": 7,
    "pipeline.proxy": 8,
    "pipeline.agents": 9,
    "pipeline.eval": 10,
    "pipeline.rollout": 11,
    "pipeline.trainer": 11,
    "pipeline.launch": 12,
    "pipeline.analysis": 13,
    "pipeline.demo": 14,
    "pipeline.client": 15,
    "stages": 16,
    "pipeline.cli": 17,
}
FLAT_MODULES = {"cli.py", "errors.py", "client.py"}  # the command line, the errors it prints, the agents' SDK


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            rel = path.relative_to(REPO)
            if any(str(rel).startswith(d + "/") for d in DATA_DIRS):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, at the top or inside a function, resolved to the longest known module."""
    known = _modules()
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        for target in targets:
            parts = target.split(".")
            for i in range(len(parts), 0, -1):
                if ".".join(parts[:i]) in known:
                    found.add(".".join(parts[:i]))
                    break
    return found - {name}


def _folder(module: str) -> str:
    """The room a module belongs to: the longest folder of `LAYERS` that holds it."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in LAYERS:
            return ".".join(parts[:i])
    raise AssertionError(f"{module} is in no folder of LAYERS: give its folder a layer (and a row in the docs)")


def test_every_import_points_down_or_stays_in_its_room() -> None:
    wrong = []
    for name, path in _modules().items():
        if name == "pipeline":  # the package's empty __init__
            continue
        src = _folder(name)
        for target in _imports(name, path):
            dst = _folder(target)
            same_room = dst == src or dst.startswith(src + ".") or src.startswith(dst + ".")
            if not same_room and LAYERS[dst] >= LAYERS[src]:
                wrong.append(f"{name} ({src}, layer {LAYERS[src]}) imports {target} ({dst}, layer {LAYERS[dst]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_module_import_circle() -> None:
    graph = {name: _imports(name, path) for name, path in _modules().items()}
    # A package's __init__ re-exporting its children is not a circle worth reporting.
    graph = {a: {b for b in bs if not b.startswith(a + ".") and not a.startswith(b + ".")} for a, bs in graph.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            assert state.get(nxt) != 1, "import circle: " + " -> ".join([*trail[trail.index(nxt) :], node, nxt])
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [])


def test_pipeline_keeps_few_flat_modules() -> None:
    flat = {p.name for p in (REPO / "pipeline").glob("*.py") if p.name != "__init__.py"}
    assert flat == FLAT_MODULES


def test_a_file_name_is_used_at_most_twice_and_each_pair_is_named_in_the_docs() -> None:
    names = Counter(Path(m.replace(".", "/")).name for m, p in _modules().items() if p.name != "__init__.py")
    assert [n for n, c in names.items() if c > 2] == []
    doc = (REPO / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)\.py` \|", doc, re.M))
    twice = {n for n, c in names.items() if c == 2}
    assert twice == listed, f"pairs not in docs/architecture.md: {twice - listed}; listed but gone: {listed - twice}"


def test_every_folder_is_described_in_the_docs() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    missing = [f for f in LAYERS if f.startswith("pipeline.") and f"`{f.replace('.', '/')}" not in doc]
    assert not missing, f"folders with no row in docs/architecture.md: {missing}"


_CODE_PATH = re.compile(r"(?<![\w/.-])((?:pipeline|stages|schemas|benchmarks|scripts|tests)/[\w/.{},*-]*[\w*])")
_MADE_BY_TESTS = {"tests/artifacts/viewer_step.png"}  # the viewer's browser test keeps its screenshot there


def _expand(path: str) -> list[str]:
    """`pipeline/engine/{registry,tokens}.py` -> both paths."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[: m.start()] + alt + path[m.end() :])]


def test_every_code_path_in_the_docs_and_readme_exists() -> None:
    docs = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
    missing = []
    for doc in docs:
        for match in _CODE_PATH.finditer(doc.read_text()):
            for path in _expand(match.group(1)):
                if path in _MADE_BY_TESTS or any(REPO.glob(path)) or (REPO / (path + ".py")).exists():
                    continue
                missing.append(f"{doc.name}: {path}")
    assert not missing, "paths in the docs that do not exist:\n" + "\n".join(missing)
