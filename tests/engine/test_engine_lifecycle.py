"""Failure mid-apply, always/never precedence, pin budget, release cleanliness, force sweep."""

import gc
import logging
import weakref

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig, OffloadConfigError
from diffusers_offload.offload_core import engine as engine_mod
from diffusers_offload.offload_core.memory import MemoryReader
from diffusers_offload.offload_core.pinning import pinned_bytes
from diffusers_offload.offload_core.report import gib
from diffusers_offload.offload_core.state import KEPT_ON_PURPOSE, leftovers
from diffusers_offload.offload_core.transport import OnDemandTransport, TransportContext
from diffusers_offload.offload_core.transport import on_demand as on_demand_module
from diffusers_offload.offload_core.transport.encoder_stream import EncoderStreamer
from diffusers_offload.offload_core.transport.leaf import LeafGroupTransport
from fixtures.tiny_pipes import load_wan, run_wan

CFG = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
SENTINEL = "_diffusers_offload_applying"
STATE = "_diffusers_offload_state"
PIN_VERDICT = "_diffusers_offload_pin_verdict"


def _hooked(module: torch.nn.Module) -> list[str]:
    return [p for p, m in module.named_modules()
            if m.__dict__.get("_diffusers_hook") is not None and m._diffusers_hook.hooks]


class Scripted(MemoryReader):
    def __init__(self, available: int) -> None:
        self.available = available

    def host_available(self) -> int:
        return self.available


# -- 4. failure mid-apply ------------------------------------------------------------------------
@pytest.mark.parametrize(("transport", "host_free"), [(LeafGroupTransport, 0), (EncoderStreamer, None)],
                         ids=["leaf-pin-denied", "streamed-pin-granted"])
def test_transport_failing_mid_apply_leaves_no_state_or_hooks(wan_pipe, monkeypatch, transport, host_free):
    """The text encoder's transport dies after hooking: on leaf groups (no room to pin) and with
    its layers streamed (the pin granted by the live reading)."""
    original = transport.apply
    before = {n: t.detach().clone() for n, t in wan_pipe.text_encoder.state_dict().items()}

    def half_apply(self, module):
        original(self, module)  # hooks are on; then it dies
        raise RuntimeError("injected")

    monkeypatch.setattr(transport, "apply", half_apply)
    with pytest.raises(RuntimeError, match="injected"):
        Engine(memory=Scripted(host_free) if host_free is not None else None).place(wan_pipe, CFG)
    te = wan_pipe.text_encoder
    assert STATE not in te.__dict__ and SENTINEL not in te.__dict__
    assert _hooked(te) == [] and leftovers(te) == []
    after = te.state_dict()
    assert all(torch.equal(after[n], t) and after[n].device.type == "cpu" for n, t in before.items())


def test_sentinel_left_by_crash_is_torn_down_and_reapplied(wan_pipe, caplog):
    expected = run_wan(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, CFG)
    tr = wan_pipe.transformer
    stale = tr.__dict__[STATE]
    # simulate a crash half-way through apply: sentinel set, stream hooks only partly there
    tr.__dict__[SENTINEL] = True
    tr.blocks[1]._diffusers_hook.remove_hook("diffusers_offload_stream", recurse=False)
    with caplog.at_level(logging.WARNING, logger="diffusers_offload"):
        engine.place(wan_pipe, CFG)
    assert "mid-apply" in caplog.text
    assert SENTINEL not in tr.__dict__
    assert tr.__dict__[STATE] is not stale
    assert "diffusers_offload_stream" in tr.blocks[1]._diffusers_hook.hooks
    out = run_wan(wan_pipe)
    engine.after_run(wan_pipe)
    torch.testing.assert_close(out, expected)


# -- 5. always / never ---------------------------------------------------------------------------
def test_never_list_keeps_transformer_resident(wan_pipe):
    report = Engine().place(wan_pipe, CFG.replace(never=("transformer",)))
    assert report.component("transformer").role == "resident"
    assert "never" in report.component("transformer").reason


