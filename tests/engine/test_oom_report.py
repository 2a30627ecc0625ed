"""The message of an out-of-memory error the engine could not absorb (``offload_core.oom``).

What must hold: it names the device and pipeline, the free memory read when the run started, each
component's share of the device (kept blocks of a streamed denoiser), and what to change: preload
(lower a fixed budget, or off; auto: off or a budget below what was kept), the launch flag where
the allocator is not PyTorch's native one, a smaller size or fewer frames; mode ``none`` is named.
"""

from __future__ import annotations

import torch
from diffusers_offload.offload_core import ComponentReport, Engine, OffloadConfig, PlacementReport
from diffusers_offload.offload_core.memory import MemoryReader
from diffusers_offload.offload_core.oom import DeviceReading, RunOutOfMemory, out_of_memory_text, read_device

GiB = 2**30


def component(name: str, role: str, nbytes: int, device_bytes: int, **details: object) -> ComponentReport:
    return ComponentReport(name=name, cls=name.title(), role=role, reason="", nbytes=nbytes, dtypes=("bfloat16",),
                           quantization=None, device_bytes=device_bytes, pinned_bytes=0, details=dict(details))


def wan_report(mode: str = "auto") -> PlacementReport:
    return PlacementReport(pipeline="WanPipeline", device="cuda:0", mode=mode, components=(
        component("text_encoder", "leaf", 11 * GiB, 0),
        component("transformer", "per-step", 28 * GiB, 6 * GiB, blocks=40, kept=20, kept_bytes=6 * GiB),
        component("vae", "on-demand", GiB // 4, GiB // 4),
    ))


def test_the_message_names_the_device_use_per_component_the_free_memory_and_what_to_change() -> None:
    start = DeviceReading("cuda:0", free=int(9.5 * GiB), total=12 * GiB)

    text = out_of_memory_text(wan_report(), start, "8 GB", "cudaMallocAsync",
                              torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB\nmore"))

    lines = text.splitlines()
    assert lines[0] == "Out of memory on cuda:0 running WanPipeline; the offload could not absorb it."
    assert "Free on cuda:0 when the run started: 9.50 GiB of 12.00 GiB." in lines
    assert "On the device at the error (6.25 GiB of the pipeline's, mode auto):" in lines
    shares = lines[lines.index("On the device at the error (6.25 GiB of the pipeline's, mode auto):") + 1:][:3]
    assert shares == ["  transformer: per-step, 6.00 GiB of 28.00 GiB, blocks kept 20/40",
                      "  vae: on-demand, 0.25 GiB of 0.25 GiB",
                      "  text_encoder: leaf, 0.00 GiB of 11.00 GiB"]  # largest share first
    assert "  - lower preload (now 8 GiB), e.g. '4.0 GB', or set it 'off': kept blocks leave less room " \
           "for activations" in lines
    assert any("launch ComfyUI with --disable-cuda-malloc" in line for line in lines)
    assert "  - a smaller width/height, fewer frames or a smaller batch" in lines
    assert lines[-1] == "(torch: CUDA out of memory. Tried to allocate 1.50 GiB)"
    assert not any("mode 'none'" in line for line in lines)


def test_auto_preload_is_told_off_or_below_what_was_kept_and_native_allocator_gets_no_flag() -> None:
    text = out_of_memory_text(wan_report(), None, "auto", "native")

    assert "Free memory when the run started: no reading on cuda:0." in text
    assert "  - set preload 'off' or a fixed budget below the 6.00 GiB kept, e.g. '3.0 GB': kept blocks" in text
    assert "--disable-cuda-malloc" not in text


def test_mode_none_is_named_and_preload_off_gets_no_preload_tip() -> None:
    text = out_of_memory_text(wan_report(mode="none"), None, "off")

    assert "offload mode 'none' (or --highvram / --gpu-only) keeps every component on the device" in text
    assert "preload" not in text and "--disable-cuda-malloc" in text  # allocator unknown: the flag is offered


def test_a_placed_pipeline_reports_every_component_and_the_error_is_still_a_torch_oom(wan_pipe) -> None:
    engine = Engine()
    report = engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu"))
    try:
        error = RunOutOfMemory(out_of_memory_text(report, DeviceReading("cpu", None, None), "auto"))
    finally:
        engine.release(wan_pipe)

    assert isinstance(error, torch.OutOfMemoryError)  # hosts that unload on an OOM still do
    for name in ("text_encoder", "transformer", "vae"):
        assert f"  {name}: " in str(error)
    assert "Free memory when the run started: no reading on cpu." in str(error)


def test_the_start_reading_is_free_plus_cached_less_the_hosts_reserve() -> None:
    class Scripted(MemoryReader):
        def device_free(self, device: torch.device) -> tuple[int, int]:
            return (3 * GiB, GiB // 2) if device.type == "cuda" else (0, 0)

    cuda = read_device(Scripted(), "cuda:0")
    assert (cuda.device, cuda.free) == ("cuda:0", int(3.5 * GiB))
    assert cuda.total is None or cuda.total > 0  # read from the driver where there is one
    assert read_device(Scripted(), "cpu") == DeviceReading("cpu", None, None)
