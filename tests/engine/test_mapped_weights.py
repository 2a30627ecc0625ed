"""Memory-mapped weights (issue 21.1, SPEC §12): a tiny Wan and Flux loaded from their folders, their
weights copied into anonymous memory (what a loader that casts or copies leaves) and then mapped:
every tensor whose bytes are the file's rests on a private mapping of the file at its header
offset (the same Parameter objects), the bytes mapped are the files' bytes, outputs are bit-exact
in every mode, a fused LoRA never reaches the file, release leaves nothing of ours, a dtype cast at
load maps nothing and says why, and a truncated file is refused by name before anything is mapped."""

from __future__ import annotations

import gc
import hashlib
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from diffusers_offload.offload_core import Engine, OffloadConfig, pinning
from diffusers_offload.offload_core.components import iter_modules
from diffusers_offload.offload_core.formats.mapped import (
    MappedFileError,
    in_mapping,
    index_folder,
    map_from_files,
)
from diffusers_offload.offload_core.lora import LoraSpec, activate
from diffusers_offload.offload_core.memory import MemoryReader
from diffusers_offload.offload_core.pinning import fresh_copies
from diffusers_offload.offload_core.state import leftovers
from fixtures.tiny_models import load_flux, load_wan, run_flux, run_wan
from safetensors.torch import load_file, save_file

pytest_plugins = ["fixtures.tiny_loras"]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")

