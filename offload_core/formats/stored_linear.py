"""A ComfyUI quantized layer held as stored (`w4a8.W4A8Linear`, `w4a4.W4A4Linear`, `nvfp4.NVFP4Linear`,
`mxfp8.MXFP8Linear`):
``nn.Linear``'s interface over the file's own tensors, computed by comfy-kitchen as ComfyUI's layer
computes it.

Why a layer rather than comfy-kitchen's ``QuantizedTensor``: a tensor subclass is what the
transports cannot move (SPEC §11); plain parameters and buffers are pinned, streamed and kept as
storage bytes by every transport with no special case. A layer's scales are buffers: a model's
dtype is read from its first float parameter (diffusers' ``get_parameter_dtype``; MiniMax-H3 casts
its inputs to it), which must not be an fp8 scale.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, Protocol

import torch

OPS = "diffusers_offload"  # the namespace of the stored layers' opaque ops


def opaque(name: str, fake: Callable[..., torch.Tensor]) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorator: the kernel call ``fn`` as it is, but inside a compiled region the custom op
    ``diffusers_offload::<name>`` (``fake`` gives its output's shape and dtype), which the compiler
    calls whole. Why: comfy-kitchen's CUDA calls hand tensors over through ``__dlpack__``, which a
    trace's fake tensors cannot (a W4A8 or W4A4 block compiled on a GPU failed); direct calls
    outside keep the dispatcher's cost off every eager forward."""

    def wrap(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        try:  # (registered once a process: the pack's modules may be imported under two names)
            op = getattr(getattr(torch.ops, OPS), name)
        except (AttributeError, RuntimeError):
            op = torch.library.custom_op(f"{OPS}::{name}", fn, mutates_args=())
            op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args: Any) -> torch.Tensor:
            return op(*args) if torch.compiler.is_compiling() else fn(*args)

        return call

    return wrap


@functools.cache  # a failed import is not cached
def kitchen_module(name: str, what: str) -> ModuleType:
    """comfy-kitchen's module ``name``, or an ImportError saying that ``what`` files need it and how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"{what} files run through comfy-kitchen, which this Python does not have: update ComfyUI "
                          "(its requirements install comfy-kitchen) or pip install comfy-kitchen") from exc


class StoredLinear(torch.nn.Module):
    """The base of the stored layers: ``FORMAT`` is the ``comfy_quant`` format, ``NAME`` its short
    name (logs, the LoRA report), ``TENSORS`` what the file holds beside ``<layer>.weight``;
    ``compute`` is the bias's dtype."""

    FORMAT: ClassVar[str]
    NAME: ClassVar[str]
    TENSORS: ClassVar[tuple[str, ...]]

    def __init__(self, in_features: int, out_features: int, bias: bool, compute: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.compute = in_features, out_features, compute
        self.bias = torch.nn.Parameter(torch.empty(out_features, dtype=compute, device=device),
                                       requires_grad=False) if bias else None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def decoded_forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The layer's output from its decoded ``weight`` (padded: cut to the layer's shape), in the
        input's dtype."""
        weight = weight[: self.out_features, : self.in_features].to(x.dtype)
        return torch.nn.functional.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def stored(self, name: str, *shape: int, dtype: torch.dtype, device: torch.device | str | None) -> None:
        """Register the stored tensor ``name``: the weight a parameter (no gradient), the rest buffers."""
        t = torch.empty(shape, dtype=dtype, device=device)
        if name == "weight":
            self.weight = torch.nn.Parameter(t, requires_grad=False)
        else:
            self.register_buffer(name, t)


def swap_in(model: torch.nn.Module, layers: list[str], make: Callable[[str, torch.nn.Linear], StoredLinear]) -> None:
    """Replace each named ``nn.Linear`` of ``model`` (on the meta device) by ``make(name, linear)``;
    a layer that is no Linear raises ValueError naming it."""
    for name in layers:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child, None)
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"{name} is stored quantized but is a {type(linear).__name__} in "
                             f"{type(model).__name__}, not a Linear layer")
        setattr(parent, child, make(name, linear))


