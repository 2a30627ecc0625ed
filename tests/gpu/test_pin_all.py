"""Registering many weights at once (`PinSet.pin_all`), on a CUDA host (skipped in CI): tensors
read by safetensors (pages of a private file mapping) are registered in place from several
threads, keep their values, count in the process's pinned bytes, and are unregistered at release;
a storage registered by one set is not claimed again by another."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core.pinning import PinSet, pinned_bytes
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a CUDA host")


def test_pin_all_registers_mapped_tensors_in_place_and_release_undoes_it(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(512 + i, 1024, generator=g).to(torch.bfloat16) for i in range(24)}
    save_file(weights, tmp_path / "w.safetensors")
    state = load_file(tmp_path / "w.safetensors")
    before, pins = pinned_bytes(), PinSet()
    done = pins.pin_all(state.values(), threads=4)
    assert 0 < done <= sum(t.untyped_storage().nbytes() for t in state.values())
    assert pinned_bytes() - before == done == pins.nbytes
    assert all(pins.pin(t) is t for t in state.values() if t.is_pinned())  # in place: no copy
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    other = PinSet()
    assert other.pin_all(state.values(), threads=4) == 0  # already registered: not claimed twice
    other.release()
    assert pinned_bytes() - before == done
    pins.release()
    assert pinned_bytes() == before and not any(t.is_pinned() for t in state.values())
