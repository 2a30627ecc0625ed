"""tests/gpu runs only on a GPU machine, whose time is scarce; a name it patches that was renamed or
moved fails there at once (run 64: `graphs.INPUT_LIMIT`, moved to `call_keys`). So every
``monkeypatch.setattr(<imported name>, "<attribute>", ...)`` in tests/gpu is checked here: the
attribute exists where the test patches it. And a file there that pytest does not collect (run by another
in a process of its own) is imported here, so a stale import in it fails on the CPU too."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

GPU_TESTS = sorted((Path(__file__).parents[1] / "gpu").glob("*.py"))


def _imported(tree: ast.Module) -> dict[str, tuple[str, str | None]]:
    """A file's top-level names bound by imports: name -> (module, attribute or None)."""
    names: dict[str, tuple[str, str | None]] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = (alias.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = (node.module, alias.name)
    return names


def _patches(path: Path) -> list[tuple[object, str, int]]:
    """(the patched object, the attribute, its line) for each ``monkeypatch.setattr(obj, "name", ...)``
    whose object is an imported name or an attribute path from one."""
    tree = ast.parse(path.read_text())
    imported, found = _imported(tree), []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "monkeypatch"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            continue
        chain, target = [], node.args[0]
        while isinstance(target, ast.Attribute):
            chain.insert(0, target.attr)
            target = target.value
        if isinstance(target, ast.Name) and target.id in imported:
            module, attribute = imported[target.id]
            obj = importlib.import_module(module)
            for name in ([attribute] if attribute else []) + chain:
                obj = getattr(obj, name)
            found.append((obj, node.args[1].value, node.lineno))
    return found


@pytest.mark.parametrize("path", GPU_TESTS, ids=lambda p: p.name)
def test_what_a_gpu_test_patches_exists(path: Path) -> None:
    missing = [f"{path.name}:{line}: {getattr(obj, '__name__', obj)}.{name}"
               for obj, name, line in _patches(path) if not hasattr(obj, name)]
    assert not missing, missing


def test_the_check_finds_the_patches() -> None:
    """The scan reads the patches it is meant to check (and so would see a stale one)."""
    patched = {name for path in GPU_TESTS for _obj, name, _line in _patches(path)}
    assert {"INPUT_LIMIT", "_launch_failed", "PACK_BELOW", "_scaled_mm"} <= patched


@pytest.mark.parametrize("path", [p for p in GPU_TESTS if not p.name.startswith("test_")], ids=lambda p: p.name)
def test_a_gpu_script_pytest_does_not_collect_imports(path: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"gpu_script_{path.stem}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
