"""What a pipeline is made of: enumerate its components (classic and modular) and describe each.

Enumeration never raises because one property of a pipeline raises: every attribute is read
under its own guard, and the failure is logged and skipped.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .formats.convrot import RotatingLinear
from .formats.gguf import gguf_quant_types
from .formats.stored_linear import stored_format
from .formats.torchao import storage_bytes
from .log import get_logger
from .state import FP8

log = get_logger("components")

ENTRY_METHODS = ("encode", "decode")
# The slots a pipeline keeps its denoisers in (classic and modular), in the order a run uses them.
DENOISER_NAMES = ("transformer", "transformer_2", "transformer_ref", "unet", "unet_2", "prior", "decoder")


@dataclass(frozen=True)
class ComponentInfo:
    """Facts about one component, read from its tensors and class (never from its name alone)."""

    name: str
    cls: str
    nbytes: int
    dtypes: tuple[str, ...]
    quantization: str | None
    bridged_entries: tuple[str, ...]
    unbridged_entries: tuple[str, ...]
    opts_out: bool
    is_denoiser: bool
    is_text_encoder: bool


class Components:
    """A pipeline-shaped holder for bare modules (benchmarks, hosts that place one model):
    ``Components(transformer=model)`` is enumerated like a modular pipeline."""

    def __init__(self, **modules: torch.nn.Module) -> None:
        self._component_specs = dict.fromkeys(modules)
        for name, module in modules.items():
            setattr(self, name, module)


def _safe_getattr(obj: object, name: str) -> object | None:
    try:
        return getattr(obj, name, None)
    except Exception as exc:  # a pipeline property may raise; enumeration must go on
        log.warning("component %r could not be read (%s: %s); skipped", name, type(exc).__name__, exc)
        return None


def component_names(pipe: object) -> list[str]:
    """Names of the pipeline's components: modular specs first, else the classic registry."""
    specs = _safe_getattr(pipe, "_component_specs")
    if isinstance(specs, dict):
        return list(specs)
    config = _safe_getattr(pipe, "config")
    if config is not None and hasattr(config, "items"):
        return [k for k, v in config.items() if not k.startswith("_") and _is_component_entry(v)]
    return []


def _is_component_entry(value: object) -> bool:
    """A classic pipeline registers each component as ``[library, class]``; other config entries
    (``boundary_ratio``, ``expand_timesteps``...) are settings, and reading them can warn."""
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(
        v is None or isinstance(v, str) for v in value)


def iter_modules(pipe: object) -> Iterator[tuple[str, torch.nn.Module]]:
    """Yield (name, module) for every torch component the pipeline holds."""
    for name in component_names(pipe):
        value = _safe_getattr(pipe, name)
        if isinstance(value, torch.nn.Module):
            yield name, value


def denoisers(pipe: object) -> dict[str, torch.nn.Module]:
    """The pipeline's denoisers by slot name (``transformer``, ``transformer_2``, ``unet``...)."""
    return {name: m for name, m in iter_modules(pipe) if name in DENOISER_NAMES}


def denoiser(pipe: object) -> torch.nn.Module | None:
    """The pipeline's first denoiser (the one a single-denoiser run uses), or None."""
    return next(iter(denoisers(pipe).values()), None)


def patch_of(model: object) -> tuple[int, int, int]:
    """(t, h, w) patch of a denoiser; ``patch_size`` may be an int (then ``patch_size_t`` or 1
    in time) or a tuple."""
    config = getattr(model, "config", None) or {}
    patch = config.get("patch_size", 1) or 1
    if isinstance(patch, (tuple, list)):
        return (int(patch[0]), int(patch[-2]), int(patch[-1])) if len(patch) >= 3 else (1, int(patch[0]), int(patch[-1]))
    return int(config.get("patch_size_t", 1) or 1), int(patch), int(patch)


