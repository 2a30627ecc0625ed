"""ComfyUI's model management on one side, the offload engine on the other.

The only module of the pack that imports ``comfy.model_management``. A loaded pipeline is
registered as one `DiffusersPatcher` (a classic ``ModelPatcher``), so ComfyUI's loads,
``free_memory``, unload-all and cache eviction see it, and every size ComfyUI reads is the
engine's own account of what sits on the device. ComfyUI's calls map to the engine:

- ``load`` / ``partially_load``  -> ``Engine.place`` (idempotent; changed settings re-place)
- ``partially_unload``           -> ``Engine.give_back`` (drops kept blocks, idle on-demand modules)
- ``detach(unpatch_all=True)``   -> ``Engine.release`` (via ``unpatch_model``: hooks stripped,
  weights in host memory, pinned pages unregistered); ``detach(unpatch_all=False)`` (a clone
  taking over, a patcher being collected) leaves the placement alone.

Observers (the web view) learn of loads, placement changes and ends of calls through named
subscriptions (`subscribe`); this module imports none of them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import comfy.model_management as mm
import folder_paths
import psutil
import torch
from comfy.cli_args import args
from comfy.model_patcher import ModelPatcher
from comfy.patcher_extension import CallbacksMP

from ..offload_core import Engine, OffloadConfig, PlacementReport
from ..offload_core.memory import MemoryReader, PinLimit
from ..offload_core.preload import notify_model_load, process_store
from ..offload_core.transport.fp8_matmul import runs_here

log = logging.getLogger("diffusers_offload.nodes")

OFFLOAD_DEVICE = torch.device("cpu")
MEASURES_FILE = Path("diffusers_offload") / "measures.json"


class ComfyMemory(MemoryReader):
    """Device readings less ComfyUI's reserve (``--reserve-vram``), so preload never plans into it;
    ComfyUI's cap on pinned memory bounds the engine's pins too."""

    def device_free(self, device: torch.device) -> tuple[int, int]:
        free, cached = super().device_free(device)
        return max(free - int(mm.extra_reserved_memory()), 0), cached

    def pin_limit(self) -> PinLimit | None:
        return comfy_pin_limit()


def comfy_pin_limit() -> PinLimit | None:
    """ComfyUI's own cap on page-locked memory, ``MAX_PINNED_MEMORY`` (v0.3.75: 45 % of RAM on
    Windows, 95 % elsewhere; 2026 trees: 40 % on Windows, up to 90 % elsewhere), less what ComfyUI
    has pinned itself (``TOTAL_PINNED_MEMORY``): what the pack may lock beside it. None where
    ComfyUI sets none (no NVIDIA or AMD device; ``--disable-pinned-memory`` turns the pack's
    ``pin_memory`` off instead, in `effective_config`). Logged once when first read."""
    cap = float(getattr(mm, "MAX_PINNED_MEMORY", -1) or -1)
    if cap <= 0:
        return None
    own = int(getattr(mm, "TOTAL_PINNED_MEMORY", 0) or 0)
    where = "Windows" if getattr(mm, "WINDOWS", False) else "this system"
    source = (f"ComfyUI's pinned-memory cap {cap / 2**30:.2f} GiB ({cap / psutil.virtual_memory().total:.0%} of RAM "
              f"on {where}) less its own pins {own / 2**30:.2f} GiB")
    if "pin_limit" not in _noted:
        _noted.add("pin_limit")
        log.info("pinning: %s also bounds the pack's pinned weights and staging buffers", source)
    return PinLimit(int(cap) - own, source)


ENGINE = Engine(memory=ComfyMemory())
_measures_path: Path | None = None  # the file the process-wide measure store saves to
_noted: set[str] = set()  # flag adjustments already logged

EVENTS = ("loaded", "changed", "finished")
Listener = Callable[["DiffusersPatcher"], None]
_subscribers: dict[str, dict[str, Listener]] = {}


def subscribe(name: str, **listeners: Listener) -> None:
    """Call ``listeners`` (keyed by `EVENTS`: a pipeline was ``loaded``, its placement may have
    ``changed``, a call on it ``finished``) with the patcher; a second subscription under the same
    name replaces the first. Listeners must be cheap; what they raise is logged, never propagated."""
    unknown = set(listeners) - set(EVENTS)
    if unknown:
        raise ValueError(f"unknown patcher events {sorted(unknown)}; known: {', '.join(EVENTS)}")
    _subscribers[name] = dict(listeners)


def unsubscribe(name: str) -> None:
    _subscribers.pop(name, None)


def _notify(event: str, patcher: DiffusersPatcher) -> None:
    for name, listeners in list(_subscribers.items()):
        listener = listeners.get(event)
        if listener is None:
            continue
        try:
            listener(patcher)
        except Exception:
            log.debug("subscriber %r failed on %s", name, event, exc_info=True)


def effective_config(config: OffloadConfig) -> OffloadConfig:
    """The user's settings with ComfyUI's launch flags applied: the flags describe the machine.

    ``--cpu`` or no device -> ComfyUI's device; ``--highvram`` / ``--gpu-only`` -> mode ``none``
    (unless a mode other than ``auto`` was chosen); ``--novram`` -> no preload and nothing kept
    resident for being small; ``--disable-pinned-memory`` -> no pinning.
    """
    changes: dict[str, Any] = {}
    if args.cpu or not config.device:
        changes["device"] = str(mm.get_torch_device())
    if (args.highvram or args.gpu_only) and config.mode == "auto":
        changes["mode"] = "none"
    if args.novram:
        changes.update(preload="off", resident_floor_mb=0.0, on_demand_threshold_gb=0.0)
    if args.disable_pinned_memory:
        changes["pin_memory"] = False
    if not changes:
        return config
    adjusted = config.replace(**changes)  # parsed as the engine reads them (preload: a policy)
    note = ", ".join(f"{k} {str(getattr(config, k))!r} -> {str(getattr(adjusted, k))!r}"
                     for k in changes if getattr(config, k) != getattr(adjusted, k))
    if note and note not in _noted:
        _noted.add(note)
        log.info("ComfyUI's launch flags adjust the offload settings: %s", note)
    return adjusted


def allocator_note(backend: str) -> str | None:
    """What a user should know of the allocator ComfyUI started PyTorch with: under
    ``cudaMallocAsync`` (ComfyUI's default) the engine cannot turn expandable segments on, so a
    video on a small card keeps fewer blocks resident, and a CUDA graph's memory is taken by the
    driver at its first launch, outside the allocator (see bench/README.md, runs 37 and 61–63)."""
    if backend != "cudaMallocAsync":
        return None
    return ("ComfyUI runs PyTorch's cudaMallocAsync allocator: a video on a small card keeps fewer blocks resident "
            "than on the native allocator, where the engine turns expandable segments on, and the blocks' CUDA graphs "
            "take their memory from the driver at their first launch, outside the allocator (a graph waits, its call "
            "eager, until the driver's free memory covers it); "
            "launch ComfyUI with --disable-cuda-malloc for video work or a model much larger than the card")


def note_allocator(config: OffloadConfig) -> None:
    """Log `allocator_note` once, at the first placement on a CUDA device."""
    if "allocator" in _noted or not config.device.startswith("cuda"):
        return
    _noted.add("allocator")
    note = allocator_note(torch.cuda.get_allocator_backend())
    if note:
        log.info(note)


def auto_dtype(config: OffloadConfig) -> torch.dtype:
    """The weight dtype ComfyUI would pick for the device the pipeline will run on."""
    device = torch.device(effective_config(config).device)
    if mm.should_use_bf16(device):
        return torch.bfloat16
    if mm.should_use_fp16(device):
        return torch.float16
    return torch.float32


def fp8_matmul(config: OffloadConfig) -> bool:
    """Whether the device the pipeline will run on has fp8 matmuls (said once where it has not)."""
    device = torch.device(effective_config(config).device)
    if runs_here(device):
        return True
    if "fp8_matmul" not in _noted:
        _noted.add("fp8_matmul")
        log.info("%s has no fp8 matmuls (sm_89 or newer): fp8_e4m3fn_fast stores fp8 and computes in %s", device,
                 str(auto_dtype(config)).removeprefix("torch."))
    return False


def check_interrupt() -> None:
    """Raise ComfyUI's interrupt exception when the user pressed Cancel (the flag is then reset)."""
    mm.throw_exception_if_processing_interrupted()


def diffusers_roots() -> list[str]:
    """``models/diffusers`` and every location ``extra_model_paths.yaml`` adds for it."""
    return list(folder_paths.get_folder_paths("diffusers"))


def attach_measures(path: str | None) -> None:
    """Persist preload measures (default: ComfyUI's user directory) so a restart plans from the
    first step; re-attached only when the path changes."""
    global _measures_path
    target = Path(path) if path else Path(folder_paths.get_user_directory()) / MEASURES_FILE
    if target != _measures_path:
        process_store().attach(target)
        _measures_path = target


class DiffusersPipeline(torch.nn.Module):
    """Stands in as ``ModelPatcher.model`` (ComfyUI logs its class name): it owns no tensor, so
    ComfyUI's ``module_size``, ``.to()`` and lowvram walks can neither count nor move the
    pipeline's weights (the engine owns them). It carries what every clone of the patcher shares."""

    def __init__(self, pipe: Any, dtype: torch.dtype, config: OffloadConfig) -> None:
        super().__init__()
        self.pipe = pipe
        self.dtype = dtype
        self.config = config  # the effective settings the next placement uses


class DiffusersPatcher(ModelPatcher):
    """One loaded pipeline as ComfyUI's model management sees it (see the module docstring).

    A classic ``ModelPatcher`` subclass: ``is_dynamic()`` stays False, so DynamicVRAM's
    ``ModelPatcherDynamic`` (swapped in for ``CoreModelPatcher`` only) never takes it over.
    """

    @property
    def pipe(self) -> Any:
        return self.model.pipe

    # -- what the nodes call ----------------------------------------------------------------
    def prepare(self, config: OffloadConfig, memory_required: int = 0) -> None:
        """(Re)place through ComfyUI's loader, the way core nodes load a model before use (the
        handle reads the report once its LoRA set is effective: `PipeHandle.prepare`)."""
        effective = effective_config(config)
        attach_measures(effective.measures_path)
        self._retarget(torch.device(effective.device))
        self.model.config = effective
        mm.load_models_gpu([self], memory_required=memory_required or ENGINE.memory_required(self.pipe))

    def finish(self) -> None:
        """End of a pipeline call: on-demand modules go home, streamed blocks are released (their
        streaming buffers stay for the next call: `BlockStreamer.after_run`)."""
        ENGINE.after_run(self.pipe)
        self._sync()
        _notify("finished", self)

    def report(self) -> PlacementReport:
        return ENGINE.report(self.pipe)

    # -- what ComfyUI reads -------------------------------------------------------------------
    def loaded_size(self) -> int:
        return ENGINE.device_bytes(self.pipe)

    def current_loaded_device(self) -> torch.device:
        return self.load_device if self._placed() else self.offload_device

    def model_dtype(self) -> torch.dtype:
        return self.model.dtype

    # -- what ComfyUI asks for ----------------------------------------------------------------
    def load(self, device_to: torch.device | None = None, lowvram_model_memory: float = 0,
             force_patch_weights: bool = False, full_load: bool = False) -> None:
        notify_model_load()
        note_allocator(self.model.config)
        ENGINE.place(self.pipe, self.model.config)
        self._sync()
        for callback in self.get_all_callbacks(CallbacksMP.ON_LOAD):
            callback(self, device_to, lowvram_model_memory, force_patch_weights, full_load)

    def partially_load(self, device_to: torch.device, extra_memory: float = 0,
                       force_patch_weights: bool = False) -> int:
        """ComfyUI's budget is for its own per-layer loading; the engine sizes its preload from
        the device's free memory itself. A negative budget asks for memory back."""
        if extra_memory < 0 and self._placed():
            self.partially_unload(self.offload_device, -extra_memory)
            return 0
        before = self.loaded_size()
        self.load(device_to, extra_memory, force_patch_weights)
        return max(self.loaded_size() - before, 0)

    def partially_unload(self, device_to: torch.device, memory_to_free: float = 0,
                         force_patch_weights: bool = False) -> int:
        freed = ENGINE.give_back(self.pipe, int(memory_to_free)) if self._placed() else 0
        self._sync()
        log.info("%s gave back %.2f MiB of %.2f MiB asked", type(self.pipe).__name__,
                 freed / 2**20, memory_to_free / 2**20)
        return freed

    def unpatch_model(self, device_to: torch.device | None = None, unpatch_weights: bool = True) -> None:
        """Where ``detach(unpatch_all=True)`` puts weights back: release the whole placement."""
        super().unpatch_model(device_to, unpatch_weights)
        if unpatch_weights and self._placed():
            # inside ComfyUI's free_memory loop: a gc here runs ComfyUI's finalizers of other dead
            # models, which pop entries of current_loaded_models under the loop (IndexError on 0.3.75)
            ENGINE.release(self.pipe, collect=False)
        self._sync()

    # -- internals ---------------------------------------------------------------------------
    def _placed(self) -> bool:
        return bool(ENGINE.states(self.pipe))

    def _sync(self) -> None:
        """Mirror the engine's account into the counters ComfyUI reads straight off the module."""
        self.model.device = self.current_loaded_device()
        self.model.model_loaded_weight_memory = self.loaded_size()
        _notify("changed", self)

    def _retarget(self, device: torch.device) -> None:
        """ComfyUI files a loaded model under its load device: on a device change, unload the
        old entry (releasing the placement) before filing the new one."""
        if device == self.load_device:
            return
        loaded = mm.current_loaded_models
        for i in reversed(range(len(loaded))):
            if loaded[i].model is not None and self.is_clone(loaded[i].model):
                loaded.pop(i).model_unload()
        self.load_device = device


def manage(pipe: Any, dtype: torch.dtype, config: OffloadConfig) -> DiffusersPatcher:
    """Wrap a freshly loaded pipeline; its placement is released when the last patcher goes."""
    holder = DiffusersPipeline(pipe, dtype, effective_config(config))
    size = sum(c.nbytes for c in ENGINE.report(pipe).components)
    patcher = DiffusersPatcher(holder, torch.device(holder.config.device), OFFLOAD_DEVICE, size)
    weakref.finalize(holder, _release_if_placed, pipe).atexit = False
    _notify("loaded", patcher)
    return patcher


def _release_if_placed(pipe: Any) -> None:
    if ENGINE.states(pipe):
        ENGINE.release(pipe)

