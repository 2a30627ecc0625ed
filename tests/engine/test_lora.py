"""LoRA under offload (SPEC §7) on the tiny Wan: every mode gives the unplaced output, sets stack,
change and go away bit-exactly, an unchanged set touches nothing, bad files change nothing."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.components import iter_modules
from diffusers_offload.offload_core.lora import LoraError, LoraSpec, activate
from fixtures.placements import grant_pinned_masters
from fixtures.side_stream import stand_in_side_stream
from fixtures.tiny_pipes import load_wan, run_wan

pytest_plugins = ["fixtures.tiny_loras"]

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
ONE_BLOCK_GB = 40_000 / 2**30  # a tiny Wan block is ~27 KB: this budget keeps exactly one of two
CONFIGS = {
    "auto-preload-off": OffloadConfig(mode="auto", preload="off", **BASE),
    "auto-preload-fixed": OffloadConfig(mode="auto", preload=ONE_BLOCK_GB, **BASE),
    "auto-parts-fixed": OffloadConfig(mode="auto", preload=ONE_BLOCK_GB, stream_parts=True, **BASE),
    "auto-packed": OffloadConfig(mode="auto", preload=ONE_BLOCK_GB, **BASE),  # pinned masters granted: packets
    "model": OffloadConfig(mode="model", **BASE),
    "leaf": OffloadConfig(mode="leaf", **BASE),
    "none": OffloadConfig(mode="none", **BASE),
}
COVERED = "blocks.0.attn1.to_q.weight"


def spec(path: Path, strength: float = 1.0) -> LoraSpec:
    return LoraSpec(str(path), strength)


@pytest.fixture(scope="module")
def references(tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Outputs of an unplaced pipeline with each set the tests use."""
    pipe = load_wan(tiny_wan_dir)
    sets = {"base": [], "a": [spec(wan_loras["a"])], "a+b": [spec(wan_loras["a"]), spec(wan_loras["b"])],
            "a*0.5": [spec(wan_loras["a"], 0.5)]}
    out = {}
    for name, loras in sets.items():
        activate(pipe, loras)
        out[name] = run_wan(pipe)
    return out


def originals(pipe) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pipe.transformer.named_parameters()}


def assert_weights_equal(pipe, expected: dict[str, torch.Tensor], engine: Engine) -> None:
    """Bit-exact: the live parameters and every streamed block's host master."""
    for name, param in pipe.transformer.named_parameters():
        assert torch.equal(param.detach().cpu(), expected[name]), name
    transport = engine.states(pipe)["transformer"].transport
    for block in getattr(transport, "blocks", []):
        for slot in block.slots:
            assert torch.equal(slot.host, slot.tensor.detach().cpu())


def covered(pipe) -> int:
    """Layers the test LoRAs cover: the 8 attention projections (self and cross) of every block."""
    return 8 * len(pipe.transformer.blocks)


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_lora_under_offload_matches_unplaced_stacks_changes_and_restores(
        mode: str, wan_pipe, wan_loras: dict[str, Path], references: dict[str, torch.Tensor], monkeypatch) -> None:
    if mode == "auto-packed":  # what a CUDA device grants: each unit's small tensors in one packet
        grant_pinned_masters(monkeypatch)
    base = originals(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, CONFIGS[mode])
    if mode in ("auto-preload-fixed", "auto-packed"):
        streamer = engine.states(wan_pipe)["transformer"].transport
        assert 0 < len(streamer.resident_indices()) < len(streamer.pieces)  # some kept, some streamed
        assert all(u.packed for u in streamer.units) == (mode == "auto-packed")

    def run(*loras: LoraSpec) -> torch.Tensor:
        activate(wan_pipe, loras)
        try:
            return run_wan(wan_pipe)
        finally:
            engine.after_run(wan_pipe)

    a, b = wan_loras["a"], wan_loras["b"]
    torch.testing.assert_close(run(spec(a)), references["a"])
    assert engine.report(wan_pipe).component("transformer").details["lora"] == {"path": "fused", "layers": covered(wan_pipe)}
    torch.testing.assert_close(run(spec(a), spec(b)), references["a+b"])
    torch.testing.assert_close(run(spec(a, 0.5)), references["a*0.5"])
    torch.testing.assert_close(run(spec(a, 0.0)), references["base"])
    torch.testing.assert_close(run(), references["base"])
    assert "lora" not in engine.report(wan_pipe).component("transformer").details
    assert_weights_equal(wan_pipe, base, engine)
    engine.release(wan_pipe)
    assert_weights_equal_after_release(wan_pipe, base)


