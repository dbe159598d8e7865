"""The package's shape (docs/architecture.md): no import cycles, and the product apart
from its development harness and tooling (harness/, a distribution of its own).

The graph is read from the source with `ast`, every import counted: at module level,
inside functions (a lazy import is still a dependency) and under `TYPE_CHECKING`. grimp
(import-linter's graph) cannot be used here: it walks the root package's directory, and
our folders are mapped into `trainguard` with setuptools' package-dir.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The development harness, a distribution of its own (harness/pyproject.toml): the test
# streams, the scenario scoring, the harms and the oracle (harness/scoring/), and the
# development tooling (harness/devtools/: the local broker launcher, the soak, the stack
# helpers, the demo). Product modules (`trainguard.*`) must never import it.
TOOLING = "harness"
#: The project files whose package-dir maps the modules: the product's and the harness's.
PROJECTS = (ROOT / "pyproject.toml", ROOT / "harness" / "pyproject.toml")


@dataclass(frozen=True)
class ImportGraph:
    modules: dict[str, Path]
    edges: dict[str, set[str]]


def package_dirs() -> dict[str, Path]:
    dirs: dict[str, Path] = {}
    for project in PROJECTS:
        config = tomllib.loads(project.read_text())["tool"]["setuptools"]
        dirs |= {name: (project.parent / folder).resolve() for name, folder in config["package-dir"].items()}
    return dirs


def is_tooling(module: str) -> bool:
    return module == TOOLING or module.startswith(f"{TOOLING}.")


def discover_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in package_dirs().items():
        for path in folder.rglob("*.py"):
            relative = path.relative_to(folder).with_suffix("")
            parts = [p for p in relative.parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    drop = node.level - 1 if path.name == "__init__.py" else node.level
    base = base[: len(base) - drop] if drop else base
    return ".".join(base + ([node.module] if node.module else []))


def _imported_modules(module: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parent = _resolve(module, path, node)
            for alias in node.names:
                # `from a import b` reads the module a.b when there is one, else a name of a.
                yield f"{parent}.{alias.name}" if f"{parent}.{alias.name}" in modules else parent


def build_graph() -> ImportGraph:
    modules = discover_modules()
    edges = {
        name: {m for m in _imported_modules(name, path, modules) if m in modules and m != name}
        for name, path in modules.items()
    }
    return ImportGraph(modules, edges)


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: every component of more than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build_graph()


def test_the_scanner_sees_every_kind_of_import(graph: ImportGraph) -> None:
    # Guards the guard: relative imports two levels up, lazy imports inside functions and
    # imports under TYPE_CHECKING are all edges.
    assert len(graph.modules) > 100
    assert "trainguard.schemas" in graph.edges["trainguard.processors.core.engine"]
    assert "trainguard.cli.app" in graph.edges["harness.devtools.cli"]  # another distribution's
    assert "harness.scoring.prediction" in graph.edges["harness.devtools.cli"]  # from ..scoring
    assert "harness.devtools.local_broker" in graph.edges["harness.devtools.cli"]  # lazy
    assert "trainguard.kafka.security" in graph.edges["trainguard.cli.admin"]  # TYPE_CHECKING


def test_tarjan_finds_a_cycle_and_no_false_one() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(edges) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_the_projects_modules(graph: ImportGraph) -> None:
    cycles = strongly_connected(graph.edges)
    assert cycles == [], "import cycles (type-only and lazy imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_product_never_imports_the_development_tooling(graph: ImportGraph) -> None:
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in graph.edges.items()
        if not is_tooling(module)
        for target in targets
        if is_tooling(target)
    )
    assert offenders == []
    # Guards the guard: the harness's modules are in the graph, where they moved to.
    moved = {f"harness.scoring.{m}" for m in ("evaluate", "harms", "oracle", "capacity", "prediction")}
    assert moved | {"harness.devtools.cli", "harness.devtools.soak"} <= set(graph.modules)
    assert not any(m.startswith(("trainguard.devtools", "trainguard.replay.evaluate")) for m in graph.modules)


#: The rank side and the decisions: they agree through modules both may import (the
#: schemas, trainguard/common: the odd-stack rule, where checkpoints may live, the elastic
#: rule...), never by importing each other (issue 48).
SIDES = ("trainguard.producers", "trainguard.processors")


def _side(module: str) -> str | None:
    return next((side for side in SIDES if module == side or module.startswith(f"{side}.")), None)


def crossings(edges: dict[str, set[str]]) -> list[str]:
    """Every import from one side (SIDES) into the other."""
    return sorted(
        f"{module} imports {target}"
        for module, targets in edges.items()
        for target in targets
        if _side(module) and _side(target) and _side(module) != _side(target)
    )


def test_producers_and_processors_never_import_each_other(graph: ImportGraph) -> None:
    assert crossings(graph.edges) == [], "move the shared rule to trainguard/common or schemas/"
    # Guards the guard: a crossing either way is found, a shared module is not one.
    edges = {
        "trainguard.producers.launcher.hot": {"trainguard.processors.core.detectors.stacks"},
        "trainguard.processors.api": {"trainguard.producers.checkpoint.storage", "trainguard.common.stacks"},
        "trainguard.processors_extra": {"trainguard.producers"},
    }
    assert crossings(edges) == [
        "trainguard.processors.api imports trainguard.producers.checkpoint.storage",
        "trainguard.producers.launcher.hot imports trainguard.processors.core.detectors.stacks",
    ]
    # Both sides reach the shared rules (the scanner sees these edges).
    assert "trainguard.common.stacks" in graph.edges["trainguard.producers.launcher.hot"]
    assert "trainguard.common.stacks" in graph.edges["trainguard.processors.core.detectors.stacks"]
    assert "trainguard.common.checkpoint_location" in graph.edges["trainguard.processors.api"]
    assert "trainguard.common.checkpoint_location" in graph.edges["trainguard.producers.launcher.config"]


def _top_level_imports(path: Path) -> set[str]:
    """The top-level names a file imports (absolute imports only)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_bench_and_the_harness_never_import_the_tests() -> None:
    # Issue 48: what bench shares with the tests lives in harness/, which imports nothing
    # from tests/ either.
    files = [*sorted((ROOT / "bench").rglob("*.py")), *sorted((ROOT / "harness").rglob("*.py"))]
    assert len(files) > 20
    offenders = sorted(str(p.relative_to(ROOT)) for p in files if "tests" in _top_level_imports(p))
    assert offenders == []