def test_always_list_puts_small_vae_on_demand_with_default_thresholds(wan_pipe):
    report = Engine().place(wan_pipe, OffloadConfig(device="cpu", always=("vae",)))
    assert report.component("vae").role == "on-demand"
    assert report.component("transformer").role == "resident"  # small, not listed


def test_never_class_entry_beats_always_name_entry(wan_pipe):
    report = Engine().place(wan_pipe, OffloadConfig(device="cpu", never=("AutoencoderKLWan",), always=("vae",)))
    assert report.component("vae").role == "resident"
    assert "never" in report.component("vae").reason


def test_same_entry_in_always_and_never_is_refused():
    with pytest.raises(OffloadConfigError, match="both"):
        OffloadConfig(always=("vae",), never=("vae",))


def test_lists_are_read_fresh_each_pass(wan_pipe):
    engine = Engine()
    cfg = OffloadConfig(device="cpu")
    assert engine.place(wan_pipe, cfg.replace(always=("vae",))).component("vae").role == "on-demand"
    assert engine.place(wan_pipe, cfg).component("vae").role == "resident"
    assert engine.place(wan_pipe, cfg.replace(always=("vae",))).component("vae").role == "on-demand"


# -- 6. pin budget -------------------------------------------------------------------------------
def test_pin_granted_when_need_fits_available_less_reserve(wan_pipe):
    need = sum(p.numel() * p.element_size() for p in wan_pipe.transformer.parameters()) + sum(
        b.numel() * b.element_size() for b in wan_pipe.transformer.buffers())
    reserve = 2**30
    engine = Engine(memory=Scripted(need + reserve))
    engine.place(wan_pipe, CFG.replace(pin_reserve_gb=1.0))
    verdict = wan_pipe.transformer.__dict__[PIN_VERDICT]
    assert verdict.need == need and verdict.granted
    assert engine.states(wan_pipe)["transformer"].transport.ctx.pin is True


def test_pin_denied_falls_back_and_warns_with_per_step_volume(wan_pipe, caplog):
    engine = Engine(memory=Scripted(2**30))  # exactly the reserve: nothing left to pin
    with caplog.at_level(logging.WARNING, logger="diffusers_offload"):
        report = engine.place(wan_pipe, CFG.replace(pin_reserve_gb=1.0))
    transport = engine.states(wan_pipe)["transformer"].transport
    assert not wan_pipe.transformer.__dict__[PIN_VERDICT].granted
    assert transport.ctx.pin is False and transport.ctx.streams is False
    assert report.component("transformer").details["stream"] is False
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    volume = gib(report.component("transformer").nbytes)  # the transformer's bytes, moved every step
    assert any("pageable memory every step" in m and volume in m for m in msgs), msgs


def test_pin_verdict_is_cached_on_the_component(wan_pipe):
    reader = Scripted(1 << 50)
    engine = Engine(memory=reader)
    engine.place(wan_pipe, CFG)
    first = wan_pipe.transformer.__dict__[PIN_VERDICT]
    reader.available = 0
    engine.place(wan_pipe, CFG)
    assert wan_pipe.transformer.__dict__[PIN_VERDICT] is first and first.granted
    assert engine.states(wan_pipe)["transformer"].transport.ctx.pin is True


def test_record_stream_without_streams_refused_before_hooking():
    with pytest.raises(OffloadConfigError, match="record_stream"):
        OffloadConfig(use_stream=False, record_stream=True)


# -- 7. release ----------------------------------------------------------------------------------
RELEASE_CONFIGS = {
    "auto-parts": CFG,
    "auto-whole": CFG.replace(stream_parts=False),
    "auto-preload-fixed": CFG.replace(preload=0.0001),
    "model": CFG.replace(mode="model"),
    "leaf": CFG.replace(mode="leaf"),
    "none": CFG.replace(mode="none"),
    "never-lists": CFG.replace(never=("vae",), always=("text_encoder",)),
}


