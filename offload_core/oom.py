"""The message of an out-of-memory error no retry could absorb: what was on the device, per
component, how much was free when the run started, and what to change.

Why: the engine already absorbs shortages it can (the preload gives kept blocks up and the block
runs again); an error that still escapes the pipeline call needs the user to change something, and
torch's own message names neither the components nor the settings that decide their share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .memory import MemoryReader
from .preload.policy import Policy, parse_policy
from .report import PlacementReport, gib


class RunOutOfMemory(torch.OutOfMemoryError):
    """An out-of-memory error with `out_of_memory_text` as its message; still a torch OOM, so hosts
    that treat OOMs apart (ComfyUI unloads its models on one) keep doing so."""


@dataclass(frozen=True)
class DeviceReading:
    """Free memory on the run's device (free plus cached-unused, less the host's reserve) and its
    total; None where the device has no such reading (the CPU)."""

    device: str
    free: int | None
    total: int | None


def read_device(memory: MemoryReader, device: str | torch.device) -> DeviceReading:
    dev = torch.device(device)
    total = None
    if dev.type == "cuda" and torch.cuda.is_available():
        total = int(torch.cuda.mem_get_info(dev)[1])
    return DeviceReading(str(dev), memory.device_available(dev), total)


def out_of_memory_text(report: PlacementReport, start: DeviceReading | None, preload: Policy | str,
                       allocator: str | None = None, error: BaseException | None = None) -> str:
    """The user's message: ``report`` is the placement when the error escaped (before the run's
    end sent anything home), ``start`` the reading taken when the run started, ``preload`` the
    setting the run was placed with, ``allocator`` torch's allocator backend where known."""
    lines = [f"Out of memory on {report.device} running {report.pipeline}; the offload could not absorb it."]
    if start is not None and start.free is not None:
        of = f" of {gib(start.total)}" if start.total else ""
        lines.append(f"Free on {start.device} when the run started: {gib(start.free)}{of}.")
    else:
        lines.append(f"Free memory when the run started: no reading on {start.device if start else report.device}.")
    lines.append(f"On the device at the error ({gib(report.device_bytes)} of the pipeline's, mode {report.mode}):")
    for c in sorted(report.components, key=lambda c: -c.device_bytes):
        kept = f", blocks kept {c.details['kept']}/{c.details['blocks']}" if "blocks" in c.details else ""
        lines.append(f"  {c.name}: {c.role}, {gib(c.device_bytes)} of {gib(c.nbytes)}{kept}")
    lines.append("What to change:")
    lines += [f"  - {tip}" for tip in _tips(report, parse_policy(preload), allocator)]
    lines.append("Everything the pack had placed was released; the next run places it again.")
    if error is not None and str(error):
        lines.append(f"(torch: {str(error).splitlines()[0]})")
    return "\n".join(lines)


def _tips(report: PlacementReport, preload: Policy, allocator: str | None) -> list[str]:
    tips = []
    if report.mode == "none":
        tips.append("offload mode 'none' (or --highvram / --gpu-only) keeps every component on the device: "
                    "use mode 'auto'")
    kept = sum(int(c.details.get("kept_bytes", 0)) for c in report.components)
    if preload.mode == "fixed":
        tips.append(f"lower preload (now {preload}), e.g. '{preload.budget / 2 / 2**30:.1f} GB', or set it 'off': "
                    "kept blocks leave less room for activations")
    elif preload.mode == "auto":
        smaller = f" or a fixed budget below the {gib(kept)} kept, e.g. '{kept / 2 / 2**30:.1f} GB'" if kept else ""
        tips.append(f"set preload 'off'{smaller}: kept blocks leave less room for activations")
    if allocator != "native":
        tips.append("launch ComfyUI with --disable-cuda-malloc (video on a small card: PyTorch's native allocator "
                    "with expandable segments fragments less than cudaMallocAsync)")
    tips.append("a smaller width/height, fewer frames or a smaller batch")
    return tips
