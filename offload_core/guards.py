"""What a placement pass refuses before it touches anything: a device that is not there, a
component another offload system already manages (two systems corrupt each other's idea of
where the weights are), and a component quantized in a way its transport cannot move (unless it
stays resident): torchao weights ride the whole-module transports (on demand, leaf groups, resident)
but not the block streamer. Refusals name the thing to change and leave the user's objects as
they were."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .components import describe
from .config import OffloadConfig, OffloadConfigError
from .log import get_logger
from .roles import Role, RoleDecision, decide
from .state import COMPONENT, DIFFUSERS_GROUP_HOOKS, hooks_of

log = get_logger("guards")


def onload_device(config: OffloadConfig) -> torch.device:
    """The device the config asks for (default: the current CUDA device, else the CPU), with its
    index (``cuda`` is ``cuda:<current>``, the device its tensors name: copies kept per device,
    as an unfused LoRA's factors, are keyed by it), refused by name when this machine lacks it."""
    if not config.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    try:
        device = torch.device(config.device)
    except (RuntimeError, ValueError) as exc:
        raise OffloadConfigError(f"device {config.device!r} is not a device name: {exc}") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)
    if backend is None or not backend.is_available():
        raise OffloadConfigError(
            f"device {config.device!r} is not available on this machine (no {device.type} "
            "runtime): choose another device or leave the device empty"
        )
    if device.index is not None and device.index >= backend.device_count():
        raise OffloadConfigError(
            f"device {config.device!r} is not available: this machine has "
            f"{backend.device_count()} {device.type} device(s)"
        )
    current = getattr(backend, "current_device", None)
    return torch.device(device.type, current()) if device.index is None and current is not None else device


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
                    "before handing the pipeline to the offload engine"
                )
            hooks = hooks_of(sub)
            if any(h in hooks for h in DIFFUSERS_GROUP_HOOKS):
                raise ValueError(
                    f"{where} is managed by diffusers' group offload (enable_group_offload / "
                    "apply_group_offloading): remove it (diffusers.hooks.group_offloading) or reload the model "
                    "before handing the pipeline to the offload engine"
                )


# Quantizations verified to ride every transport (their weights are plain tensors, or diffusers'
# `GGUFParameter` whose quant type rides along with the Parameter): the pack's fp8 table, BFL fp8r
# (fp8 weights, per-row scales as plain buffers), GGUF, ComfyUI's W4A8 layers (`formats/w4a8.py`:
# packed weights and scales as plain parameters). Another method whose weights are all plain
# tensors is moved by its bytes too (logged as not verified); the families below never are, except
# torchao (SWAPPED) on the transports that move whole tensors.
MOVABLE_QUANT = ("gguf", "bfl", "fp8-weights", "comfy")
_WRAPPER = (
    "a tensor subclass holding its quantized data in inner tensors: the engine's transports "
    "rebind param.data, which replaces only the wrapper and leaves the inner tensors behind "
    "(the layer would keep computing from the old ones)"
)
_STREAMED_WHY = (
    "a tensor subclass holding its quantized data in inner tensors (qdata, scale, ...): the block "
    "streamer copies each weight's storage into one flat buffer per block and binds param.data to "
    "views of it, which such a tensor cannot take (its inner tensors are moved only by swapping "
    "the whole tensor)"
)
_UNMOVABLE_WHY = {
    "torchao": _STREAMED_WHY,  # on the block streamer only (SWAPPED below)
    "quanto": _WRAPPER,
    "bitsandbytes": (
        "bitsandbytes parameters (Params4bit/Int8Params) keep their quantization state "
        "(absmax, scales) outside the weight's storage, so moving the weight bytes leaves it behind"
    ),
}
_UNKNOWN_TYPE_WHY = (
    "a tensor type the engine does not know: its transports rebind param.data, which carries "
    "only a plain tensor's storage"
)
# Weight types the whole-module transports swap in whole (`formats/torchao.py`): torchao int8
# weight-only, verified; another torchao type is refused by its type. The block streamer cannot
# carry them (why below).
SWAPPED = ("torchao",)
SWAPPED_TYPES = ("torchao.Int8Tensor",)
_UNVERIFIED_WHY = (
    "a torchao tensor type the engine's moves are not verified on (int8 weight-only's Int8Tensor is): "
    "its data lives in inner tensors that only a swap of the whole tensor moves"
)


def _family(quantization: str | None, tensor_type: str | None) -> str | None:
    """The refused family named by the method (`describe`'s string) or else by the tensor type."""
    method = (quantization or "").split(" ")[0]
    if method:
        family = next((k for k in _UNMOVABLE_WHY if k in method), None)
        if family is not None:
            return family
    return next((k for k in _UNMOVABLE_WHY if k in tensor_type), None) if tensor_type else None


