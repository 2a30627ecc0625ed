"""LoRA restore without RAM copies (issue 21.3): a fused LoRA on a component loaded from a
safetensors folder keeps no backup in RAM; clearing the set (or changing it) reads the base
values back from the file, bit for bit, also when the loader cast the file's dtype and when the
folder is sharded; weights with no file behind them (changed after load, not in the files) keep a
RAM backup; a file changed on disk is refused by name; the files are never written."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.lora import LoraError, LoraSpec, activate
from diffusers_offload.offload_core.state import LORA, leftovers
from fixtures.lora_reference import lora_deltas
from fixtures.tiny_models import load_wan, run_wan

pytest_plugins = ["fixtures.tiny_loras"]

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
ONE_BLOCK_GB = 40_000 / 2**30  # keeps one tiny Wan block of several
MODES = {
    "auto-preload-off": dict(mode="auto", preload="off"),
    "auto-preload-fixed": dict(mode="auto", preload=ONE_BLOCK_GB),
    "auto-parts-fixed": dict(mode="auto", preload=ONE_BLOCK_GB, stream_parts=True),
    "model": dict(mode="model"),
    "leaf": dict(mode="leaf"),
    "none": dict(mode="none"),
}
COVERED = "blocks.0.attn1.to_q.weight"


def spec(path: Path, strength: float = 1.0) -> LoraSpec:
    return LoraSpec(str(path), strength)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def assert_bit_exact(model: torch.nn.Module, expected: dict[str, torch.Tensor], engine: Engine | None = None,
                     pipe: object = None) -> None:
    """The live parameters and, when placed, every streamed block's host master."""
    for name, param in model.named_parameters():
        assert param.dtype == expected[name].dtype and torch.equal(param.detach().cpu(), expected[name]), name
    if engine is not None:
        for block in getattr(engine.states(pipe)["transformer"].transport, "blocks", []):
            for slot in block.slots:
                assert torch.equal(slot.host, slot.tensor.detach().cpu())


def digests(folder: Path) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*.safetensors"))}


def carried(model: torch.nn.Module):
    state = LORA.get(model)
    assert state is not None
    return state


