"""Pytest plugin: a session-wide in-process ComfyUI (register as ``comfyhost.fixtures``).

ComfyUI's globals allow one set-up per process, so the ``comfy`` fixture is session-scoped and
every test shares the same nodes, executor cache and loaded models (call ``comfy.free()`` when a
test needs a clean slate). Tests are skipped when no ComfyUI tree is available.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from comfyhost import harness


@pytest.fixture(scope="session")
def comfy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.ComfyHost]:
    """The process's ComfyUI host, with this repository linked into ``custom_nodes``."""
    try:
        harness.find_comfyui()
    except harness.ComfyUnavailable as exc:
        pytest.skip(str(exc))
    host = harness.setup(tmp_path_factory.mktemp("comfy_base"))
    yield host
    host.interrupt(False)
