"""`graph_memory.record`: where a captured call raises, the tensors its frames held are let go
before the capture ends (under cudaMallocAsync a tensor made in a capture and freed after it
aborts the process once its graph is gone: run 65), and the error still says what failed. The
graph is a stand-in (the CPU cannot capture); the GPU check is `tests/gpu/async_allocator_check.py`."""

from __future__ import annotations

import weakref

import pytest
import torch
from diffusers_offload.offload_core.transport import graph_memory


class Graph:
    """Stands in for `torch.cuda.CUDAGraph`: notes its capture's start and end, and at the end
    whether the failed call's tensor was still alive."""

    def __init__(self, watched: list[weakref.ref]) -> None:
        self.watched, self.events = watched, []

    def capture_begin(self, pool, capture_error_mode: str) -> None:
        self.events.append("begin")

    def capture_end(self) -> None:
        self.events.append(("end", [ref() is None for ref in self.watched]))


def forward(watched: list[weakref.ref]) -> torch.Tensor:
    activation = torch.ones(1024)
    watched.append(weakref.ref(activation))
    return inner(activation * 2, watched)


def inner(x: torch.Tensor, watched: list[weakref.ref]) -> torch.Tensor:
    watched.append(weakref.ref(x))
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failing_call_lets_its_tensors_go_before_the_capture_ends() -> None:
    watched: list[weakref.ref] = []
    graph = Graph(watched)
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        graph_memory.record(graph, None, lambda: forward(watched))
    assert graph.events == ["begin", ("end", [True, True])]


def test_the_errors_behind_a_failure_let_their_tensors_go_too() -> None:
    watched: list[weakref.ref] = []

    def call() -> None:
        try:
            forward(watched)
        except RuntimeError as exc:
            raise ValueError("the call's output is not tensors") from exc

    graph = Graph(watched)
    with pytest.raises(ValueError, match="not tensors"):
        graph_memory.record(graph, None, call)
    assert graph.events == ["begin", ("end", [True, True])]


def test_a_call_that_returns_ends_its_capture_once() -> None:
    graph = Graph([])
    graph_memory.record(graph, None, lambda: torch.ones(2))
    assert graph.events == ["begin", ("end", [])]
