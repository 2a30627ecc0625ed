"""ComfyUI's pinned-memory limits reach the engine (issue 21.5), read from the real ComfyUI's
``comfy.model_management`` (v0.3.75 or a 2026 tree, whichever the suite runs against).

This host runs with ``--cpu``: ComfyUI sets no cap there (``MAX_PINNED_MEMORY`` stays -1), so the
cap a CUDA start would compute is set on the live module for the second test."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from comfyhost import harness

pytest_plugins = ["comfyhost.fixtures"]
GiB = 2**30


@pytest.fixture(scope="module")
def pack(comfy: harness.ComfyHost) -> SimpleNamespace:
    sub = comfy.pack_submodule
    return SimpleNamespace(host=sub("nodes.host"), memory=sub("offload_core.memory"))


def test_without_a_cap_comfyui_adds_no_pin_limit(comfy: harness.ComfyHost, pack: SimpleNamespace) -> None:
    import comfy.model_management as mm

    assert mm.MAX_PINNED_MEMORY <= 0  # --cpu: ComfyUI pins nothing and caps nothing
    assert pack.host.ComfyMemory().pin_limit() is None


def test_comfyuis_cap_less_its_own_pins_bounds_the_grant_and_is_named(
        comfy: harness.ComfyHost, pack: SimpleNamespace, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import comfy.model_management as mm

    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 8.0 * GiB)  # a float, as ComfyUI computes it
    monkeypatch.setattr(mm, "TOTAL_PINNED_MEMORY", 3 * GiB)
    monkeypatch.setattr(pack.host, "_noted", set())
    reader = pack.host.ComfyMemory()
    with caplog.at_level(logging.INFO):
        limit = reader.pin_limit()
    assert limit.nbytes == 5 * GiB and "ComfyUI's pinned-memory cap 8.00 GiB" in limit.source
    assert any("ComfyUI's pinned-memory cap" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(reader, "host_available", lambda: 1 << 50)
    verdict = pack.memory.pin_budget(20 * GiB, reader, reserve=4 * GiB)
    assert verdict.grant == 5 * GiB and "ComfyUI's pinned-memory cap" in verdict.describe()
