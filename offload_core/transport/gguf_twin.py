"""diffusers' GGUF Linear layers in a compiled block's twin (`compiled.py`).

Why not the layer's own forward: dynamo traces a ``GGUFParameter`` through its
``__torch_function__``, which wraps every result of an op on it back into a ``GGUFParameter``
(the eager layer unwraps it first), so a graph break downstream rebuilds one without a quant type
and fails. The twin's layer instead holds a plain view of the packed bytes, taken from the
streamer's parameter for each call and dropped after it (the streamer rebinds that parameter), and
dequantises it with diffusers' own functions for the quant type: the ops of ``forward_native``.
Inductor rounds each dequantised weight once (to what the `gguf` package's dequantiser gives), where
the eager layer rounds through fp16 first. A block class compiles once per mix of quant types among
its layers (city96's K-quant rules make one to three mixes in a Wan file; dynamo allows eight). Not
with diffusers' optional CUDA kernels (``DIFFUSERS_GGUF_CUDA_KERNELS``): those layers keep their
block eager.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F

_NONE = torch.empty(0, dtype=torch.uint8)  # a twin's GGUF weight between calls


def gguf_layer(module: torch.nn.Module) -> bool:
    """A diffusers GGUF Linear over packed weights that computes by torch's ops."""
    weight = module._parameters.get("weight")
    if type(weight).__name__ != "GGUFParameter":
        return False
    from diffusers.quantizers.gguf import utils

    return isinstance(module, utils.GGUFLinear) and utils.ops is None


def gguf_twin(copy: torch.nn.Module, attrs: dict, weight: torch.nn.Parameter) -> None:
    """Make ``copy`` (being built from ``attrs``) the twin of a GGUF layer over ``weight``: its own
    parameter dict, the weight's shape and quant type's dequantiser, the source it views (`gguf_bound`)."""
    from diffusers.quantizers.gguf.utils import GGML_QUANT_SIZES, dequantize_functions

    attrs["_parameters"] = {**attrs["_parameters"], "weight": _NONE}
    attrs["gguf_source"], attrs["gguf_shape"] = weight, tuple(weight.quant_shape)
    attrs["gguf_sizes"], attrs["gguf_dequantize"] = GGML_QUANT_SIZES[weight.quant_type], dequantize_functions[weight.quant_type]
    copy.__class__ = _dequantizing(type(copy))


def gguf_bound(twin: torch.nn.Module) -> Callable[[], AbstractContextManager[None]]:
    """A context in which each GGUF layer of ``twin`` views its source's bytes as bound now; out
    of it the layer views none (a kept block's device bytes are freed when the plan drops it)."""
    layers = [(m._parameters, vars(m)["gguf_source"]) for m in twin.modules() if "gguf_source" in vars(m)]
    if not layers:
        return nullcontext

    @contextmanager
    def bound() -> Iterator[None]:
        for params, source in layers:
            params["weight"] = source.as_tensor()
        try:
            yield
        finally:
            for params, _source in layers:
                params["weight"] = _NONE

    return bound


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    block_size, type_size = self.gguf_sizes
    blocks = self.weight.view(torch.uint8).reshape(-1, type_size)
    weight = self.gguf_dequantize(blocks, block_size, type_size).reshape(self.gguf_shape)
    bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
    return F.linear(x, weight.to(self.compute_dtype), bias)


@functools.cache
def _dequantizing(kind: type) -> type:
    return type(f"Dequantizing{kind.__name__}", (kind,), {"forward": _forward})
