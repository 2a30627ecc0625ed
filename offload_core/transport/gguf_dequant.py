"""diffusers' GGUF Linear layers on a CUDA device dequantised by one kernel (`gguf_kernel.py`)
instead of diffusers' dozen torch ops: one small hook per layer, under the dequantising hook's
name (`dequant.py`), registered before the transport's hooks so that the weight's packed bytes are
on the device when it runs. Elsewhere (the CPU, a quant type the kernel does not take, diffusers'
own CUDA kernels) the layer's forward runs as it is; the bits are the same either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook

from . import gguf_kernel
from .gguf_twin import gguf_layer


class GgufDequantHook(ModelHook):
    """One GGUF Linear's forward on its weight dequantised by the kernel."""

    _diffusers_offload_hook = True  # `state.OURS`

    def __init__(self, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.compute_dtype = compute_dtype  # what diffusers' ``get_parameter_dtype`` reads from a hook of this name

    def new_forward(self, module: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        weight = gguf_kernel.dequantized(module.weight, self.compute_dtype) if inputs.is_cuda else None
        if weight is None:
            return self.fn_ref.original_forward(inputs)
        bias = module.bias.to(self.compute_dtype) if module.bias is not None else None
        return F.linear(inputs, weight, bias)


def gguf_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s diffusers GGUF Linear layers that compute by torch's ops."""
    return [m for m in model.modules() if gguf_layer(m)]
