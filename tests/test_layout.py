"""The house (docs/architecture.md): which floor may import which, read from the source with `ast`.

Every import counts, at module level or inside a function (lazy) or under TYPE_CHECKING, and so does
a module path handed to `importlib.import_module` or a lazy-export table as a string.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Folder -> the package it installs as (pyproject.toml's package-dir).
FLOORS = {
    "scorestack": "scorestack",
    "compile": "scorestack.compile",
    "serve": "scorestack.serve",
    "features": "scorestack.features",
    "client": "scorestack.client",
    "demo": "scorestack.demo",
    "cli": "scorestack.cli",
}
STAGES = ("compile", "serve", "features", "client")
ON_TOP = ("demo", "cli")

# What each stage may import besides the ground floor (`scorestack/`). A folder depends on folders to
# its left in the path of a prediction: compile's output (model folders, their reports and specs) is
# read downstream by client's diagnosis; compile verifies candidates through serve's runtime and the
# local Triton on purpose (one runtime, verified where it runs); features stands alone; client
# calls Triton and fetches features.
ALLOWED = {
    "serve": set(),
    "compile": {"serve"},
    "features": set(),
    "client": {"serve", "features", "compile"},
}

# The ground floor holds only the vocabulary every stage shares.
VOCABULARY = {"__init__.py", "_lazy.py", "errors.py", "extras.py", "limits.py", "paths.py", "schema.py", "triton_config.py", "validation.py"}

_MODULE_PATH = re.compile(r"scorestack(\.[A-Za-z_][A-Za-z0-9_]*)+")


def _package(path: Path) -> str:
    """The dotted package a file belongs to (`compile/passes.py` -> `scorestack.compile`)."""
    rel = path.relative_to(ROOT)
    parts = [FLOORS[rel.parts[0]], *rel.parts[1:-1]]
    return ".".join(parts)


def _floor(module: str) -> str:
    """Which floor a dotted module lives on: a stage, `demo`, `cli`, or `scorestack` (the ground floor)."""
    parts = module.split(".")
    if parts[0] != "scorestack":
        return ""
    if len(parts) > 1:
        for folder, package in FLOORS.items():
            if folder != "scorestack" and parts[1] == package.split(".")[1]:
                return folder
    return "scorestack"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every scorestack module the file imports, however it imports it."""
    return read_imports(path.read_text(), _package(path), str(path))


def read_imports(source: str, package: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, dotted module) of every scorestack module `source` (a module of `package`) imports."""
    tree = ast.parse(source, filename=filename)
    found: list[tuple[int, str]] = []
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from scorestack import demo` imports the room: each name may be a module.
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _MODULE_PATH.fullmatch(node.value):
                found.append((node.lineno, node.value))
    return [(line, m) for line, m in found if m.split(".")[0] == "scorestack"]


def _files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _violations(folders: tuple[str, ...], forbidden) -> list[str]:
    out = []
    for folder in folders:
        for path in _files(folder):
            for line, module in imports(path):
                target = _floor(module)
                if forbidden(folder, target):
                    out.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({folder} -> {target})")
    return out


def test_the_import_reader_sees_every_kind_of_import():
    """The reader itself: lazy, TYPE_CHECKING, relative, `from scorestack import <floor>` and string imports."""
    source = '''"""scorestack.demo in a docstring is not an import."""
from typing import TYPE_CHECKING
from .triton import TritonClient
from scorestack import demo
if TYPE_CHECKING:
    from scorestack.cli.errors import fail
def f():
    import scorestack.compile.spec
    from .. import features
    return importlib.import_module("scorestack.demo.traffic")
'''
    got = [m for _, m in read_imports(source, "scorestack.client")]
    assert got == [
        "scorestack.client.triton.TritonClient",
        "scorestack.demo",
        "scorestack.cli.errors.fail",
        "scorestack.compile.spec",
        "scorestack.features",
        "scorestack.demo.traffic",
    ]
    assert [_floor(m) for m in got] == ["client", "demo", "cli", "compile", "features", "demo"]
    assert _floor("scorestack.schema") == _floor("scorestack.paths") == "scorestack"


def test_no_stage_and_no_ground_floor_module_imports_the_demo_or_the_command_line():
    bad = _violations((*STAGES, "scorestack"), lambda _, target: target in ON_TOP)
    assert bad == []


def test_the_demo_room_does_not_import_the_command_line():
    assert _violations(("demo",), lambda _, target: target == "cli") == []


def test_the_ground_floor_imports_no_stage():
    assert _violations(("scorestack",), lambda _, target: target not in ("", "scorestack")) == []


def test_stages_import_only_the_ground_floor_and_the_stages_they_may_use():
    bad = _violations(STAGES, lambda folder, target: target in STAGES and target != folder and target not in ALLOWED[folder])
    assert bad == []


def test_the_model_runtime_imports_no_scorestack_module():
    """serve/runtime is copied beside each model and runs in the server environment: only its own files are there."""
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {m}"
        for p in _files("serve/runtime")
        for line, m in imports(p)
        if not m.startswith("scorestack.serve.runtime.")
    ]
    assert bad == []


def test_the_room_and_the_command_line_use_the_stages_public_names_only():
    """No `_private` module or name of a stage from the demo room or the command line."""
    bad = []
    for folder in ON_TOP:
        for path in _files(folder):
            for line, module in imports(path):
                parts = module.split(".")
                if _floor(module) in STAGES and any(p.startswith("_") for p in parts[2:]):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert bad == []


def test_the_ground_floor_holds_only_the_shared_vocabulary():
    assert {p.name for p in (ROOT / "scorestack").glob("*.py")} == VOCABULARY
    assert [p.name for p in (ROOT / "scorestack").iterdir() if p.is_dir() and p.name != "__pycache__"] == []


@pytest.mark.parametrize("folder", ["demo", "cli"])
def test_the_floors_on_top_are_installed_packages(folder):
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"{FLOORS[folder]}" = "{folder}"' in pyproject and f'"{FLOORS[folder]}",' in pyproject


def test_the_image_copies_every_installed_folder():
    """The Dockerfile installs the project with `pip install .`: every folder pyproject.toml maps must be in the build."""
    copied = {line.split()[1].rstrip("/") for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")}
    assert set(FLOORS) - copied == set()