def test_the_product_never_imports_the_harness(graph: ImportGraph) -> None:
    offenders = sorted(
        str(path.relative_to(ROOT))
        for module, path in graph.modules.items()
        if not is_tooling(module) and TOOLING in _top_level_imports(path)
    )
    assert offenders == []
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert not any(p.split(".")[0] == "harness" or "harness" in p or "devtools" in p for p in packages)
    # (the wheel's own file list: tests/test_wheel.py)


CHAOS = "trainguard.producers.chaos"


def test_the_product_reaches_chaos_knobs_only_through_their_seam(graph: ImportGraph) -> None:
    # Issue 48: every fault a fire drill can inject is one grep away (producers/chaos).
    offenders = sorted(
        f"{module} imports {target}"
        for module, targets in graph.edges.items()
        if not module.startswith(CHAOS)
        for target in targets
        if target.startswith(CHAOS + ".")
    )
    assert offenders == []
    users = {module for module, targets in graph.edges.items() if CHAOS in targets}
    assert {f"trainguard.producers.{m}" for m in ("launcher.launcher", "training.supervisor")} <= users


def test_docs_architecture_names_every_package_folder(graph: ImportGraph) -> None:
    # docs/architecture.md has a paragraph per folder; a new sub-package gets one too.
    text = (ROOT / "docs" / "architecture.md").read_text()
    folders = {path.parent for name, path in graph.modules.items() if path.name == "__init__.py"}
    missing = sorted(str(folder.relative_to(ROOT)) for folder in folders if f"`{folder.name}/`" not in text)
    assert missing == []


#: Past this, a module is split by concept, or says in its docstring why it is one file.
MAX_LINES = 600


def test_a_module_over_600_lines_says_why_it_is_one_file(graph: ImportGraph) -> None:
    """Issue 16: "no file over ~600 lines, except where splitting would hurt and the file
    says why" (its module docstring names it "one file", with the reason)."""
    unexplained = []
    for module, path in sorted(graph.modules.items()):
        text = path.read_text()
        lines = text.count("\n")
        if lines <= MAX_LINES:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if "one file" not in docstring.lower():
            unexplained.append(f"{module}: {lines} lines, no 'one file' reason in its docstring")
    assert unexplained == []
