"""What a placement pass refuses before it touches anything: a device that is not there, a
component another offload system already manages (two systems corrupt each other's idea of
where the weights are), and a component quantized in a way the transports cannot move (unless it
stays resident). Refusals name the thing to change and leave the user's objects as they
were."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .components import describe
from .config import OffloadConfig, OffloadConfigError
from .log import get_logger
from .roles import Role, decide
from .state import COMPONENT, DIFFUSERS_GROUP_HOOKS, REGISTRY

log = get_logger("guards")


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


# Quantizations verified to ride every transport (their weights are plain tensors, or diffusers'
# `GGUFParameter` whose quant type rides along with the Parameter): the pack's fp8 table, BFL fp8r
# (fp8 weights, per-row scales as plain buffers), GGUF. Another method whose weights are all plain
# tensors is moved by its bytes too (logged as not verified); the families below never are.
MOVABLE_QUANT = ("gguf", "bfl", "fp8-weights")
_WRAPPER = ("a tensor subclass holding its quantized data in inner tensors: the engine's transports "
            "rebind param.data, which replaces only the wrapper and leaves the inner tensors behind "
            "(the layer would keep computing from the old ones)")
_UNMOVABLE_WHY = {
    "torchao": _WRAPPER,
    "quanto": _WRAPPER,
    "bitsandbytes": ("bitsandbytes parameters (Params4bit/Int8Params) keep their quantization state "
                     "(absmax, scales) outside the weight's storage, so moving the weight bytes leaves it behind"),
}
_UNKNOWN_TYPE_WHY = ("a tensor type the engine does not know: its transports rebind param.data, which carries "
                     "only a plain tensor's storage")


def unmovable_quantization(quantization: str | None, tensor_type: str | None = None) -> str | None:
    """Why the engine cannot move a component described with ``quantization`` (`describe`'s
    string) whose first non-plain parameter type is ``tensor_type``, or None when it can."""
    method = (quantization or "").split(" ")[0]
    family = next((k for k in _UNMOVABLE_WHY if k in method), None) if method else None
    if family is not None:
        return f"is quantized by {quantization}: {_UNMOVABLE_WHY[family]}"
    if tensor_type is not None:
        family = next((k for k in _UNMOVABLE_WHY if k in tensor_type), None)
        return f"has {tensor_type} weights: " + (_UNMOVABLE_WHY[family] if family else _UNKNOWN_TYPE_WHY)
    return None


def foreign_tensor_type(module: torch.nn.Module) -> str | None:
    """``library.Type`` of the first parameter that is neither a plain tensor/Parameter nor
    diffusers' `GGUFParameter` (read from the type: holds without any quantization config)."""
    for param in module.parameters():
        cls = type(param)
        if cls in (torch.nn.Parameter, torch.Tensor) or cls.__name__ == "GGUFParameter":
            continue
        lib = "optimum.quanto" if cls.__module__.startswith("optimum.quanto") else cls.__module__.split(".")[0]
        return f"{lib}.{cls.__name__}"
    return None


def refuse_unmovable_quantization(components: Iterable[tuple[str, torch.nn.Module]],
                                  config: OffloadConfig) -> None:
    """Refuse, before anything is placed, a component quantized in a way the transports cannot
    move (torchao, quanto, bitsandbytes, an unknown tensor type) unless its role keeps it
    resident: the error names the component, the method, why, and how to run it."""
    for name, module in components:
        info = describe(name, module)
        why = unmovable_quantization(info.quantization, foreign_tensor_type(module))
        if why is None:
            if info.quantization and info.quantization.split(" ")[0] not in MOVABLE_QUANT:
                log.info("%s: quantized by %s, plain tensors: moved by their bytes (method not verified)",
                         name, info.quantization)
            continue
        decision = decide(info, config)
        if decision.role is Role.RESIDENT:
            log.info("%s: %s; kept resident (%s)", name, why.split(":")[0], decision.reason)
            continue
        raise OffloadConfigError(
            f"{name} ({info.cls}) {why}. The engine cannot give it the {decision.role.value} role "
            f"({decision.reason}). Keep it resident on the device: mode 'none', or add {name!r} to the "
            "never list; or load it in bf16/fp16, fp8 or GGUF to stream it")
