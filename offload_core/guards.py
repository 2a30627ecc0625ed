"""What a placement pass refuses before it touches anything: a device that is not there, and a
component another offload system already manages (two systems corrupt each other's idea of
where the weights are). Refusals name the thing to change and leave the user's objects as they
were."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .config import OffloadConfig, OffloadConfigError
from .state import COMPONENT, DIFFUSERS_GROUP_HOOKS, REGISTRY


def onload_device(config: OffloadConfig) -> torch.device:
    """The device the config asks for (default: the current CUDA device, else the CPU),
    refused by name when this machine does not have it."""
    if not config.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(config.device)
    except (RuntimeError, ValueError) as exc:
        raise OffloadConfigError(f"device {config.device!r} is not a device name: {exc}") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    if backend is None or not backend.is_available():
        raise OffloadConfigError(f"device {config.device!r} is not available on this machine (no {device.type} "
                                 "runtime): choose another device or leave the device empty")
    if device.index is not None and device.index >= backend.device_count():
        raise OffloadConfigError(f"device {config.device!r} is not available: this machine has "
                                 f"{backend.device_count()} {device.type} device(s)")
    return device


def refuse_foreign_offload(components: Iterable[tuple[str, torch.nn.Module]]) -> None:
    """Refuse, before anything is placed, components carrying accelerate's offload hooks or
    diffusers' own group offloading that the engine did not put there."""
    for name, module in components:
        if COMPONENT.get(module) is not None:
            continue  # ours: leaf groups are diffusers' group offloading applied by the engine
        for sub_name, sub in module.named_modules():
            where = f"{name}{'.' + sub_name if sub_name else ''}"
            hook = vars(sub).get("_hf_hook")
            if hook is not None and type(hook).__module__.startswith("accelerate"):
                raise ValueError(
                    f"{where} carries an accelerate offload hook ({type(hook).__name__}): call "
                    "pipe.remove_all_hooks() (undo enable_model_cpu_offload / enable_sequential_cpu_offload) "
                    "before handing the pipeline to the offload engine")
            hooks = getattr(vars(sub).get(REGISTRY), "hooks", {})
            if any(h in hooks for h in DIFFUSERS_GROUP_HOOKS):
                raise ValueError(
                    f"{where} is managed by diffusers' group offload (enable_group_offload / "
                    "apply_group_offloading): remove it (diffusers.hooks.group_offloading) or reload the model "
                    "before handing the pipeline to the offload engine")