BASE = dict(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")
ONE_BLOCK_GB = 40_000 / 2**30
MODES = {
    "auto-preload-off": dict(mode="auto", preload="off"),
    "auto-preload-all": dict(mode="auto", preload=1.0),
    "auto-preload-some": dict(mode="auto", preload=ONE_BLOCK_GB),
    "auto-parts": dict(mode="auto", preload="off", stream_parts=True),
    "model": dict(mode="model"),
    "leaf": dict(mode="leaf"),
    "none": dict(mode="none"),
}
FAMILIES = {"wan": (load_wan, run_wan), "flux": (load_flux, run_flux)}


# -- helpers ------------------------------------------------------------------------------------
def file_maps(files: set[str]) -> list[tuple[int, int, int, str]]:
    """This process's mappings of ``files``: (start, end, file offset, path)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].strip() in files:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, int(parts[2], 16), parts[5].strip()))
    return out


def where(t: torch.Tensor, maps: list[tuple[int, int, int, str]]) -> tuple[str, int] | None:
    """(file, offset in it) of ``t``'s bytes, when they lie in one of ``maps``."""
    ptr, n = t.data_ptr(), t.numel() * t.element_size()
    for lo, hi, off, path in maps:
        if lo <= ptr and ptr + n <= hi:
            return path, off + ptr - lo
    return None


def tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict((*module.named_parameters(), *module.named_buffers()))


def anonymous(pipe: object) -> None:
    """Every tensor copied into anonymous memory (the state a copying loader leaves)."""
    for _name, module in iter_modules(pipe):
        for t in tensors(module).values():
            t.data = t.data.clone()
    gc.collect()


def component_folder(pipe: object, name: str) -> Path:
    return Path(getattr(pipe, name).config._name_or_path)


def digests(folder: Path) -> dict[Path, str]:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*.safetensors"))}


@pytest.fixture(scope="module")
def references(tiny_wan_dir: Path, tiny_flux_dir: Path) -> dict[str, torch.Tensor]:
    """Unplaced outputs of the unmapped (anonymous-memory) pipelines."""
    out = {}
    for family, folder in {"wan": tiny_wan_dir, "flux": tiny_flux_dir}.items():
        load, run = FAMILIES[family]
        pipe = load(folder)
        anonymous(pipe)
        out[family] = run(pipe)
    return out


@pytest.fixture
def folders(tiny_wan_dir: Path, tiny_flux_dir: Path) -> dict[str, Path]:
    return {"wan": tiny_wan_dir, "flux": tiny_flux_dir}


def mapped_pipe(family: str, folder: Path) -> object:
    load, _run = FAMILIES[family]
    pipe = load(folder)
    anonymous(pipe)
    for _name, module in iter_modules(pipe):
        map_from_files(module)
    return pipe


# -- which tensors are mapped, and how many bytes ---------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_tensor_with_the_files_bytes_rests_on_the_file_at_its_offset(family: str, folders) -> None:
    load, _run = FAMILIES[family]
    pipe = load(folders[family])
    anonymous(pipe)
    for name, module in iter_modules(pipe):
        folder = component_folder(pipe, name)
        index = {k: v[0] for k, v in index_folder(folder).items()}
        before = {n: (t, id(t)) for n, t in tensors(module).items()}
        earlier = file_maps({e.file for e in index.values()})  # another test's pipeline may map them
        assert all(where(t, earlier) is None for t in tensors(module).values())  # anonymous copies
        report = map_from_files(module)
        maps = file_maps({e.file for e in index.values()})
        expected = 0
        for tname, t in tensors(module).items():
            assert t is before[tname][0]  # the same Parameter / buffer objects
            entry = index.get(tname)
            if entry is None:  # a buffer made at load (rope tables): stays where it is
                assert where(t, maps) is None, tname
                continue
            expected += entry.end - entry.start
            assert where(t, maps) == (entry.file, entry.start), tname
            assert not t.untyped_storage().resizable()
        assert report.mapped_bytes == expected > 0, name
        assert report.loader_mapped_bytes == 0
        assert set(report.kept) <= {"not in the files (made at load or renamed)"}, report.kept


def test_tensors_the_loader_mapped_already_are_counted_and_left_alone(tiny_wan_dir: Path) -> None:
    """safetensors' own loader leaves same-dtype tensors on a private mapping of the file: they are
    recognised (file and offset), counted, not compared or moved."""
    pipe = load_wan(tiny_wan_dir)
    model = pipe.transformer
    ptrs = {n: t.data_ptr() for n, t in tensors(model).items()}
    files = {e.file for es in index_folder(component_folder(pipe, "transformer")).values() for e in es}
    earlier = file_maps(files)
    report = map_from_files(model)
    assert report.mapped_bytes == 0
    assert report.loader_mapped_bytes == sum(e.end - e.start for es in index_folder(
        component_folder(pipe, "transformer")).values() for e in es) > 0
    assert {n: t.data_ptr() for n, t in tensors(model).items()} == ptrs
    assert file_maps(files) == earlier  # no mapping was opened


def test_the_mapping_lives_as_long_as_a_tensor_over_it(tiny_wan_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_wan_dir, tmp_path / "wan")  # files no other test's pipeline maps
    pipe = mapped_pipe("wan", tmp_path / "wan")
    file = str(component_folder(pipe, "transformer") / "diffusion_pytorch_model.safetensors")
    weight = pipe.transformer.get_parameter("blocks.0.attn1.to_q.weight")
    copy = weight.detach().clone()
    gc.collect()  # map_from_files kept no reference: only the tensors hold the mapping
    assert len(file_maps({file})) == 1 and torch.equal(weight.detach(), copy)
    del pipe
    gc.collect()
    assert len(file_maps({file})) == 1  # ``weight`` still uses it
    del weight
    gc.collect()
    assert file_maps({file}) == []


# -- outputs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_mapped_outputs_are_bit_exact_in_every_mode(family: str, mode: str, folders, references) -> None:
    pipe = mapped_pipe(family, folders[family])
    _load, run = FAMILIES[family]
    engine = Engine()
    report = engine.place(pipe, OffloadConfig(**MODES[mode], **BASE))
    if mode != "none":  # on the CPU nothing moves: the streamed masters are the mapped tensors
        assert report.component("transformer").mapped_bytes > 0
        assert "mapped" in report.text()
    for _ in range(2):
        assert torch.equal(run(pipe), references[family])
        engine.after_run(pipe)
    engine.release(pipe)
    for _name, module in iter_modules(pipe):
        assert leftovers(module) == []
    assert torch.equal(run(pipe), references[family])


def test_a_fused_lora_never_reaches_the_file(tiny_wan_dir: Path, wan_loras: dict[str, Path], references,
                                             tmp_path: Path) -> None:
    folder = tmp_path / "wan"
    shutil.copytree(tiny_wan_dir, folder)
    before = digests(folder)
    pipe = mapped_pipe("wan", folder)
    engine = Engine()
    engine.place(pipe, OffloadConfig(mode="auto", **BASE))
    activate(pipe, [LoraSpec(str(wan_loras["a"]), 1.0)])
    with_lora = run_wan(pipe)
    engine.after_run(pipe)
    assert not torch.equal(with_lora, references["wan"])
    assert digests(folder) == before  # the writes made private pages
    activate(pipe, [])
    assert torch.equal(run_wan(pipe), references["wan"])
    engine.after_run(pipe)
    engine.release(pipe)
    assert leftovers(pipe.transformer) == []
    assert digests(folder) == before
    fresh = load_wan(folder)  # what a reload reads is the file as it was
    assert torch.equal(run_wan(fresh), references["wan"])


# -- what is not mapped, and why --------------------------------------------------------------------
def test_a_dtype_cast_at_load_maps_nothing_and_says_why(tiny_wan_dir: Path) -> None:
    pipe = WanPipeline.from_pretrained(tiny_wan_dir, dtype=torch.bfloat16)
    model = pipe.transformer
    cast = sum(t.numel() * t.element_size() for t in tensors(model).values() if t.dtype == torch.bfloat16)
    report = map_from_files(model)
    assert report.mapped_bytes == 0
    assert report.kept["loaded as bfloat16 from F32 (cast at load)"] == cast > 0
    assert "cast at load" in report.line()
    maps = file_maps({str(tiny_wan_dir / "transformer" / "diffusion_pytorch_model.safetensors")})
    for name, t in tensors(model).items():
        if t.dtype == torch.bfloat16:
            assert where(t, maps) is None, name
        elif t.dtype == torch.float32 and name in index_folder(tiny_wan_dir / "transformer"):
            assert where(t, maps) is not None, name  # diffusers' fp32 modules: the file's bytes


def test_a_weight_changed_after_load_keeps_its_values(tiny_wan_dir: Path) -> None:
    pipe = load_wan(tiny_wan_dir)
    anonymous(pipe)
    weight = pipe.transformer.get_parameter("blocks.0.attn1.to_q.weight")
    with torch.no_grad():
        weight.mul_(1.5)
    changed = weight.detach().clone()
    report = map_from_files(pipe.transformer)
    assert report.kept["values differ from the files (changed after load)"] == weight.numel() * 4
    assert torch.equal(weight.detach(), changed)


@pytest.mark.parametrize("damage", ["truncated", "missing shard"])
def test_a_damaged_folder_is_refused_by_name_before_anything_is_mapped(damage: str, tiny_wan_dir: Path,
                                                                       tmp_path: Path) -> None:
    pipe = load_wan(tiny_wan_dir)
    anonymous(pipe)
    folder = tmp_path / "transformer"
    if damage == "truncated":
        shutil.copytree(tiny_wan_dir / "transformer", folder)
        bad = folder / "diffusion_pytorch_model.safetensors"
        bad.write_bytes(bad.read_bytes()[:-100])
    else:
        WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer").save_pretrained(
            folder, max_shard_size="40KB")
        bad = sorted(folder.glob("*-of-*.safetensors"))[-1]
        bad.unlink()
    ptrs = {n: t.data_ptr() for n, t in tensors(pipe.transformer).items()}
    with pytest.raises(MappedFileError) as info:
        map_from_files(pipe.transformer, folder)
    assert bad.name in str(info.value)
    assert {n: t.data_ptr() for n, t in tensors(pipe.transformer).items()} == ptrs  # nothing re-pointed