def test_copies_made_ahead_of_the_next_call_are_not_read_after_a_lora_change(
        wan_pipe, wan_loras: dict[str, Path], references: dict[str, torch.Tensor], monkeypatch) -> None:
    """A call's end copies the next call's first streamed units ahead, and they stay through
    ``after_run`` (with their buffers); a LoRA activated in between must not be read stale."""
    engine = Engine()
    engine.place(wan_pipe, CONFIGS["auto-preload-off"])
    streamer = engine.states(wan_pipe)["transformer"].transport
    stand_in_side_stream(monkeypatch, streamer)
    for loras, expected in (([], "base"), ([spec(wan_loras["a"])], "a"), ([], "base")):
        activate(wan_pipe, loras)
        try:
            torch.testing.assert_close(run_wan(wan_pipe), references[expected], rtol=0, atol=0)
        finally:
            engine.after_run(wan_pipe)
        assert streamer.prefetch.inflight  # copied ahead for the next call, kept through its end
    engine.release(wan_pipe)


def assert_weights_equal_after_release(pipe, expected: dict[str, torch.Tensor]) -> None:
    for name, param in pipe.transformer.named_parameters():
        assert torch.equal(param.detach(), expected[name]), name


def test_stacked_loras_add_their_deltas(wan_pipe, wan_loras: dict[str, Path]) -> None:
    weight = wan_pipe.transformer.get_parameter(COVERED)
    base = weight.detach().clone()
    deltas = {}
    for name, loras in {"a": [spec(wan_loras["a"])], "b": [spec(wan_loras["b"])],
                        "a+b": [spec(wan_loras["a"]), spec(wan_loras["b"])]}.items():
        activate(wan_pipe, loras)
        deltas[name] = weight.detach() - base
    assert deltas["a"].abs().max() > 0 and deltas["b"].abs().max() > 0
    torch.testing.assert_close(deltas["a+b"], deltas["a"] + deltas["b"])


def test_unchanged_set_touches_no_hook_and_no_weight(wan_pipe, wan_loras: dict[str, Path]) -> None:
    engine = Engine()
    engine.place(wan_pipe, CONFIGS["auto-preload-fixed"])
    loras = [spec(wan_loras["a"]), spec(wan_loras["b"], 0.3)]
    activate(wan_pipe, loras)
    run_wan(wan_pipe)
    engine.after_run(wan_pipe)
    before = _snapshot(wan_pipe, engine)
    activate(wan_pipe, [LoraSpec(str(wan_loras["a"])), LoraSpec(str(wan_loras["b"]), 0.3)])  # equal, new objects
    assert _snapshot(wan_pipe, engine) == before


def _snapshot(pipe, engine: Engine) -> tuple:
    """Hook objects (diffusers registries and torch forward hooks) and weight storages + checksums."""
    hooks, weights = [], []
    for _name, module in iter_modules(pipe):
        for sub in module.modules():
            registry = sub.__dict__.get("_diffusers_hook")
            hooks.append((id(registry), tuple(map(id, registry.hooks.values())) if registry else ()))
            hooks.append(tuple(map(id, sub._forward_hooks.values())))
        for t in module.parameters():
            weights.append((t.data_ptr(), hashlib.sha1(t.detach().cpu().numpy().tobytes()).hexdigest()))
    for block in getattr(engine.states(pipe)["transformer"].transport, "blocks", []):
        weights.extend((s.host.data_ptr(), id(s.host)) for s in block.slots)
    return tuple(hooks), tuple(weights)


def test_kohya_keys_give_the_same_output_as_diffusers_keys(wan_pipe, wan_loras, references) -> None:
    activate(wan_pipe, [spec(wan_loras["kohya"])])
    torch.testing.assert_close(run_wan(wan_pipe), references["a"])


