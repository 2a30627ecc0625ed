"""LoRA on quantized layers (issue 23.4): fp8-stored and GGUF layers take the unfused path (a hook
adds the low-rank product, the stored bytes are never written), plain float layers stay fused;
every mode gives the same output as mode none bit for bit, and that output is within a stated
bound of an independent reference (the dequantised weight plus the file's delta, fused in
float32 and rounded to the compute dtype); clearing the set gives the base output bit for bit and
leaves nothing of ours after a release."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from diffusers import GGUFQuantizationConfig, WanPipeline, WanTransformer3DModel
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.formats.fp8 import mark_fp8, store_fp8, table_of
from diffusers_offload.offload_core.lora import LoraSpec, activate
from diffusers_offload.offload_core.state import LORA, LORA_HOOK, leftovers
from fixtures.gguf_files import dequantized_state_dict, write_wan_gguf
from fixtures.lora_reference import lora_deltas
from fixtures.placements import PLACEMENTS
from fixtures.quantized import scaled_fp8
from fixtures.tiny_loras import wan_lora
from fixtures.tiny_models import load_wan, run_wan

pytest_plugins = ["fixtures.tiny_loras"]

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
MODES = PLACEMENTS
# Unfused vs fused: the fused weight rounds W + delta to bf16 once, the unfused layer rounds W's
# product and the delta's product separately: a layer's output differs by at most LAYER_ULPS bf16
# ulps of its largest value; through the tiny transformer's six blocks the forward's relative L2
# error stays under FORWARD_REL while the LoRA itself moves the forward by more than 10x that.
LAYER_ULPS = 2
FORWARD_REL = 2e-2


def bf16_ulp(value: float) -> float:
    """The spacing of bf16 values at ``value`` (7 mantissa bits)."""
    return 2.0 ** (math.floor(math.log2(value)) - 7)


def spec(path: Path) -> LoraSpec:
    return LoraSpec(str(path))


def stored_bytes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's raw bytes (fp8 and packed GGUF weights compare as bytes)."""
    return {n: p.detach().view(torch.uint8).clone() if p.element_size() == 1 else p.detach().clone()
            for n, p in model.named_parameters()}


def lora_hooks(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules()
            if LORA_HOOK in getattr(vars(m).get("_diffusers_hook"), "hooks", {})]


def run(engine: Engine, pipe, *loras: LoraSpec) -> torch.Tensor:
    activate(pipe, loras)
    try:
        return run_wan(pipe)
    finally:
        engine.after_run(pipe)


# -- fp8 ----------------------------------------------------------------------------------------
def fp8_pipe(tiny_wan_dir: Path, scaled: bool) -> WanPipeline:
    """The tiny Wan, transformer in bf16, its Linear weights stored in fp8 (plain, or ComfyUI's
    fp8_scaled layout: ``fp8(w / s)`` with a per-tensor scale ``s``)."""
    pipe = load_wan(tiny_wan_dir)
    pipe.transformer.to(torch.bfloat16)
    if not scaled:
        store_fp8(pipe.transformer, torch.float8_e4m3fn, torch.bfloat16)
        return pipe
    mark_fp8(pipe.transformer, torch.bfloat16, scaled_fp8(pipe.transformer))
    return pipe


def fp8_reference(pipe: WanPipeline, deltas: dict[str, torch.Tensor]) -> WanPipeline:
    """A bf16 twin: each fp8 weight dequantised (``fp8.to(bf16) * scale``, ComfyUI's formula written
    out) plus the file's delta where the LoRA covers it, summed in float32, rounded to bf16."""
    twin = copy.copy(pipe)
    transformer = copy.deepcopy(pipe.transformer)
    table = table_of(pipe.transformer)
    live = dict(pipe.transformer.named_modules())
    for name, layer in transformer.named_modules():
        w = live[name].weight if isinstance(layer, torch.nn.Linear) else None
        if w is None or w.dtype != torch.float8_e4m3fn:
            continue
        value = w.data.to(torch.bfloat16)
        scale = table.scale_of(w)
        value = value if scale is None else value * torch.tensor(scale, dtype=torch.float32)
        layer.weight.data = (value.float() + deltas.get(name, 0)).to(torch.bfloat16)
    vars(transformer).pop("_diffusers_offload_fp8", None)
    twin.register_modules(transformer=transformer)
    return twin


