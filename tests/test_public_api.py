"""The public API (docs/api.md, issue 48): what the public modules export is what the page
lists, the examples and the README import nothing else, importing the public modules does
not import torch, and every deprecated path the page lists still works and warns with the
new import."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API_PAGE = ROOT / "docs" / "api.md"
PUBLIC_MODULES = ("trainguard", "trainguard.torch", "trainguard.lightning", "trainguard.transformers")
#: The user-facing pages whose snippets a user copies into a training script.
PAGES = (ROOT / "README.md", ROOT / "docs" / "inprocess.md", ROOT / "docs" / "elastic.md", API_PAGE)
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))


def documented() -> dict[str, set[str]]:
    """docs/api.md's public names: each ``### `module` `` heading's table's first column."""
    names: dict[str, set[str]] = {}
    module = None
    for line in API_PAGE.read_text().splitlines():
        if heading := re.fullmatch(r"### `([\w.]+)`", line):
            module = heading[1]
            names[module] = set()
        elif line.startswith("## "):
            module = None
        elif module and (row := re.match(r"\| `(\w+)` \|", line)):
            names[module].add(row[1])
    return names


def deprecated_rows() -> list[tuple[str, str]]:
    """docs/api.md's "Deprecated paths" table: (old dotted path, new dotted path)."""
    section = API_PAGE.read_text().split("## Deprecated paths", 1)[1]
    return re.findall(r"^\| `(trainguard[\w.]+)` \| `(trainguard[\w.]+)` \|$", section, flags=re.M)


def exported(module_name: str) -> set[str]:
    if module_name == "trainguard":
        return {"__version__"}
    return set(importlib.import_module(module_name).__all__)