def test_quantized_component_takes_the_unfused_path_under_block_streaming(
        wan_pipe, wan_loras: dict[str, Path], references: dict[str, torch.Tensor]) -> None:
    """A component with a quantization config keeps its weights; a forward hook adds the delta."""
    wan_pipe.transformer.quantization_config = SimpleNamespace(quant_method="test")
    base = originals(wan_pipe)
    engine = Engine()
    engine.place(wan_pipe, CONFIGS["auto-preload-fixed"])
    activate(wan_pipe, [spec(wan_loras["a"])])
    torch.testing.assert_close(run_wan(wan_pipe), references["a"])
    engine.after_run(wan_pipe)
    report = engine.report(wan_pipe)
    lora = report.component("transformer").details["lora"]
    assert (lora["path"], lora["layers"]) == ("unfused", covered(wan_pipe))
    assert len(lora["unfused"]) == covered(wan_pipe) and set(lora["unfused"].values()) == {"test"}  # the quant method
    assert f"LoRA unfused on {covered(wan_pipe)} layers" in report.text()
    assert_weights_equal(wan_pipe, base, engine)
    activate(wan_pipe, [])
    assert not any(m._forward_hooks for m in wan_pipe.transformer.modules())
    torch.testing.assert_close(run_wan(wan_pipe), references["base"])


@pytest.mark.parametrize(("name", "message"), [
    ("other_model", "matches no layer of WanPipeline"),
    ("not_a_lora", "is not a LoRA"),
    ("truncated", "cannot be read as safetensors"),
])
def test_bad_files_are_refused_by_name_and_change_nothing(wan_pipe, wan_loras, name: str, message: str) -> None:
    base = originals(wan_pipe)
    digests = {p: hashlib.sha1(p.read_bytes()).hexdigest() for p in wan_loras.values()}
    with pytest.raises(LoraError, match=message) as info:
        activate(wan_pipe, [spec(wan_loras["a"]), spec(wan_loras[name])])
    assert wan_loras[name].name in str(info.value)
    assert_weights_equal_after_release(wan_pipe, base)
    assert digests == {p: hashlib.sha1(p.read_bytes()).hexdigest() for p in wan_loras.values()}


def test_a_file_that_is_not_safetensors_is_refused(wan_pipe, tmp_path: Path) -> None:
    path = tmp_path / "lora.ckpt"
    path.write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(LoraError, match="not a .safetensors file"):
        activate(wan_pipe, [spec(path)])


def test_partial_match_warns_with_counts_and_applies_the_rest(wan_pipe, wan_loras, references, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="diffusers_offload"):
        activate(wan_pipe, [spec(wan_loras["partial"])])
    assert f"{covered(wan_pipe)} of {covered(wan_pipe) + 1} layers match WanPipeline" in caplog.text
    torch.testing.assert_close(run_wan(wan_pipe), references["a"])


def test_leaf_groups_cpu_copies_are_written_too(wan_pipe, wan_loras: dict[str, Path]) -> None:
    """With streams on (GPU only) diffusers' leaf groups onload from their own pinned CPU copies;
    here each group is given such copies by hand, and the LoRA must land in them and leave again."""
    engine = Engine()
    engine.place(wan_pipe, CONFIGS["leaf"])
    copies = {}
    for module in wan_pipe.transformer.modules():
        group = getattr(module._diffusers_hook.hooks.get("group_offloading"), "group", None) \
            if "_diffusers_hook" in module.__dict__ else None
        if group is not None:
            params = [p for m in group.modules for p in m.parameters()] + list(group.parameters)
            group.cpu_param_dict = {p: p.data.clone() for p in params}
            copies.update({id(p): t for p, t in group.cpu_param_dict.items()})
    weight = wan_pipe.transformer.get_parameter(COVERED)
    base = weight.detach().clone()
    activate(wan_pipe, [spec(wan_loras["a"])])
    assert not torch.equal(copies[id(weight)], base) and torch.equal(copies[id(weight)], weight.detach())
    activate(wan_pipe, [])
    assert torch.equal(copies[id(weight)], base) and torch.equal(weight.detach(), base)


def test_fused_output_matches_diffusers_own_peft_loading(tiny_wan_dir, wan_loras, references) -> None:
    """Same scaling as diffusers (alpha / rank from the adapter metadata): the reference is
    ``load_lora_weights`` on an unplaced pipeline (peft layers, unfused)."""
    pipe = load_wan(tiny_wan_dir)
    pipe.load_lora_weights(str(wan_loras["a"].parent), weight_name=wan_loras["a"].name)
    torch.testing.assert_close(run_wan(pipe), references["a"], rtol=1e-5, atol=1e-5)
