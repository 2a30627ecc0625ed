"""An unfused LoRA (`lora/unfused.py`) in a compiled block's twin (`compiled.py`): the twin's layer
adds ``up(down(x)) (+ bias)`` to its own output, inside the graph, as the hook does eagerly.

Why: a LoRA on a quantized layer (fp8, int8, GGUF) is a hook, and a hook keeps its block eager, so
a LoRA on every block (a distilled-step LoRA on an fp8 Wan) would turn ``compile_blocks`` off for
the whole model. The twin takes the hook's factors, already on the device in the layer's compute
dtype (the hook's own copies: none is made twice), and computes the hook's ops in its order: the
same bits. The hook is read by its key and its ``factors`` / ``on_device``, so the transport does
not import the LoRA package.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..state import LORA_HOOK


def lora_of(module: torch.nn.Module, hooks: dict[str, object]) -> object | None:
    """The unfused LoRA hook on ``module`` (a Linear computing in a known dtype), or None."""
    hook = hooks.get(LORA_HOOK)
    return hook if hook is not None and isinstance(module, torch.nn.Linear) else None


def lora_twin(copy: torch.nn.Module, attrs: dict, hook: object, device: torch.device | None,
              compute: torch.dtype) -> None:
    """Make ``copy`` (its class already chosen, its attributes in ``attrs``) add ``hook``'s LoRA."""
    down, up, bias = hook.on_device(device or torch.device("cpu"), compute)  # (the engine's device has its index)
    attrs["lora_down"], attrs["lora_up"], attrs["lora_bias"] = down, up, bias
    copy.__class__ = _with_lora(copy.__class__)


def _lora_forward(self, x: torch.Tensor) -> torch.Tensor:
    out = super(type(self), self).forward(x)
    if self.lora_down is not None:
        h = F.linear(x.to(out.dtype), self.lora_down)
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]), self.lora_up.t())
        out = flat.view(out.shape)
    if self.lora_bias is not None:
        out = out + self.lora_bias
    return out


@functools.cache
def _with_lora(kind: type) -> type:
    return type(f"Lora{kind.__name__}", (kind,), {"forward": _lora_forward})