def private_imports(source: str, public: dict[str, set[str]]) -> list[str]:
    """Every import of trainguard in `source` that is not a public module's public name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("trainguard") and a.name not in public]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainguard"):
            module = node.module or ""
            out += [f"{module}.{a.name}" for a in node.names if a.name not in public.get(module, set())]
    return out


#: An import of trainguard in a page: one line, or a parenthesised list over several.
PAGE_IMPORT = re.compile(
    r"^[ \t]*(from trainguard[\w.]* import (?:\([^)]*\)|[^\n]*)|import trainguard[^\n]*)", re.M
)


def page_snippets(page: Path) -> str:
    """The imports of trainguard in a Markdown page (fenced or indented code alike), each
    on one line, comments dropped."""
    found = (match[1] for match in PAGE_IMPORT.finditer(page.read_text()))
    return "\n".join(" ".join(re.sub(r"#[^\n]*", "", statement).split()) for statement in found)


def test_docs_api_lists_exactly_what_the_public_modules_export() -> None:
    listed = documented()
    assert sorted(listed) == sorted(PUBLIC_MODULES)
    for module in PUBLIC_MODULES:
        assert listed[module] == exported(module), module
        if module != "trainguard":  # __all__ is what the lazy __getattr__ answers
            assert sorted(exported(module)) == sorted(importlib.import_module(module).EXPORTS)


def test_the_checker_catches_a_private_import() -> None:
    # Guards the guard: a deep path, an unlisted name and a private module are all caught.
    public = documented()
    source = textwrap.dedent(
        """
        from trainguard.torch import Supervisor, RankAgent
        from trainguard.producers.checkpoint.manager import CheckpointManager
        import trainguard.producers.training.inprocess
        import trainguard.torch
        """
    )
    assert private_imports(source, public) == [
        "trainguard.torch.RankAgent",
        "trainguard.producers.checkpoint.manager.CheckpointManager",
        "trainguard.producers.training.inprocess",
    ]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_examples_import_only_public_names(example: Path) -> None:
    assert private_imports(example.read_text(), documented()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_pages_snippets_import_only_public_names(page: Path) -> None:
    snippets = page_snippets(page)
    assert private_imports(snippets, documented()) == []


def test_the_readme_example_shows_its_imports() -> None:
    # and the page reader sees a parenthesised import whole (guards the guard)
    snippets = page_snippets(ROOT / "README.md")
    assert "from trainguard.torch import ( CheckpointManager, ResumableSampler," in snippets
    spread = "from trainguard.torch import (\n  Supervisor,  # x\n  RankAgent,\n)"
    assert private_imports(spread, documented()) == ["trainguard.torch.RankAgent"]


def test_the_examples_use_every_public_module_between_them() -> None:
    # The callbacks' examples are what a Lightning or HF user copies: they use the public
    # modules, so the checker above has something to check.
    imported = {
        node.module
        for example in EXAMPLES
        for node in ast.walk(ast.parse(example.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainguard")
    }
    assert imported == {"trainguard.torch", "trainguard.lightning", "trainguard.transformers"}


def run_script(tmp_path: Path, source: str, timeout: float = 240) -> dict[str, object]:
    """`source` run as a user's script (``__main__``, outside the repository), its last
    stdout line read as JSON."""
    script = tmp_path / "user_script.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_importing_the_public_modules_imports_no_torch_until_a_name_is_read(tmp_path: Path) -> None:
    result = run_script(
        tmp_path,
        textwrap.dedent(
            """
            import json, sys
            import trainguard, trainguard.torch, trainguard.lightning, trainguard.transformers
            from trainguard import torch as public
            seen = {"listed": sorted(dir(public))}
            heavy = ("torch", "pytorch_lightning", "transformers", "trainguard.producers.training.supervisor")
            seen["after_import"] = [m for m in heavy if m in sys.modules]
            from trainguard.torch import CheckpointManager
            seen["after_read"] = [m for m in heavy if m in sys.modules]
            print(json.dumps(seen))
            """
        ),
    )
    assert result["after_import"] == []
    assert "CheckpointManager" in result["listed"]  # type: ignore[operator]
    assert "torch" in result["after_read"]  # type: ignore[operator]
    assert "pytorch_lightning" not in result["after_read"]  # type: ignore[operator]


def test_every_deprecated_path_works_and_warns_with_the_new_import(tmp_path: Path) -> None:
    rows = deprecated_rows()
    assert len(rows) >= 20
    checks = []
    for i, (old, new) in enumerate(rows):
        old_module, _, old_name = old.rpartition(".")
        new_module, _, new_name = new.rpartition(".")
        checks.append(
            f"""
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from {old_module} import {old_name} as old_{i}
from {new_module} import {new_name} as new_{i}
report({old!r}, old_{i} is new_{i}, caught, "from {new_module} import {new_name}")
"""
        )
    source = (
        textwrap.dedent(
            """
            import json, pickle, warnings

            results = {}

            def report(path, same, caught, new_import):
                texts = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
                files = {w.filename for w in caught}
                warned = any(new_import in t for t in texts)
                results[path] = {"same": same, "warned": warned, "files": sorted(files)}
            """
        )
        + "".join(checks)
        + textwrap.dedent(
            """
            import trainguard.producers.training.supervisor as deep
            with warnings.catch_warnings(record=True) as attribute:
                warnings.simplefilter("always")
                deep.Supervisor
            with warnings.catch_warnings(record=True) as quiet:
                warnings.simplefilter("always")
                from trainguard.torch import Supervisor, inprocess
                from trainguard.lightning import TrainguardLightningCallback
                pickle.loads(pickle.dumps(Supervisor))
                hasattr(deep, "Supervisor")
                import trainguard.producers.training.hf_trainer  # its own imports of the deep paths
            results["attribute"] = [str(w.message) for w in attribute]
            results["quiet"] = [str(w.message) for w in quiet]
            print(json.dumps(results))
            """
        )
    )
    result = run_script(tmp_path, source)
    script = str(tmp_path / "user_script.py")
    for old, _ in rows:
        entry = result[old]
        assert entry == {"same": True, "warned": True, "files": [script]}, (old, entry)
    attribute = result["attribute"]
    assert isinstance(attribute, list) and len(attribute) == 1
    assert "from trainguard.torch import Supervisor" in attribute[0]
    assert result["quiet"] == []