def _instance_attrs(pipe) -> dict[str, set[str]]:
    """Every instance attribute of the pipeline and of each module under its components."""
    out = {"<pipe>": set(vars(pipe))}
    for comp in ("transformer", "text_encoder", "vae"):
        for path, m in getattr(pipe, comp).named_modules():
            out[f"{comp}.{path}"] = set(vars(m))
    return out


def _weights(pipe) -> dict[str, torch.Tensor]:
    return {f"{comp}.{name}": t.detach().clone()
            for comp in ("transformer", "text_encoder", "vae")
            for name, t in [*getattr(pipe, comp).named_parameters(), *getattr(pipe, comp).named_buffers()]}


@pytest.mark.parametrize("name", list(RELEASE_CONFIGS))
def test_release_leaves_nothing_of_ours_in_every_mode(wan_pipe, name):
    """Every role and mode, placed, run and released: each module has exactly the instance
    attributes it had before (the planner, kept on purpose, excepted), no hook, bridge or wrapped
    entry, the weights bit-equal and in system memory, and nothing pinned."""
    run_wan(wan_pipe)  # the pipeline's and the VAE's own run-time attributes exist from here on
    before, weights = _instance_attrs(wan_pipe), _weights(wan_pipe)
    engine = Engine()
    report = engine.place(wan_pipe, RELEASE_CONFIGS[name])
    run_wan(wan_pipe)
    engine.after_run(wan_pipe)
    engine.release(wan_pipe)
    after = _instance_attrs(wan_pipe)
    added = {where: sorted(after[where] - before[where] - set(KEPT_ON_PURPOSE)) for where in after}
    assert not {w: a for w, a in added.items() if a}, f"{name} left attributes"
    assert {w: sorted(before[w] - after[w]) for w in before if before[w] - after[w]} == {}
    assert leftovers(wan_pipe.transformer) + leftovers(wan_pipe.text_encoder) + leftovers(wan_pipe.vae) == []
    for key, value in _weights(wan_pipe).items():
        assert torch.equal(value, weights[key]), f"{key} changed"
    assert pinned_bytes() == 0
    assert {c.role for c in report.components} >= ({"resident"} if name == "none" else {"on-demand"}
                                                   if name == "model" else set())


def test_every_role_is_exercised_by_the_release_cases(wan_pipe):
    """The release cases above cover each role at least once (else they prove less than they say)."""
    roles = set()
    for config in RELEASE_CONFIGS.values():
        engine = Engine()
        roles |= {c.role for c in engine.place(wan_pipe, config).components}
        engine.release(wan_pipe)
    assert roles == {"resident", "on-demand", "per-step", "leaf"}


def _placed_refs(pipe, engine):
    engine.place(pipe, CFG)
    run_wan(pipe)
    engine.after_run(pipe)
    engine.release(pipe)
    params = [*pipe.transformer.blocks[0].parameters()][:3] + [next(pipe.transformer.proj_out.parameters())]
    return [weakref.ref(p) for p in params]


def test_released_weights_are_not_referenced_by_the_engine(tiny_wan_dir):
    engine = Engine()
    pipe = load_wan(tiny_wan_dir)  # not the fixture: pytest's fixture cache would keep it alive
    refs = _placed_refs(pipe, engine)
    assert all(r() is not None for r in refs)
    del pipe
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


# -- 9. force sweep ------------------------------------------------------------------------------
def test_force_sweep_moves_on_demand_components_back(wan_pipe):
    engine = Engine()
    engine.place(wan_pipe, CFG.replace(mode="model"))
    run_wan(wan_pipe)
    tr = engine.states(wan_pipe)["transformer"].transport
    tr.onload()  # as if a run had stopped inside the denoising loop
    assert tr.loaded
    result = engine.sweep()
    assert "transformer" in result.moved and result.failed == ()
    assert not tr.loaded
    assert engine.report(wan_pipe).component("transformer").device_bytes == 0