def test_a_sharded_folder_maps_through_its_index(tiny_wan_dir: Path, tmp_path: Path, references) -> None:
    folder = tmp_path / "wan"
    shutil.copytree(tiny_wan_dir, folder, ignore=shutil.ignore_patterns("transformer"))
    WanTransformer3DModel.from_pretrained(tiny_wan_dir / "transformer").save_pretrained(
        folder / "transformer", max_shard_size="40KB")
    pipe = load_wan(folder)
    anonymous(pipe)
    report = map_from_files(pipe.transformer)
    assert len(report.files) > 1
    assert report.mapped_bytes == sum(e.end - e.start for es in index_folder(folder / "transformer").values()
                                      for e in es)
    assert torch.equal(run_wan(pipe), references["wan"])


# -- placement: the report and the disk note --------------------------------------------------------
class ScarceRam(MemoryReader):
    def __init__(self, free: int) -> None:
        self.free = free

    def host_available(self) -> int:
        return self.free


def test_scarce_ram_logs_the_disk_reads_per_step_once(tiny_wan_dir: Path, caplog) -> None:
    pipe = mapped_pipe("wan", tiny_wan_dir)
    engine = Engine(memory=ScarceRam(10_000))
    config = OffloadConfig(mode="auto", preload="off", **BASE)
    with caplog.at_level(logging.INFO, logger="diffusers_offload"):
        engine.place(pipe, config)
        engine.place(pipe, config)
    notes = [r.getMessage() for r in caplog.records if "read from disk per step" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("transformer: ")
    engine.release(pipe)
    for pin_memory, cached in ((False, 1), (True, 0)):  # a whole pin grant streams nothing from the files
        caplog.clear()
        roomy = Engine(memory=ScarceRam(2**40))
        with caplog.at_level(logging.INFO, logger="diffusers_offload"):
            roomy.place(mapped_pipe("wan", tiny_wan_dir), OffloadConfig(mode="auto", preload="off",
                                                                        pin_memory=pin_memory, **BASE))
        assert not [r for r in caplog.records if "read from disk" in r.getMessage()]
        assert len([r for r in caplog.records if "cached in RAM" in r.getMessage()]) == cached


# -- pinning mapped weights -------------------------------------------------------------------------
def test_pinning_copies_mapped_weights_into_one_fresh_arena_by_threads_and_leaves_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `PinSet.pin_all` does before it registers (a GPU host: tests/gpu/test_pin_all.py): each
    plain tensor on a private file mapping gets a copy with its values in one fresh arena (copied
    in jobs of at most `CHUNK` bytes: here 1 KiB, so tensors span several), every other tensor is
    handed back as it is, in order; the file is not touched."""
    monkeypatch.setattr(pinning, "CHUNK", 1024)
    g = torch.Generator().manual_seed(0)
    save_file({f"w{i}": torch.randn(64, 32 + i, generator=g).to(torch.bfloat16) for i in range(12)}
              | {"scalar": torch.tensor(3.0), "empty": torch.zeros(0, 4)}, tmp_path / "w.safetensors")
    before = hashlib.sha256((tmp_path / "w.safetensors").read_bytes()).hexdigest()
    state = load_file(tmp_path / "w.safetensors")
    loose = [torch.randn(8, 8), torch.zeros(3)]
    tensors = [*state.values(), *loose]
    mapped = in_mapping()
    assert all(mapped(t) for t in state.values() if t.nbytes) and not any(mapped(t) for t in loose)
    with torch.inference_mode():  # (where ComfyUI runs a node; the copying threads are outside it)
        out = fresh_copies(tensors, mapped, threads=4)
    copied = [o is not t for o, t in zip(out, tensors, strict=True)]
    assert copied == [mapped(t) for t in state.values()] + [False] * len(loose)
    assert all(torch.equal(o, t) and o.dtype == t.dtype and o.shape == t.shape and not mapped(o)
               for o, t in zip(out[:len(state)], state.values(), strict=True))
    assert len({o.untyped_storage().data_ptr() for o, c in zip(out, copied, strict=True) if c}) == 1  # one arena
    assert all(o.data_ptr() % pinning.ALIGN == 0 for o, c in zip(out, copied, strict=True) if c)  # each on its own pages
    assert all(o is t for o, t in zip(fresh_copies(loose, mapped), loose, strict=True))
    assert hashlib.sha256((tmp_path / "w.safetensors").read_bytes()).hexdigest() == before


def _vm_flags(ptr: int) -> list[str]:
    """The kernel's flags of the mapping holding ``ptr`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and not line.startswith("VmFlags"):
            lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="a kernel without huge pages")