@pytest.fixture(scope="module")
def references(tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Unplaced outputs with each set, the LoRA written into the weights by the test itself
    (``W + (alpha / r) * B @ A`` in float32, from the files)."""
    out = {"base": run_wan(load_wan(tiny_wan_dir))}
    for name, files in {"a": ["a"], "a+b": ["a", "b"]}.items():
        pipe = load_wan(tiny_wan_dir)
        for f in files:
            for layer, delta in lora_deltas(wan_loras[f]).items():
                pipe.transformer.get_parameter(f"{layer}.weight").data += delta
        out[name] = run_wan(pipe)
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_restore_reads_the_file_and_holds_no_backup_in_ram(
        mode: str, tiny_wan_dir: Path, wan_loras: dict[str, Path], references: dict[str, torch.Tensor]) -> None:
    pipe = load_wan(tiny_wan_dir)
    model = pipe.transformer
    base = weights(model)
    before = digests(tiny_wan_dir)
    engine = Engine()
    engine.place(pipe, OffloadConfig(**MODES[mode], **BASE))

    def run(*loras: LoraSpec) -> torch.Tensor:
        activate(pipe, loras)
        try:
            return run_wan(pipe)
        finally:
            engine.after_run(pipe)

    torch.testing.assert_close(run(spec(wan_loras["a"])), references["a"])
    state = carried(model)
    assert state.backups == {}  # the RAM backup store is empty
    covered = {f"{layer}.weight" for layer in lora_deltas(wan_loras["a"])}
    assert set(state.sources) == covered
    assert {Path(s.file) for s in state.sources.values()} == {tiny_wan_dir / "transformer" /
                                                              "diffusion_pytorch_model.safetensors"}
    torch.testing.assert_close(run(spec(wan_loras["a"]), spec(wan_loras["b"])), references["a+b"])  # bases read back
    assert carried(model).backups == {}
    torch.testing.assert_close(run(), references["base"])
    assert LORA.get(model) is None
    assert_bit_exact(model, base, engine, pipe)
    engine.release(pipe)
    assert_bit_exact(model, base)
    assert leftovers(model) == []
    assert digests(tiny_wan_dir) == before


def test_a_dtype_cast_at_load_is_restored_by_the_same_cast(tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> None:
    """The folder holds float32, the model was loaded in bf16: the restored values are the file's
    cast to bf16 as diffusers cast them, bit for bit."""
    pipe = WanPipeline.from_pretrained(tiny_wan_dir, dtype=torch.bfloat16)
    model = pipe.transformer
    assert model.get_parameter(COVERED).dtype == torch.bfloat16
    base = weights(model)
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="auto", **BASE))
    activate(pipe, [spec(wan_loras["a"])])
    assert not torch.equal(model.get_parameter(COVERED).detach(), base[COVERED])
    assert carried(model).backups == {} and COVERED in carried(model).sources
    activate(pipe, [])
    assert_bit_exact(model, base, engine, pipe)
    engine.release(pipe)


def test_a_sharded_folder_is_read_through_its_index(tiny_wan_dir: Path, wan_loras: dict[str, Path],
                                                     tmp_path: Path) -> None:
    folder = tmp_path / "wan"
    shutil.copytree(tiny_wan_dir, folder, ignore=shutil.ignore_patterns("transformer"))
    WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer").save_pretrained(
        folder / "transformer", max_shard_size="40KB")
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    pipe = load_wan(folder)
    base = weights(pipe.transformer)
    activate(pipe, [spec(wan_loras["a"])])
    state = carried(pipe.transformer)
    assert state.backups == {} and len({s.file for s in state.sources.values()}) > 1  # several shards
    activate(pipe, [])
    assert_bit_exact(pipe.transformer, base)


def test_a_transformer_loaded_from_a_path_object_restores_from_its_files(
        tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> None:
    """``from_pretrained(Path(...))`` records a path, not a str, as the folder it read: the files
    are found all the same (a bench loading this way held every base value in RAM)."""
    pipe = load_wan(tiny_wan_dir)
    model = WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer")
    assert isinstance(model.config._name_or_path, os.PathLike)
    pipe.register_modules(transformer=model)
    base = weights(model)
    activate(pipe, [spec(wan_loras["a"])])
    state = carried(model)
    assert state.backups == {} and COVERED in state.sources
    activate(pipe, [])
    assert_bit_exact(model, base)


def test_weights_with_no_file_behind_them_keep_a_ram_backup(
        tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> None:
    """A weight changed after load differs from its file: it alone is backed up in RAM, and
    removal restores the changed value (not the file's)."""
    pipe = load_wan(tiny_wan_dir)
    model = pipe.transformer
    with torch.no_grad():
        model.get_parameter(COVERED).mul_(1.5)
    base = weights(model)
    activate(pipe, [spec(wan_loras["a"])])
    state = carried(model)
    assert set(state.backups) == {COVERED} and COVERED not in state.sources
    assert torch.equal(state.backups[COVERED], base[COVERED])
    activate(pipe, [])
    assert_bit_exact(model, base)


def test_a_model_not_loaded_from_a_folder_keeps_ram_backups(tiny_wan_dir: Path, wan_loras: dict[str, Path]) -> None:
    pipe = load_wan(tiny_wan_dir)
    twin = WanTransformer3DModel.from_config(pipe.transformer.config)  # no folder recorded? the config's is
    twin.load_state_dict(pipe.transformer.state_dict())
    twin.register_to_config(_name_or_path="")
    pipe.register_modules(transformer=twin)
    base = weights(twin)
    activate(pipe, [spec(wan_loras["a"])])
    state = carried(twin)
    assert state.sources == {} and len(state.backups) == len(lora_deltas(wan_loras["a"]))
    activate(pipe, [])
    assert_bit_exact(twin, base)


def test_a_file_changed_on_disk_is_refused_by_name_and_nothing_is_written(
        tiny_wan_dir: Path, wan_loras: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "wan"
    shutil.copytree(tiny_wan_dir, folder)
    pipe = load_wan(folder)
    activate(pipe, [spec(wan_loras["a"])])
    fused = weights(pipe.transformer)
    file = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    st = file.stat()
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten since: another file now
    with pytest.raises(LoraError, match="changed on disk") as info:
        activate(pipe, [])
    assert str(file) in str(info.value)
    assert_bit_exact(pipe.transformer, fused)  # still the LoRA'd weights, nothing half-restored
