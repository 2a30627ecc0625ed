"""A throwaway output node that records the live values it receives, for integration tests.

Why a factory: ComfyUI keeps node instances between prompts, so each test module registers its
own class (a shared one would let a cached instance write into another module's list).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def capture_class(key: str = "slot", key_type: str = "INT") -> type:
    """An output node ``(value: any socket, <key>) -> seen.append((key, value))``."""
    default: Any = 0 if key_type == "INT" else ""

    class Capture:
        seen: list[tuple[Any, Any]] = []
        RETURN_TYPES = ()
        OUTPUT_NODE = True
        FUNCTION = "run"
        CATEGORY = "testing"

        @classmethod
        def INPUT_TYPES(cls) -> dict[str, Any]:
            return {"required": {"value": ("*",), key: (key_type, {"default": default})}}

        @classmethod
        def IS_CHANGED(cls, **_: Any) -> float:
            return float("nan")  # never cached: every prompt records afresh

        def run(self, value: Any, **keyed: Any) -> dict[str, Any]:
            self.seen.append((keyed[key], value))
            return {}

    return Capture


def capture_fixtures(name: str, node: type) -> tuple[Callable, Callable]:
    """The pytest fixtures a test module binds at module level: ``capture_node`` registers
    ``node`` as ``name`` in ComfyUI's node table for the module; ``captured`` is its cleared
    ``seen`` list for one test. (pytest is imported here: the bench loads this file without it.)"""
    import pytest

    @pytest.fixture(scope="module")
    def capture_node(comfy: Any):
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(comfy.nodes.NODE_CLASS_MAPPINGS, name, node)
            yield

    @pytest.fixture
    def captured(capture_node: None) -> list[tuple[Any, Any]]:
        node.seen.clear()
        return node.seen

    return capture_node, captured