def test_an_arena_asks_for_huge_pages_only_while_that_much_ram_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """`host_arena`: the mapping is marked for huge pages (``hg``) where the RAM it needs is free, and
    left to 4 KiB pages where it is not (each fault would make the kernel compact memory); 2 MiB
    aligned either way, the size asked for."""
    roomy = pinning.host_arena(8 << 20)
    assert roomy.numel() == 8 << 20 and roomy.data_ptr() % pinning.HUGE_PAGE == 0
    assert "hg" in _vm_flags(roomy.data_ptr())
    monkeypatch.setattr(pinning.psutil, "virtual_memory", lambda: type("Mem", (), {"free": 1 << 20})())
    tight = pinning.host_arena(8 << 20)
    assert tight.data_ptr() % pinning.HUGE_PAGE == 0 and "hg" not in _vm_flags(tight.data_ptr())


def _file_rss_mib() -> float:
    return int(next(line for line in open("/proc/self/status") if line.startswith("RssFile")).split()[1]) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and pagemap")
def test_copying_out_of_a_file_mapping_gives_back_the_pages_it_read_and_keeps_the_written_ones(tmp_path: Path) -> None:
    """The pages a copy read from a file mapping leave the process's RSS (64 MiB of tensors: the
    file-backed RSS grows by far less), and no value changes: the sources read back the file's
    bytes, and one written in place before the copy (its pages private now) keeps what was written."""
    g = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(1024, 2048 + i, generator=g) for i in range(8)}
    save_file(weights, tmp_path / "w.safetensors")
    state = load_file(tmp_path / "w.safetensors")
    sources = list(state.values())
    sources[3][:64] += 1.0  # written: those pages are private copies now
    rss = _file_rss_mib()
    out = fresh_copies(sources, in_mapping(), threads=4)
    grown = _file_rss_mib() - rss
    assert grown < 0.25 * sum(t.nbytes for t in sources) / 2**20  # (without giving back: all 64 MiB)
    written = weights["w3"].clone()
    written[:64] += 1.0
    assert all(torch.equal(o, s) for o, s in zip(out, sources, strict=True))
    assert all(torch.equal(s, written if k == "w3" else weights[k]) for k, s in zip(state, sources, strict=True))
