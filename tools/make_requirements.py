"""Write ``requirements.txt`` from ``pyproject.toml``'s ``[project].dependencies``.

Why: the pack declares its dependencies twice by necessity. The Comfy registry publishes
``[project].dependencies``; ComfyUI Manager (and the README's manual install) runs
``pip install -r requirements.txt``. pyproject is the one list; this tool derives the other,
leaving out what ComfyUI itself provides (torch: a pip run must never replace ComfyUI's CUDA
build). Run after changing a dependency:

    .venv/bin/python tools/make_requirements.py

``tests/comfy/test_registry.py`` fails when requirements.txt is not what this tool writes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
REQUIREMENTS = ROOT / "requirements.txt"
HOST_PROVIDED = ("torch",)  # installed with ComfyUI; its floor stays in pyproject only
HEADER = (
    "# Written by tools/make_requirements.py from pyproject.toml [project].dependencies; edit those.\n"
    "# torch is not listed: ComfyUI provides it (pyproject states the floor).\n"
)


def dependencies(pyproject: Path = PYPROJECT) -> list[str]:
    return list(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"])


def distribution(requirement: str) -> str:
    """The normalized distribution name of a PEP 508 requirement (``Foo_Bar>=1`` -> ``foo-bar``)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"not a PEP 508 requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def render(pyproject: Path = PYPROJECT) -> str:
    kept = [dep for dep in dependencies(pyproject) if distribution(dep) not in HOST_PROVIDED]
    return HEADER + "".join(f"{dep}\n" for dep in kept)


def main() -> int:
    REQUIREMENTS.write_text(render(), encoding="utf-8")
    print(f"wrote {REQUIREMENTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
