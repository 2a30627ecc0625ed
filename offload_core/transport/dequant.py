"""fp8 weights outside the block streamer: one small hook per fp8 Linear that binds the weight's
compute value for its forward and the stored fp8 tensor back after it; on a model whose table
computes fp8 matmuls, the hook is `Fp8MatmulHook` on every transport, the streamer's included.

Registered before a transport is applied, so that it sits inside the transport's own hooks (a
leaf group's onload runs first, then the dequantisation on the device); the block streamer casts
its units itself (one cast per unit, `cast.py`) and takes these hooks off the layers it streams.
int8 weights (ComfyUI's int8_tensorwise) take the int8 kernel with a one-weight table (made once
per layer and device), torch's cast where it cannot run. GGUF layers take `gguf_dequant.py`'s hook.
"""

from __future__ import annotations

import torch
from diffusers.hooks import ModelHook

from ..formats.fp8 import Fp8Table, dequantize_int8, table_of
from ..log import get_logger
from ..state import DEQUANT_HOOK, hooks_of, is_ours
from . import fp8_kernel
from .base import add_hook, remove_hook
from .cast import weight_value
from .fp8_matmul import Fp8MatmulHook
from .gguf_dequant import GgufDequantHook, gguf_layers

log = get_logger("dequant")


class DequantHook(ModelHook):
    _diffusers_offload_hook = True  # `state.OURS`: under diffusers' layerwise-casting name, ours

    def __init__(self, table: Fp8Table) -> None:
        super().__init__()
        self.table = table
        self.stored: torch.Tensor | None = None  # the fp8 tensor while its compute value is bound
        self.int8_tables: dict[torch.device, tuple | None] = {}  # an int8 weight's kernel table, by device

    @property
    def compute_dtype(self) -> torch.dtype:
        """What diffusers' ``get_parameter_dtype`` reads from a layerwise-casting hook."""
        return self.table.compute

    def pre_forward(self, module: torch.nn.Module, *args, **kwargs):
        weight = module.weight
        if self.stored is not None:  # a forward that raised never reached post_forward
            weight.data = self.stored
        if weight.dtype == self.table.storage and self.table.int8:
            self.stored = weight.data
            weight.data = self._int8_value(weight)
        elif weight.dtype == self.table.storage:
            self.stored = weight.data
            weight.data = weight_value(self.table, weight)
        return args, kwargs

    def _int8_value(self, weight: torch.Tensor) -> torch.Tensor:
        """An int8 weight's compute value: the kernel where it runs, else torch's cast (same bits)."""
        data, device, compute = weight.data, weight.device, self.table.compute
        scale = self.table.int8_scale(weight, device)
        if fp8_kernel.available(data, fp8=False) and data.is_contiguous():
            if device not in self.int8_tables:
                self.int8_tables[device] = fp8_kernel.int8_table([0], [data.shape], [scale], device)
            out = torch.empty(data.shape, dtype=compute, device=device)
            if fp8_kernel.cast_int8_into(out.view(-1), data.view(-1), self.int8_tables[device]):
                return out
        return dequantize_int8(data, scale, compute)

    def post_forward(self, module: torch.nn.Module, output):
        self._restore(module)
        return output

    def deinitalize_hook(self, module: torch.nn.Module) -> torch.nn.Module:  # diffusers' spelling
        self._restore(module)
        return module

    def _restore(self, module: torch.nn.Module) -> None:
        if self.stored is not None:
            module.weight.data = self.stored
            self.stored = None


def fp8_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    table = table_of(model)
    if table is None:
        return []
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and table.holds(m.weight)]


def refuse_layerwise_casting(components) -> None:
    """Before anything is placed: an fp8 layer of ours that also carries diffusers' layerwise
    casting (the name our hook takes) is refused by its name; the user's hook stays."""
    for name, model in components:
        held = {id(layer) for layer in fp8_layers(model)}
        for path, layer in model.named_modules():
            hook = hooks_of(layer).get(DEQUANT_HOOK)
            if id(layer) in held and hook is not None and not is_ours(DEQUANT_HOOK, hook):
                raise ValueError(
                    f"{name}.{path} carries diffusers' layerwise casting (enable_layerwise_casting): "
                    "the pack stores and casts fp8 weights itself; reload the model without it"
                )


def register_dequant(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A dequantising (or fp8 matmul) hook on each fp8 Linear of ``model``, returning those layers,
    and the GGUF kernel's hook on each GGUF Linear (`gguf_dequant.py`; a user's hook of that name stays)."""
    table = table_of(model)
    layers = fp8_layers(model)
    for layer in layers:
        add_hook(layer, Fp8MatmulHook(table) if table.matmul else DequantHook(table), DEQUANT_HOOK)
    gguf = [m for m in gguf_layers(model) if DEQUANT_HOOK not in hooks_of(m)]
    for layer in gguf:
        add_hook(layer, GgufDequantHook(layer.compute_dtype), DEQUANT_HOOK)
    if gguf:
        log.info("%s: %d GGUF layers dequantised by the pack's kernel on a CUDA device (by diffusers' ops "
                 "elsewhere)", type(model).__name__, len(gguf))
    return layers


def remove_dequant(layers) -> None:
    for layer in layers:
        remove_hook(layer, DEQUANT_HOOK)
