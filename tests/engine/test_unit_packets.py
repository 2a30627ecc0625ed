"""A pinned unit's small tensors (biases, norms, tables) travel as one packet (`StreamUnit.packet`):
their host masters are views of one buffer laid out as on the device, so one copy gives each its
value; a release gives them back as pageable copies. Built here on the CPU with the real tiny Wan
block (``pinned`` is what a CUDA placement passes; the packet is page-locked only there)."""

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.transport.blocks import PACK_BELOW, make_block
from fixtures.placements import grant_pinned_masters
from fixtures.tiny_pipes import run_wan


def _block(pipe, pinned: bool, parts: bool = True):
    module = pipe.transformer.blocks[0]
    before = {name: t.detach().clone() for name, t in module.state_dict().items()}
    made = make_block(0, "blocks", 0, module, parts=parts, host_of=lambda t: t.data, pinned=pinned,
                      device=torch.device("cpu"), first_unit=0)
    return module, made, before


@pytest.mark.parametrize("parts", [True, False])
def test_one_copy_of_the_packet_gives_every_small_tensor_its_value(wan_pipe, parts: bool) -> None:
    module, block, before = _block(wan_pipe, pinned=True, parts=parts)
    for unit in block.units:
        small = [s for s in unit.slots if s.nbytes < PACK_BELOW]
        assert unit.packed == len(small) >= 2 and unit.slots[-unit.packed :] == small
        assert all(s.host.untyped_storage().data_ptr() == unit.packet.untyped_storage().data_ptr() for s in small)
        buf = torch.zeros(unit.nbytes, dtype=torch.uint8)
        views = unit.views(buf)
        pairs = unit.copy_pairs(views, buf)
        assert len(pairs) == len(unit.slots) - unit.packed + 1
        for dst, src in pairs:
            dst.copy_(src)
        unit.bind(views)
    assert module.state_dict().keys() == before.keys()
    for name, t in module.state_dict().items():
        assert torch.equal(t, before[name]), name


def test_an_unpinned_block_copies_tensor_by_tensor(wan_pipe) -> None:
    _module, block, _ = _block(wan_pipe, pinned=False)
    assert all(u.packet is None and u.packed == 0 for u in block.units)
    unit = block.units[0]
    buf = torch.zeros(unit.nbytes, dtype=torch.uint8)
    assert len(unit.copy_pairs(unit.views(buf), buf)) == len(unit.slots)


def test_a_units_only_small_tensor_gets_its_master_as_the_others_do() -> None:
    """A unit with one small tensor (a Linear's bias beside its 2 MiB weight) has no packet: both
    masters come from ``host_of`` (what pins them in a CUDA placement), none is a plain copy."""
    layer = torch.nn.Linear(1024, 1024)
    given = []
    block = make_block(0, "blocks", 0, layer, parts=False, host_of=lambda t: given.append(t) or t.data,
                       pinned=True, device=torch.device("cpu"), first_unit=0)
    (unit,) = block.units
    assert unit.packet is None and unit.packed == 0 and unit.single == 2
    assert {id(t) for t in given} == {id(layer.weight), id(layer.bias)}


def test_a_release_gives_the_packed_tensors_back_apart_from_the_packet(wan_pipe) -> None:
    module, block, before = _block(wan_pipe, pinned=True)
    packets = {u.packet.untyped_storage().data_ptr() for u in block.units}
    block.release(torch.device("cpu"))
    assert all(u.packet is None for u in block.units)
    for name, t in module.state_dict().items():
        assert t.untyped_storage().data_ptr() not in packets, name
        assert torch.equal(t, before[name]), name


@pytest.mark.parametrize("preload", ["off", "1000"])
def test_the_engine_streams_and_keeps_packed_units_to_the_unplaced_bits(wan_pipe, monkeypatch, preload) -> None:
    """The whole placement with every block granted pinned masters (what a CUDA device gets; here
    the packets are plain CPU memory): streamed (``off``) or kept (``1000``), the same output as
    unplaced, and after release the same again, no packet left."""
    grant_pinned_masters(monkeypatch)
    expected = run_wan(wan_pipe, seed=0)
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu", preload=preload))
    streamer = engine.states(wan_pipe)["transformer"].transport
    try:
        assert all(u.packed >= 2 for u in streamer.units)
        placed = [run_wan(wan_pipe, seed=0) for _ in range(2)]
    finally:
        engine.after_run(wan_pipe)
        engine.release(wan_pipe)
    assert all(u.packet is None for u in streamer.units)
    for out in placed:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(run_wan(wan_pipe, seed=0), expected, rtol=0, atol=0)