def test_force_sweep_reports_a_failing_component_and_moves_the_others(wan_pipe, monkeypatch):
    engine = Engine()
    engine.place(wan_pipe, CFG.replace(mode="model"))
    run_wan(wan_pipe)
    states = engine.states(wan_pipe)
    tr, te = states["transformer"].transport, states["text_encoder"].transport
    tr.onload()
    monkeypatch.setattr(te, "group", None)  # load the text encoder too, without evicting the transformer
    te.onload()
    assert tr.loaded and te.loaded

    def boom():
        raise RuntimeError("stuck")

    monkeypatch.setattr(tr, "offload", boom)
    result = engine.sweep()
    assert [n for n, _ in result.failed] == ["transformer"] and "stuck" in result.failed[0][1]
    assert "text_encoder" in result.moved and not te.loaded


def test_memory_required_is_the_largest_single_need_of_the_next_run(wan_pipe):
    engine = Engine()
    engine.place(wan_pipe, CFG.replace(mode="model"))
    sizes = {name: state.info.nbytes for name, state in engine.states(wan_pipe).items()}
    assert engine.memory_required(wan_pipe) == max(sizes.values())  # each moves in whole, one at a time
    engine.place(wan_pipe, CFG)  # auto: the streamer needs its ring, the VAE itself
    streamer = engine.states(wan_pipe)["transformer"].transport
    slots = 2 * max(b.largest_unit for b in streamer.blocks)  # a ring of window + 1 unit buffers
    assert engine.memory_required(wan_pipe) == max(slots, sizes["vae"], engine.states(wan_pipe)[
        "text_encoder"].transport.run_bytes())


def test_device_bytes_is_the_reports_total_without_the_report(wan_pipe, monkeypatch):
    """What hosts read often (ComfyUI's loaded_size) equals the report's device total, placed and
    released, and never builds the report (its walk over every tensor for the mapped bytes)."""
    engine = Engine()
    engine.place(wan_pipe, CFG.replace(mode="none"))
    run_wan(wan_pipe)
    held = engine.report(wan_pipe).device_bytes
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "mapped_bytes", lambda *_a: pytest.fail("device_bytes built a report"))
        assert engine.device_bytes(wan_pipe) == held > 0
    engine.release(wan_pipe)
    assert engine.device_bytes(wan_pipe) == engine.report(wan_pipe).device_bytes == 0


def test_on_demand_goes_back_to_its_resting_tensors_without_copying_out(monkeypatch):
    """A visit to the device ends by rebinding the host tensors it started from (same storage,
    same Parameter objects): the only move is the one in."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).eval()
    transport = OnDemandTransport(TransportContext(onload_device=torch.device("cpu")))
    transport.apply(module)
    params = list(module.parameters())
    storage = [t.data_ptr() for t in (*module.parameters(), *module.buffers())]
    moves = []
    real_move = on_demand_module.move_module
    monkeypatch.setattr(on_demand_module, "move_module", lambda m, device: (moves.append(device), real_move(m, device)))
    transport.onload()
    transport.offload()
    assert moves == [torch.device("cpu")]  # in only
    assert list(module.parameters()) == params
    assert [t.data_ptr() for t in (*module.parameters(), *module.buffers())] == storage
    transport.remove(module)


def test_a_release_frees_the_kept_blocks_without_a_garbage_collection(wan_pipe):
    """ComfyUI unloads with collection off (`Engine.release(collect=False)`): every buffer the
    streamer kept must go by reference counting, or the next model finds the device still full
    (found on the H200: ~10 GiB held after our release until a later gc), and the planner the
    model keeps must not keep the streamer (its device buffers) alive."""
    engine = Engine()
    engine.place(wan_pipe, CFG.replace(preload="100"))
    streamer = engine.states(wan_pipe)["transformer"].transport
    try:
        run_wan(wan_pipe)
    finally:
        engine.after_run(wan_pipe)
    kept = [weakref.ref(p.resident) for p in streamer.pieces if p.resident is not None]
    assert kept and len(kept) == len(streamer.pieces)
    alive = weakref.ref(streamer)
    del streamer
    gc.disable()
    try:
        engine.release(wan_pipe, collect=False)
        assert [r() for r in kept] == [None] * len(kept)
    finally:
        gc.enable()
    gc.collect()
    assert alive() is None  # nothing the model keeps (the planner's measures) holds the streamer