def stored_keys(layers: list[str], tensors: tuple[str, ...]) -> set[str]:
    """The state-dict keys stored ``layers`` hold as stored (never cast to the compute dtype)."""
    return {f"{n}.{t}" for n in layers for t in ("weight", *tensors)}


def whole(layers: Iterable[str]) -> dict[str, tuple[str, slice]]:
    """The ``traced`` of a format's ``attach`` for a state no conversion splits (a text encoder's
    renames): each layer its own, every row."""
    return {layer: (layer, slice(None)) for layer in layers}


def layers_holding(state: dict[str, torch.Tensor], suffix: str, key: str, dtype: torch.dtype) -> list[str]:
    """The layers of ``state`` with a ``<layer><suffix>`` whose ``<layer><key>`` is of ``dtype``."""
    return sorted(layer for layer in (k.removesuffix(suffix) for k in state if k.endswith(suffix))
                  if getattr(state.get(layer + key), "dtype", None) == dtype)


def stored_format(model: torch.nn.Module) -> str | None:
    """The ``comfy_quant`` format of the model's first stored layer, or None."""
    return next((m.FORMAT for m in model.modules() if isinstance(m, StoredLinear)), None)


class StoredKind(Protocol):
    """One stored format as the loaders meet it (`w4a8.Kind`, `w4a4.Kind`, `nvfp4.Kind`,
    `mxfp8.Kind`): its tensors beside the weights taken out of a file's state before a key conversion
    (`pop`) and put back beside the converted weights (`attach`, ``traced`` mapping each converted
    layer to its file layer and rows, `scale_trace`); then its layers there (their tensors readied in
    place), a layer decoded to a weight, and the layer that holds it as stored."""

    NAME: str
    TENSORS: tuple[str, ...]

    def pop(self, path: Path, state: dict[str, torch.Tensor]) -> dict[str, Any]: ...

    def attach(self, state: dict[str, torch.Tensor], extras: dict[str, Any],
               traced: dict[str, tuple[str, torch.Tensor | slice]]) -> None: ...

    def layers(self, state: dict[str, torch.Tensor]) -> list[str]: ...

    def decoded(self, state: dict[str, torch.Tensor], name: str, shape: tuple[int, int], dtype: torch.dtype
                ) -> torch.Tensor: ...

    def make(self, name: str, linear: torch.nn.Linear, state: dict[str, torch.Tensor], compute: torch.dtype
             ) -> StoredLinear: ...


def swap_stored(model: torch.nn.Module, state: dict[str, torch.Tensor], kinds: list[StoredKind], compute: torch.dtype,
                fp32: Callable[[str], bool] = lambda _name: False) -> tuple[set[str], dict[str, tuple[int, int]]]:
    """Each kind's layers in ``state`` become its stored layers in ``model`` (built on the meta
    device); a layer ``fp32`` names (diffusers keeps it in float32) is decoded to a float32 weight
    of its shape instead. Returns the keys held as stored and, by format, (layers kept, layers
    decoded); a layer that is no Linear raises ValueError naming it."""
    kept: set[str] = set()
    counts: dict[str, tuple[int, int]] = {}
    for kind in kinds:
        layers = kind.layers(state)
        decoded = [n for n in layers if fp32(n)]
        for name in decoded:
            linear = model.get_submodule(name)
            state[f"{name}.weight"] = kind.decoded(state, name, (linear.out_features, linear.in_features),
                                                   compute).float()
        swapped = [n for n in layers if n not in decoded]
        swap_in(model, swapped, lambda name, linear, kind=kind: kind.make(name, linear, state, compute))
        kept |= stored_keys(swapped, kind.TENSORS)
        if layers:
            counts[kind.NAME] = (len(swapped), len(decoded))
    return kept, counts