@pytest.fixture(scope="module", params=["plain", "scaled"])
def fp8_case(request, tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> dict:
    """Outputs of mode none with and without LoRA ``a`` (every other mode must equal them)."""
    scaled = request.param == "scaled"
    pipe = fp8_pipe(tiny_wan_dir, scaled)
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="none", **BASE))
    case = {"scaled": scaled, "base": run(engine, pipe), "lora": run(engine, pipe, spec(wan_loras["a"]))}
    activate(pipe, [])
    engine.release(pipe)
    return case


def forward(model: torch.nn.Module) -> torch.Tensor:
    """One transformer forward on fixed inputs."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 16, 3, 16, 16, generator=gen).to(torch.bfloat16)
    text = torch.randn(1, 12, 32, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        return model(hidden, torch.tensor([500.0]), text, return_dict=False)[0].float()


def assert_within_bound(model: torch.nn.Module, twin: torch.nn.Module, base: torch.Tensor,
                        deltas: dict[str, torch.Tensor]) -> None:
    """Each covered layer within LAYER_ULPS of the twin's layer; the forward within FORWARD_REL."""
    gen = torch.Generator().manual_seed(1)
    for name in deltas:
        layer, ref_layer = model.get_submodule(name), twin.get_submodule(name)
        x = torch.randn(3, 7, ref_layer.in_features, generator=gen).to(torch.bfloat16)
        with torch.no_grad():
            got, want = layer(x).float(), ref_layer(x).float()
        bound = LAYER_ULPS * bf16_ulp(want.abs().max().item())
        assert (got - want).abs().max().item() <= bound, name
    got, want = forward(model), forward(twin)
    rel = ((got - want).norm() / want.norm()).item()
    moved = ((want - base).norm() / want.norm()).item()
    assert rel <= FORWARD_REL and moved > 10 * FORWARD_REL, (rel, moved)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_unfused_fp8_is_within_the_bound_of_the_fused_reference(
        scaled: bool, tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> None:
    pipe = fp8_pipe(tiny_wan_dir, scaled)
    deltas = lora_deltas(wan_loras["a"])
    twin = fp8_reference(pipe, deltas).transformer
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="none", **BASE))
    base = forward(pipe.transformer)
    activate(pipe, [spec(wan_loras["a"])])
    assert_within_bound(pipe.transformer, twin, base, deltas)
    activate(pipe, [])
    assert torch.equal(forward(pipe.transformer), base)
    engine.release(pipe)


