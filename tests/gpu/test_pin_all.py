"""Page-locking many weights at once (`PinSet.pin_all`), on a CUDA host (skipped in CI): tensors
safetensors left on a private file mapping are copied into fresh memory and registered there,
others are registered in place; values are kept, the pinned bytes are counted and release
undoes them. A pipeline placed from its files ends with every streamed block (and an on-demand
VAE) pinned and none on the files' mappings, and computes what it computes unpinned."""

from __future__ import annotations

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig, pinning
from diffusers_offload.offload_core.formats.mapped import in_mapping
from diffusers_offload.offload_core.pinning import PinSet, is_locked, pinned_bytes
from fixtures.tiny_pipes import load_wan, run_wan
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a CUDA host")


def test_pin_all_copies_mapped_tensors_registers_the_rest_in_place_and_release_undoes_it(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(512 + i, 1024, generator=g).to(torch.bfloat16) for i in range(24)}
    save_file(weights, tmp_path / "w.safetensors")
    state, loose = load_file(tmp_path / "w.safetensors"), torch.randn(4096, 256)
    mapped, before, pins = in_mapping(), pinned_bytes(), PinSet()
    tensors = [*state.values(), loose]
    out = pins.pin_all(tensors, mapped)
    assert out[-1] is loose and loose.is_pinned()  # registered where it lies
    assert all(t.is_pinned() and not mapped(t) for t in out)
    assert all(torch.equal(o, weights[k]) for o, k in zip(out, state, strict=False))
    assert pinned_bytes() - before == pins.nbytes >= sum(t.nbytes for t in out)
    pins.release()
    assert pinned_bytes() == before and not loose.is_pinned()


def _pages(tensors) -> int:
    return sum(-(-t.nbytes // pinning.ALIGN) * pinning.ALIGN for t in tensors)


def test_an_arena_the_driver_refuses_whole_is_page_locked_view_by_view(tmp_path, monkeypatch) -> None:
    """Where registering the copies' arena in one call fails (a host that refuses to lock that much
    at once), each copy's own pages are registered: all pinned, the set holding just their pages."""
    weights = {f"w{i}": torch.randn(256, 512 + i) for i in range(12)}
    save_file(weights, tmp_path / "w.safetensors")
    state, asked, pins, register = load_file(tmp_path / "w.safetensors"), [], PinSet(), pinning._register
    monkeypatch.setattr(pinning, "_register", lambda ptr, size: asked.append(size) or (size < 4 << 20 and register(ptr, size)))
    out = pins.pin_all(list(state.values()), in_mapping())
    assert max(asked) > 4 << 20 and len(asked) == 1 + len(out)  # the arena, then each copy
    assert not any(t.is_pinned() for t in out)  # (torch asks about the arena's first byte only)
    assert all(is_locked(t) and torch.equal(t, weights[k]) for t, k in zip(out, state, strict=True))
    assert pins.nbytes == _pages(out) and all(pins.pin(t) is t for t in out) and pins.nbytes == _pages(out)
    pins.release()
    assert pinned_bytes() == 0 and not any(is_locked(t) for t in out)


def test_some_copies_of_an_arena_pinned_again_lock_only_their_own_pages(tmp_path) -> None:
    """A placement again with a smaller grant (a lower host_ram_gb) pins some of the copies an
    earlier one made: only their pages are locked, not the whole arena."""
    save_file({f"w{i}": torch.randn(256, 512 + i) for i in range(12)}, tmp_path / "w.safetensors")
    first = PinSet()
    out = first.pin_all(list(load_file(tmp_path / "w.safetensors").values()), in_mapping())
    first.release()
    again = PinSet()
    assert all(again.pin(t) is t for t in out[:4])
    assert again.nbytes == _pages(out[:4]) and all(map(is_locked, out[:4])) and not any(map(is_locked, out[4:]))
    again.release()
    assert pinned_bytes() == 0


def test_a_denoiser_placed_from_its_files_streams_from_pinned_copies(tiny_wan_dir) -> None:
    base = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="off")
    outputs = []
    for pin in (False, True):
        pipe, engine = load_wan(tiny_wan_dir), Engine()
        mapped = in_mapping()
        assert any(mapped(t) for t in pipe.transformer.parameters())  # the loader left them on the files
        engine.place(pipe, OffloadConfig(**base, pin_memory=pin))
        states = engine.states(pipe)
        try:
            hosts = [slot.host for block in states["transformer"].transport.blocks for slot in block.slots]
            assert hosts and all(h.is_pinned() == pin for h in hosts)
            assert not (pin and any(mapped(h) for h in hosts))
            if pin and states["vae"].transport.pinned_bytes():  # an on-demand VAE pinned at placement
                assert all(t.is_pinned() and not mapped(t) for t in pipe.vae.parameters())
            outputs.append(run_wan(pipe))
        finally:
            engine.release(pipe)
    assert torch.equal(*outputs) and pinned_bytes() == 0


def test_a_denoiser_placed_again_after_its_release_streams_from_page_locked_masters(tiny_wan_dir) -> None:
    """Placed from its files (its masters copied into an arena), released (what a failed prompt's
    unload does), then placed again: every streamed master is page-locked again, by its own pages,
    with no pinned copy made (the small tensors packed together get a new packet each time), and
    the output is unchanged."""
    pipe, engine = load_wan(tiny_wan_dir), Engine()
    config = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cuda", preload="off")
    outputs, masters = [], []
    for _ in range(2):
        engine.place(pipe, config)
        streamer = engine.states(pipe)["transformer"].transport
        hosts = [slot.host for block in streamer.blocks for slot in block.slots]
        masters.append({slot.host.data_ptr() for unit in streamer.units for slot in unit.slots[:unit.single]})
        assert hosts and all(map(is_locked, hosts))
        assert streamer.pinned_bytes() >= sum(h.nbytes for h in hosts)
        outputs.append(run_wan(pipe))
        engine.release(pipe)
        assert pinned_bytes() == 0
    assert masters[0] == masters[1] and torch.equal(*outputs)