def tensors_of(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def module_bytes(module: torch.nn.Module) -> int:
    """Size measured from the tensors' storage (shared tensors counted once; a subclass weight
    such as torchao's by its inner tensors, not numel times its outer dtype)."""
    seen: set[int] = set()
    total = 0
    for t in tensors_of(module):
        key = id(t)
        if key in seen:
            continue
        seen.add(key)
        total += storage_bytes(t)
    return total




def _is_bridge(method: object) -> bool:
    """``method`` is diffusers' ``apply_forward_hook`` wrapper itself (it calls ``_hf_hook``)."""
    code = getattr(method, "__code__", None)
    return hasattr(method, "__wrapped__") and code is not None and code.co_filename.endswith("accelerate_utils.py")


def _is_bridged(method: object) -> bool:
    """True when a method carries diffusers' bridge, under any wrappers that name what they wrap
    (``functools.wraps``: a profiler's, another pack's)."""
    if not callable(method):
        return False
    try:
        return _is_bridge(inspect.unwrap(method, stop=_is_bridge))
    except ValueError:  # a cycle of wrappers
        return False


def _quantization(module: torch.nn.Module) -> str | None:
    """How the weights are quantized: GGUF types, a diffusers ``quant_method``, the library and
    type of a tensor-subclass weight, ComfyUI's stored (W4A8, W4A4, NVFP4, MXFP8) or int8 (convrot) layers, plain fp8 weights, or None."""
    gguf = gguf_quant_types(module)  # from_single_file sets no config.quantization_config
    if gguf:
        return "gguf " + "/".join(gguf)
    qc = getattr(getattr(module, "config", None), "quantization_config", None)
    if qc is None:
        qc = getattr(module, "quantization_config", None)
    if qc is None:  # from_single_file keeps the config on the quantizer only (BFL, torchao)
        qc = getattr(getattr(module, "hf_quantizer", None), "quantization_config", None)
    if qc is not None:
        method = getattr(qc, "quant_method", None) or type(qc).__name__
        return str(getattr(method, "value", method))
    odd = next((type(p) for p in module.parameters() if type(p) not in (torch.nn.Parameter, torch.Tensor)), None)
    if odd is not None:  # a tensor subclass without a config (torchao's quantize_, bitsandbytes, quanto)
        lib = "optimum.quanto" if odd.__module__.startswith("optimum.quanto") else odd.__module__.split(".")[0]
        return f"{lib} {odd.__name__}"
    stored = stored_format(module)
    if stored is not None:
        return "comfy " + stored
    table = FP8.get(module)
    if table is not None and table.int8:
        return "comfy int8_tensorwise" + (" convrot" if any(isinstance(m, RotatingLinear) for m in module.modules()) else "")
    fp8 = {t.dtype for t in module.parameters() if "float8" in str(t.dtype)}
    if not fp8:
        return None
    return "fp8-weights (fp8 matmul)" if table is not None and table.matmul else "fp8-weights"


def describe(name: str, module: torch.nn.Module) -> ComponentInfo:
    cls = type(module)
    bridged = tuple(m for m in ENTRY_METHODS if _is_bridged(getattr(cls, m, None)))
    unbridged = tuple(m for m in ENTRY_METHODS if callable(getattr(cls, m, None)) and m not in bridged)
    dtypes = tuple(sorted({str(t.dtype).removeprefix("torch.") for t in tensors_of(module)}))
    return ComponentInfo(
        name=name,
        cls=cls.__name__,
        nbytes=module_bytes(module),
        dtypes=dtypes,
        quantization=_quantization(module),
        bridged_entries=bridged,
        unbridged_entries=unbridged,
        opts_out=getattr(module, "_supports_group_offloading", True) is False,  # the instance, as diffusers reads it
        is_denoiser=_is_denoiser(name, module, bridged + unbridged),
        is_text_encoder=_is_text_encoder(module),
    )


def _is_text_encoder(module: torch.nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


def _is_denoiser(name: str, module: torch.nn.Module, entries: tuple[str, ...]) -> bool:
    """A diffusers model made of repeated blocks and not entered through encode/decode."""
    if entries or _is_text_encoder(module):
        return False
    repeated = getattr(type(module), "_repeated_blocks", None) or getattr(type(module), "_no_split_modules", None)
    return bool(repeated) or name in DENOISER_NAMES
