"""A throwaway output node that records the live values it receives, for integration tests.

Why a factory: ComfyUI keeps node instances between prompts, so each test module registers its
own class (a shared one would let a cached instance write into another module's list).
"""

from __future__ import annotations

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