@pytest.mark.parametrize("mode", list(MODES))
def test_fp8_lora_in_every_mode_is_unfused_and_comes_off_bit_exactly(
        mode: str, fp8_case: dict, tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> None:
    pipe = fp8_pipe(tiny_wan_dir, fp8_case["scaled"])
    model = pipe.transformer
    stored = stored_bytes(model)
    engine = Engine()
    engine.place(pipe, OffloadConfig(**MODES[mode], **BASE))

    assert torch.equal(run(engine, pipe, spec(wan_loras["a"])), fp8_case["lora"])
    lora = engine.report(pipe).component("transformer").details["lora"]
    covered = 8 * len(model.blocks)  # q, k, v, out of self- and cross-attention
    assert (lora["path"], lora["layers"]) == ("unfused", covered)
    assert len(lora["unfused"]) == covered and set(lora["unfused"].values()) == {"fp8"}
    assert lora["factor_bytes"] == covered * 4 * (24 + 24) * 2  # rank 4, 24 in, 24 out, bf16
    assert f"LoRA unfused on {covered} layers (unfused: {covered} fp8" in engine.report(pipe).text()
    assert len(lora_hooks(model)) == covered
    assert all(torch.equal(stored_bytes(model)[n], stored[n]) for n in stored), "an fp8 weight was written"

    assert torch.equal(run(engine, pipe), fp8_case["base"])
    assert lora_hooks(model) == [] and LORA.get(model) is None
    engine.release(pipe)
    assert leftovers(model) == []
    assert all(torch.equal(stored_bytes(model)[n], stored[n]) for n in stored)


def test_a_replacement_strips_the_hooks_and_the_next_activation_reattaches_them(
        fp8_case: dict, tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> None:
    """A teardown takes every hook of ours off (its factors leave the device with it); the set is
    still carried, and activating it again puts the hooks back without reading the file."""
    pipe = fp8_pipe(tiny_wan_dir, fp8_case["scaled"])
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="auto", **BASE))
    assert torch.equal(run(engine, pipe, spec(wan_loras["a"])), fp8_case["lora"])
    engine.place(pipe, OffloadConfig(mode="leaf", **BASE))  # settings changed: torn down, re-placed
    assert lora_hooks(pipe.transformer) == []
    assert torch.equal(run(engine, pipe, spec(wan_loras["a"])), fp8_case["lora"])
    engine.release(pipe)
    assert leftovers(pipe.transformer) == []  # the LoRA set is kept (LORA), its hooks are not
    assert LORA.get(pipe.transformer) is not None
    activate(pipe, [])
    assert LORA.get(pipe.transformer) is None and leftovers(pipe.transformer) == []


def test_the_hook_survives_diffusers_removing_a_hook_registered_before_it(
        fp8_case: dict, tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> None:
    """diffusers' leaf-level lazy prefetch removes its tracker hooks after the first forward;
    ``HookRegistry.remove_hook`` rewires the next hook's ``forward``, which must not unhook ours."""
    from diffusers.hooks import HookRegistry, ModelHook

    pipe = fp8_pipe(tiny_wan_dir, fp8_case["scaled"])
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="none", **BASE))
    layers = [m for m in pipe.transformer.modules() if isinstance(m, torch.nn.Linear)]
    for layer in layers:
        HookRegistry.check_if_exists_or_initialize(layer).register_hook(ModelHook(), "tracker")
    activate(pipe, [spec(wan_loras["a"])])
    for layer in layers:
        layer._diffusers_hook.remove_hook("tracker", recurse=False)
    assert torch.equal(run(engine, pipe, spec(wan_loras["a"])), fp8_case["lora"])
    assert torch.equal(run(engine, pipe), fp8_case["base"])
    engine.release(pipe)


# -- GGUF -----------------------------------------------------------------------------------------
GGUF_TARGETS = ("to_q", "to_k", "ffn.net.2")  # attention stays F16 in the tiny file, ffn.net.2 is quantized


@pytest.fixture(scope="module")
def gguf_case(tiny_wan_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A Q8_0 file, a LoRA on attention (F16 in the file: fused) and ffn.net.2 (Q8_0: unfused), and
    mode none's outputs with and without it."""
    root = tmp_path_factory.mktemp("gguf-lora")
    file = write_wan_gguf(tiny_wan_dir, root / "wan-Q8_0.gguf", "Q8_0")
    lora = wan_lora(load_wan(tiny_wan_dir).transformer, root / "lora", seed=5, targets=GGUF_TARGETS)
    pipe = gguf_pipe(tiny_wan_dir, file)
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="none", **BASE))
    case = {"file": file, "lora": lora, "base": run(engine, pipe), "with_lora": run(engine, pipe, spec(lora))}
    activate(pipe, [])
    engine.release(pipe)
    return case


