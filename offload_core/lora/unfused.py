"""Unfused LoRA on quantized layers: a hook adds ``up(down(x))`` (strengths and scales folded into
``up``) to the layer's output, the stored weight is never written.

Why unfused: an fp8 or GGUF weight cannot take a delta in place without rounding most of it away,
and removal must be bit-exact (taking the hook off is). Which layers: a weight the model's fp8
table holds, a GGUF parameter, a stored (W4A8, W4A4, NVFP4, MXFP8) layer, any other tensor subclass or non-float weight, and every layer of a
component another quantizer made (its float weights may be views of packed data).

Where the factors live: resident on the device the layer computes on, copied there at the
layer's first forward after the hook is attached and kept until the hook comes off (a LoRA
removal, or a teardown, which strips `LORA_HOOK` with the other hooks of ours). They are a few
percent of the weights they modify; moving them with each streamed block would mean a
synchronous pageable copy per layer per forward on the compute stream. The hook only reads the
layer's input and output, never its weight, so it commutes with the fp8 dequantising hook and
with the block streamer binding the weight for the block's forward, wherever it sits among them.
The host copies (float32) stay in the component's LoRA state, so a teardown followed by the
next activation re-attaches hooks without reading a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook

from ..formats.fp8 import table_of
from ..formats.stored_linear import StoredLinear
from ..state import LORA_HOOK, REGISTRY
from ..transport.base import add_hook, remove_hook
from .files import LoraLayer

FUSABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True, eq=False)
class Factors:
    """One layer's stacked LoRAs in float32 on the host: ``delta = x @ down.T @ up.T + bias``."""

    down: torch.Tensor | None  # (rank, in)
    up: torch.Tensor | None  # (out, rank), strength * scale folded in
    bias: torch.Tensor | None  # (out,)

    @classmethod
    def of(cls, entries: list[tuple[LoraLayer, float]]) -> Factors:
        weighted = [(layer, strength * layer.scale) for layer, strength in entries if layer.up is not None]
        down = torch.cat([layer.down.float().flatten(1) for layer, _ in weighted]) if weighted else None
        up = torch.cat([layer.up.float().flatten(1) * c for layer, c in weighted], dim=1) if weighted else None
        biases = [layer.bias.float() * (strength * layer.scale) for layer, strength in entries if layer.bias is not None]
        return cls(down, up, torch.stack(biases).sum(0) if biases else None)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.down, self.up, self.bias

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes on the device in ``dtype``."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(t.numel() * size for t in self.tensors() if t is not None)


class LoraHook(ModelHook):
    """``output + up(down(x)) (+ bias)`` around the layer's forward (and whatever hooks sit inside).

    The input is held from ``pre_forward`` to ``post_forward`` rather than wrapping the forward
    (``new_forward``): diffusers' ``HookRegistry.remove_hook`` rewires the next hook's plain
    ``forward`` reference, which drops a ``new_forward`` hook registered after the removed one
    (its leaf-level lazy prefetch removes its tracker hooks after the first forward)."""

    def __init__(self, factors: Factors) -> None:
        super().__init__()
        self.factors = factors
        self._resident: tuple[torch.device, torch.dtype, tuple[torch.Tensor | None, ...]] | None = None
        self._x: torch.Tensor | None = None

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        self._x = args[0] if args else kwargs["input"]
        return args, kwargs

    def post_forward(self, module: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
        x, self._x = self._x, None
        down, up, bias = self.on_device(out.device, out.dtype)
        if down is not None:
            h = F.linear(x.to(out.device, out.dtype), down)
            if out.is_contiguous() and not torch.is_grad_enabled():  # no (tokens, out) temporary
                out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), up.t())
            else:
                out = out + F.linear(h, up)
        if bias is not None:
            out = out + bias
        return out

    def on_device(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor | None, ...]:
        """The factors (down, up, bias) on ``device`` in ``dtype``, copied once and kept while the
        hook is on (a compiled block's twin computes from them too, `transport/lora_twin.py`)."""
        if self._resident is None or self._resident[:2] != (device, dtype):
            moved = tuple(None if t is None else t.to(dtype).to(device) for t in self.factors.tensors())
            self._resident = (device, dtype, moved)
        return self._resident[2]

    def deinitalize_hook(self, module: torch.nn.Module) -> torch.nn.Module:  # diffusers' spelling
        self._resident = self._x = None
        return module


def unfused_reason(component: torch.nn.Module, layer: torch.nn.Module) -> str | None:
    """Why ``layer``'s weight cannot take a fused delta (``"fp8"``, ``"gguf"``, ...), or None."""
    if isinstance(layer, StoredLinear):
        return layer.NAME
    weight = layer.weight
    table = table_of(component)
    if table is not None and table.holds(weight):
        return "int8" if table.storage == torch.int8 else "fp8"
    if type(weight).__name__ == "GGUFParameter":  # (by name: diffusers' GGUF module needs the gguf package)
        return "gguf"
    method = _quant_method(component)
    if method is not None and method != "gguf":
        return str(method)
    if weight.dtype not in FUSABLE:
        return str(weight.dtype).removeprefix("torch.")
    if type(weight) not in PLAIN or type(weight.data) is not torch.Tensor:
        return type(weight).__name__
    return None


def _quant_method(component: torch.nn.Module) -> object | None:
    config = getattr(getattr(component, "config", None), "quantization_config", None) \
        or getattr(component, "quantization_config", None)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, Mapping) else getattr(config, "quant_method", None)
    return getattr(method, "value", method) or type(config).__name__


def attach(component: torch.nn.Module, factors: Mapping[str, Factors]) -> None:
    """A `LoraHook` on each layer named in ``factors``."""
    for path, f in factors.items():
        add_hook(component.get_submodule(path), LoraHook(f), LORA_HOOK)


def detach(component: torch.nn.Module, paths: list[str]) -> None:
    for path in paths:
        remove_hook(component.get_submodule(path), LORA_HOOK)


def attached(component: torch.nn.Module, factors: Mapping[str, Factors]) -> bool:
    """Every layer of ``factors`` carries its hook (a teardown strips them)."""
    for path, f in factors.items():
        registry = vars(component.get_submodule(path)).get(REGISTRY)
        hook = registry.hooks.get(LORA_HOOK) if registry is not None else None
        if not isinstance(hook, LoraHook) or hook.factors is not f:
            return False
    return True


def device_bytes(component: torch.nn.Module, factors: Mapping[str, Factors]) -> int:
    """Bytes the factors take on the device (in the dtype each layer computes in)."""
    total = 0
    for path, f in factors.items():
        layer = component.get_submodule(path)
        total += f.nbytes(_compute_dtype(component, layer))
    return total


def _compute_dtype(component: torch.nn.Module, layer: torch.nn.Module) -> torch.dtype:
    table = table_of(component)
    if table is not None and table.holds(layer.weight):
        return table.compute
    dtype = getattr(layer, "compute_dtype", None)  # diffusers' GGUFLinear
    if isinstance(dtype, torch.dtype):
        return dtype
    return layer.weight.dtype if layer.weight.dtype in FUSABLE else torch.bfloat16