def unmovable_quantization(
    quantization: str | None, tensor_type: str | None = None, streamed: bool = True
) -> str | None:
    """Why the engine cannot move a component described with ``quantization`` (`describe`'s
    string) whose first non-plain parameter type is ``tensor_type``, or None when it can. A
    torchao component is movable by the whole-module transports (``streamed`` False) only."""
    family = _family(quantization, tensor_type)
    if family in SWAPPED and tensor_type is not None and tensor_type not in SWAPPED_TYPES:
        return f"has {tensor_type} weights: {_UNVERIFIED_WHY}"
    if family in SWAPPED:
        if not streamed:
            return None
        what = f"is quantized by {quantization}" if quantization else f"has {tensor_type} weights"
        return f"{what}: {_STREAMED_WHY}"
    method = (quantization or "").split(" ")[0]
    if family is not None and method and family in method:
        return f"is quantized by {quantization}: {_UNMOVABLE_WHY[family]}"
    if tensor_type is not None:
        return f"has {tensor_type} weights: " + (_UNMOVABLE_WHY[family] if family else _UNKNOWN_TYPE_WHY)
    return None


def foreign_tensor_type(module: torch.nn.Module) -> str | None:
    """``library.Type`` of a parameter that is neither a plain tensor/Parameter nor diffusers'
    `GGUFParameter` (read from the type: holds without any quantization config): the first one
    the engine cannot swap (`SWAPPED_TYPES`), else the first one."""
    found: list[str] = []
    for param in module.parameters():
        cls = type(param)
        if cls in (torch.nn.Parameter, torch.Tensor) or cls.__name__ == "GGUFParameter":
            continue
        lib = (
            "optimum.quanto" if cls.__module__.startswith("optimum.quanto") else cls.__module__.split(".")[0]
        )
        found.append(f"{lib}.{cls.__name__}")
        if found[-1] not in SWAPPED_TYPES:
            return found[-1]
    return found[0] if found else None


def _streamed(decision: RoleDecision) -> bool:
    """Whether the role may put the component on a block streamer: the denoiser's per-step stream,
    or an auto-mode text encoder's layer stream (``pinned_stream``, granted or not at placement)."""
    return decision.role is Role.PER_STEP or decision.pinned_stream


def refuse_unmovable_quantization(
    components: Iterable[tuple[str, torch.nn.Module]], config: OffloadConfig
) -> None:
    """Refuse, before anything is placed, a component quantized in a way its transport cannot
    move (quanto, bitsandbytes, an unknown tensor type: unless its role keeps it resident;
    torchao: on the block streamer only): the error names the component, the method, why, and
    how to run it."""
    for name, module in components:
        info = describe(name, module)
        tensor_type = foreign_tensor_type(module)
        if unmovable_quantization(info.quantization, tensor_type) is None:
            if info.quantization and info.quantization.split(" ")[0] not in MOVABLE_QUANT:
                log.info(
                    "%s: quantized by %s, plain tensors: moved by their bytes (method not verified)",
                    name,
                    info.quantization,
                )
            continue
        decision = decide(info, config)
        why = unmovable_quantization(info.quantization, tensor_type, streamed=_streamed(decision))
        if why is None:
            log.info(
                "%s: %s weights moved whole (swap_tensors) by the %s role",
                name,
                info.quantization,
                decision.role.value,
            )
            continue
        if decision.role is Role.RESIDENT:
            log.info("%s: %s; kept resident (%s)", name, why.split(":")[0], decision.reason)
            continue
        raise OffloadConfigError(
            f"{name} ({info.cls}) {why}. The engine cannot give it the {_role_label(decision)} role "
            f"({decision.reason}). {_remedy(name, _swapped(info.quantization, tensor_type))}"
        )


def _swapped(quantization: str | None, tensor_type: str | None) -> bool:
    """Whether the component's weights are of a type the whole-module transports swap."""
    return _family(quantization, tensor_type) in SWAPPED and tensor_type in (None, *SWAPPED_TYPES)


def _role_label(decision: RoleDecision) -> str:
    """The role as the report names it; a leaf role that streams its layers says so."""
    return f"{decision.role.value} (layer stream)" if decision.pinned_stream else decision.role.value


def _remedy(name: str, swapped: bool) -> str:
    """What to change, for the refusal message: the modes that do carry the component."""
    resident = f"mode 'none', or add {name!r} to the never list"
    stream = "or load it in bf16/fp16, fp8 or GGUF to stream it"
    if swapped:
        return (
            "torchao weights ride mode 'model' (moved whole on demand) and mode 'leaf' (leaf-level groups), "
            f"or stay resident ({resident}); {stream}"
        )
    return f"Keep it resident on the device: {resident}; {stream}"
