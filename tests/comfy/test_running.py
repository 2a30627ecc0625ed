"""The run lifecycle every generate node shares (``nodes/running.py``): placed before the call,
ended after it whether the call returned, failed or was cancelled."""

from __future__ import annotations

import importlib
from contextlib import nullcontext
from typing import Any

import pytest
from comfyhost import harness

pytest_plugins = ["comfyhost.fixtures"]


class Handle:
    """A stand-in pipe handle recording what the run asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def prepare(self, memory_required: int = 0) -> None:
        self.calls.append("prepare")

    def finish(self) -> None:
        self.calls.append("finish")


@pytest.fixture(scope="module")
def running(comfy: harness.ComfyHost) -> Any:
    return comfy.pack_submodule("nodes.running")


def _interrupt(comfy: harness.ComfyHost) -> BaseException:
    return importlib.import_module("comfy.model_management").InterruptProcessingException()


@pytest.mark.parametrize("outcome", ["returns", "fails", "is cancelled"])
def test_the_run_is_placed_before_and_ended_after_the_call(comfy: harness.ComfyHost, running: Any,
                                                           outcome: str) -> None:
    handle = Handle()
    raised = {"returns": None, "fails": RuntimeError("boom"), "is cancelled": _interrupt(comfy)}[outcome]

    with pytest.raises(type(raised)) if raised else nullcontext(), running.Run(handle, None):
        handle.calls.append("call")
        if raised:
            raise raised

    assert handle.calls == ["prepare", "call", "finish"]


def test_notes_are_joined_and_shown_on_the_node(comfy: harness.ComfyHost, running: Any) -> None:
    run = running.Run(Handle(), "7")
    assert run.show([]) == ""
    assert run.show(["width 40 → 32", "height 24 → 32"]) == "width 40 → 32\nheight 24 → 32"