def gguf_pipe(tiny_wan_dir: Path, file: Path) -> WanPipeline:
    transformer = WanTransformer3DModel.from_single_file(
        str(file), quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
        config=str(tiny_wan_dir), subfolder="transformer", torch_dtype=torch.bfloat16)
    pipe = WanPipeline.from_pretrained(tiny_wan_dir, transformer=transformer, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def gguf_reference(pipe: WanPipeline, file: Path, deltas: dict[str, torch.Tensor]) -> WanPipeline:
    """A plain twin of the GGUF transformer (a GGUF model cannot be deep-copied): every float
    tensor copied, each GGUF weight the file's values as gguf's own numpy dequantizer reads them
    in the compute dtype; covered layers get the delta, summed in float32, rounded to bf16."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    values = convert_wan_transformer_to_diffusers(dequantized_state_dict(file))
    model = pipe.transformer
    config = {k: v for k, v in model.config.items() if k != "quantization_config"}
    transformer = WanTransformer3DModel.from_config(config)
    gguf = {n for n, m in model.named_modules() if type(m).__name__ == "GGUFLinear"}
    for name, param in model.named_parameters():
        layer, _, kind = name.rpartition(".")
        twin_param = transformer.get_parameter(name)
        if layer in gguf:  # GGUFLinear computes in bf16: weight dequantized, bias cast
            value = values[name] if kind == "weight" else param.data
            twin_param.data = value.to(torch.bfloat16)
        else:
            twin_param.data = param.data.clone()
        if kind == "weight" and layer in deltas:
            twin_param.data = (twin_param.data.float() + deltas[layer]).to(twin_param.dtype)
    twin = copy.copy(pipe)
    twin.register_modules(transformer=transformer)
    return twin


def test_unfused_gguf_is_within_the_bound_of_the_fused_reference(gguf_case: dict, tiny_wan_dir: Path) -> None:
    pipe = gguf_pipe(tiny_wan_dir, gguf_case["file"])
    deltas = lora_deltas(gguf_case["lora"])
    twin = gguf_reference(pipe, gguf_case["file"], deltas).transformer
    base = forward(pipe.transformer)
    activate(pipe, [spec(gguf_case["lora"])])
    assert_within_bound(pipe.transformer, twin, base, deltas)
    activate(pipe, [])
    assert torch.equal(forward(pipe.transformer), base)


@pytest.mark.parametrize("mode", list(MODES))
def test_gguf_layers_take_the_unfused_path_float_layers_the_fused_one(
        mode: str, gguf_case: dict, tiny_wan_dir: Path) -> None:
    pipe = gguf_pipe(tiny_wan_dir, gguf_case["file"])
    model = pipe.transformer
    gguf_layers = {n for n, m in model.named_modules() if type(m).__name__ == "GGUFLinear" and n.startswith("blocks.")}
    assert gguf_layers == {f"blocks.{i}.ffn.net.2" for i in range(len(model.blocks))}
    stored = stored_bytes(model)
    engine = Engine()
    engine.place(pipe, OffloadConfig(**MODES[mode], **BASE))

    assert torch.equal(run(engine, pipe, spec(gguf_case["lora"])), gguf_case["with_lora"])
    lora = engine.report(pipe).component("transformer").details["lora"]
    assert lora["path"] == "fused+unfused" and lora["layers"] == 5 * len(model.blocks)
    assert lora["unfused"] == dict.fromkeys(sorted(gguf_layers), "gguf")
    assert sorted(lora_hooks(model)) == sorted(gguf_layers)
    for name in gguf_layers:  # the packed bytes are never written
        assert torch.equal(stored_bytes(model)[f"{name}.weight"], stored[f"{name}.weight"]), name

    assert torch.equal(run(engine, pipe), gguf_case["base"])
    assert lora_hooks(model) == [] and LORA.get(model) is None
    engine.release(pipe)
    assert leftovers(model) == []
    assert all(torch.equal(stored_bytes(model)[n], stored[n]) for n in stored), "a weight did not come back"
