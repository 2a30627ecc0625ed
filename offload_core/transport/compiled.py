"""Compiled block forwards (``compile_blocks``): a block's own code run through ``torch.compile``.

Why twins: the streamer's hooks on a block's parts bind weights between its ops, which
``torch.compile`` cannot trace (each would be a graph break). A block whose units are all bound
at its entry needs none of them, so its forward runs on a *twin*: a shallow copy of its module
tree that shares every parameter and buffer (whatever the streamer binds them to) but not the
hooked ``forward`` attributes. One compiled function per block class serves every block of that
class (dynamo reads the twin's parameters as inputs and guards on its structure, not its
identity), so a 40-block model compiles once per input shape. Each model compiles its own copy
of the forward's code: dynamo keeps at most 8 compiled variants per code object and runs the
code eagerly beyond them (said only in its warning), so models sharing one would use up each
other's variants (bf16, fp8, GGUF twins, LoRA sets, shapes); a model's own die with it.
A twin's fp8 Linear layers dequantise their stored bytes inside the compiled graph
(``w.to(compute) * scale``, the bits of the streamer's cast, `cast.py`; int8 weights
``(q.float() * scale).to(compute)``, those of `fp8.dequantize_int8`), so the streamer casts
nothing for a compiled call of a block in parts (a block of one unit is cast as it binds); a weight the
streamer holds as compute values (`held_casts.py`) is used as it is. Layers computing fp8 matmuls
(`fp8_matmul.py`) compute them in the graph too, their inputs quantised in torch's ops. diffusers'
GGUF layers dequantise their packed bytes in the graph with diffusers' own functions, so the
compiler fuses the dozen small ops a layer runs eagerly (`gguf_twin.py`); an unfused LoRA on such
a layer adds its product in the graph (`lora_twin.py`). A block whose layers compute through any
other hook (a per-layer dequantising one) or hold other tensor subclasses runs eagerly: a twin
would skip what those do. Where the
compiler cannot run at all (no working Triton, as on many Windows installs), compiling turns
itself off for the streamer, said once, and the call runs its twin eagerly. Why not diffusers'
``compile_repeated_blocks``: it compiles the module's call, hooks and all.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..formats.convrot import RotatingLinear, group_of, hadamard, rotated
from ..formats.fp8 import Fp8Table
from ..log import get_logger
from ..state import COMPILED, DEQUANT_HOOK, REGISTRY, STREAM_HOOK, hooks_of
from .blocks import StreamBlock
from .fp8_matmul import (
    Fp8MatmulHook,
    dequantised_linear,
    runs_here,
    scale_tensors,
    scaled_linear,
    takes,
    torch_quantise,
)
from .gguf_dequant import GgufDequantHook
from .gguf_twin import gguf_bound, gguf_layer, gguf_twin
from .lora_twin import lora_of, lora_twin

log = get_logger("compile")

BACKEND: str | Callable[..., object] = "inductor"  # torch.compile's backend (CPU tests: "aot_eager", no codegen)
PLAIN = (torch.Tensor, torch.nn.Parameter)


def twin(module: torch.nn.Module, fp8: Fp8Table | None = None, device: torch.device | None = None) -> torch.nn.Module:
    """``module``'s tree without the hooked ``forward`` attributes and registries, sharing its
    parameter and buffer dicts (so a weight bound by the streamer is bound in the twin too); a
    Linear layer whose weight ``fp8`` lists dequantises it (its scale a buffer of the twin only), a
    GGUF layer its packed bytes (`gguf_twin.py`), and an unfused LoRA adds its product (`lora_twin.py`)."""
    copy = object.__new__(type(module))
    attrs = dict(vars(module))
    attrs.pop("forward", None)
    attrs.pop(REGISTRY, None)
    attrs["_modules"] = {name: None if child is None else twin(child, fp8, device)
                         for name, child in module._modules.items()}
    weight = module._parameters.get("weight")
    stored = _stored(module, fp8)
    if gguf_layer(module):
        gguf_twin(copy, attrs, weight)
    elif stored and fp8.int8:
        attrs["_buffers"] = {**module._buffers, "int8_scale": fp8.int8_scale(weight, device)}
        attrs["int8_compute"] = fp8.compute
        copy.__class__ = _int8_dequantizing(type(module))
    elif stored:
        scale = torch.tensor(fp8.scale_of(weight) or 1.0, dtype=fp8.compute, device=device)
        attrs["_buffers"] = {**module._buffers, "fp8_scale": scale}
        attrs["fp8_storage"], attrs["fp8_compute"] = fp8.storage, fp8.compute
        matmul = isinstance(hooks_of(module).get(DEQUANT_HOOK), Fp8MatmulHook)
        copy.__class__ = (_fp8_matmul if matmul else _dequantizing)(type(module))
        if matmul:
            one, wscale, static = scale_tensors(fp8, weight, device)
            attrs["_buffers"].update(fp8_one=one, fp8_wscale=wscale, fp8_static=static)
    if group_of(module):  # a convrot layer's matrix, on the device before any capture
        dtype = fp8.compute if stored else module.weight.dtype
        attrs["_buffers"] = {**attrs["_buffers"], "convrot_h": hadamard(group_of(module), dtype, device or weight.device)}
    lora = lora_of(module, hooks_of(module))
    if lora is not None:
        lora_twin(copy, attrs, lora, device, _compute_of(module, fp8))
    copy.__dict__.update(attrs)
    return copy


def _stored(module: torch.nn.Module, fp8: Fp8Table | None) -> bool:
    """Whether ``module``'s weight is one the model's table holds (fp8 or int8 storage)."""
    weight = module._parameters.get("weight")
    return fp8 is not None and weight is not None and id(weight) in fp8.weights


def _compute_of(module: torch.nn.Module, fp8: Fp8Table | None) -> torch.dtype | None:
    """The dtype a quantized Linear computes in (GGUF: its own; fp8 / int8: the table's), or None."""
    if gguf_layer(module):
        return module.compute_dtype
    return fp8.compute if _stored(module, fp8) else None


def _compute_value(self) -> torch.Tensor:
    """A stored fp8 weight's compute value (a held one is used as it is)."""
    weight = self.weight
    return weight.to(self.fp8_compute) * self.fp8_scale if weight.dtype == self.fp8_storage else weight


def _dequantizing_forward(self, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, _compute_value(self), self.bias)


def _fp8_matmul_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The fp8 matmul `Fp8MatmulHook` computes, its input quantised in torch's ops; where the
    matmul cannot take the call, the hook's fallback (the weight dequantised, the input cast)."""
    if takes(x, self.weight):
        scales = (self.fp8_one, self.fp8_wscale, self.fp8_static)
        return scaled_linear(x, self.weight, self.bias, scales, torch_quantise)
    return dequantised_linear(x, _compute_value(self), self.bias, self.fp8_compute)


@functools.cache
def _dequantizing(kind: type) -> type:
    return type(f"Dequantizing{kind.__name__}", (kind,), {"forward": _dequantizing_forward})


def _int8_forward(self, x: torch.Tensor) -> torch.Tensor:
    """An int8 weight's compute value as `fp8.dequantize_int8` makes it: a float32 product rounded
    once; a convrot layer's input rotated as `RotatingLinear` rotates it."""
    weight = self.weight
    if weight.dtype == torch.int8:
        weight = (weight.float() * self.int8_scale).to(self.int8_compute)
    return F.linear(rotated(self, x), weight, self.bias)


@functools.cache
def _int8_dequantizing(kind: type) -> type:
    return type(f"Int8Dequantizing{kind.__name__}", (kind,), {"forward": _int8_forward})


@functools.cache
def _fp8_matmul(kind: type) -> type:
    return type(f"Fp8Matmul{kind.__name__}", (kind,), {"forward": _fp8_matmul_forward})


def refusal(block: torch.nn.Module, fp8: Fp8Table | None = None, device: torch.device | None = None) -> str | None:
    """Why ``block`` cannot run as its twin (None: it can): a hook other than the streamer's (or
    a Linear's fp8 matmul where ``device`` has them, a GGUF layer's kernel, or an unfused LoRA on a
    quantized Linear) on it or a layer under it, a tensor subclass among its weights (but
    diffusers' GGUF layers'), or a stored weight on a layer other than a plain Linear."""
    for name, module in block.named_modules():
        lora = lora_of(module, hooks_of(module)) if _compute_of(module, fp8) is not None else None
        hooks = [key for key, hook in hooks_of(module).items()
                 if key != STREAM_HOOK and hook is not lora and not _matmul(module, hook, device)
                 and not (isinstance(hook, GgufDequantHook) and gguf_layer(module))]
        if hooks:
            return f"hook {hooks[0]} on {name or 'the block'}"
        if _stored(module, fp8) and type(module).forward not in (torch.nn.Linear.forward, RotatingLinear.forward):
            return f"stored {fp8.storage} weight on {name}, a {type(module).__name__}"
    gguf = {id(m._parameters["weight"]) for m in block.modules() if gguf_layer(m)}
    for name, tensor in (*block.named_parameters(), *block.named_buffers()):
        if type(tensor) not in PLAIN and id(tensor) not in gguf:
            return f"{type(tensor).__name__} weight {name}"
    return None


def _matmul(module: torch.nn.Module, hook: object, device: torch.device | None) -> bool:
    """Whether ``hook`` is the fp8 matmul of a plain Linear on a device that has them (its twin computes it)."""
    return isinstance(hook, Fp8MatmulHook) and type(module).forward is torch.nn.Linear.forward \
        and (device is None or runs_here(device))


class CompiledBlocks:
    """The compiled forwards of one streamer's blocks, made at a block's first compiled call and
    dropped when the hooks under the blocks may change (a weight write: a LoRA) and at release."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled = enabled
        self.device = device
        self.model: torch.nn.Module | None = None  # whose blocks these are (set at apply)
        self.fp8: Fp8Table | None = None  # the model's stored weights (set at apply)
        self.calls = 0  # compiled forwards run (eager ones and CUDA graph captures)
        self._forwards: dict[int, Callable[..., object] | None] = {}  # block index -> its compiled forward
        self._limit_checked: set[type] = set()  # block classes checked against dynamo's limit since the twins were made
        self._told: set[str] = set()

    def forward(self, block: StreamBlock) -> Callable[..., object] | None:
        """``block``'s compiled forward (a twin's), or None: it runs eagerly."""
        if not self.enabled:
            return None
        if block.index not in self._forwards:
            self._forwards[block.index] = self._make(block)
        return self._forwards[block.index]

    def _make(self, block: StreamBlock) -> Callable[..., object] | None:
        kind = type(block.module)
        why = refusal(block.module, self.fp8, self.device)
        if why is not None:
            self._tell(f"{kind.__name__} runs eagerly, not compiled: {why}")
            return None
        self._tell(f"{kind.__name__} blocks run compiled ({BACKEND}) wherever all their weights are bound at their entry")
        compiled = _compiled(self.model, kind, BACKEND, afresh_if_full=kind not in self._limit_checked)
        self._limit_checked.add(kind)
        eager = kind.forward
        copy = twin(block.module, self.fp8, self.device)
        bound = gguf_bound(copy)

        def run(*args, **kwargs):
            with bound():
                if self.enabled:
                    try:
                        out = compiled(copy, *args, **kwargs)
                        self.calls += 1
                        return out
                    except torch._dynamo.exc.BackendCompilerFailed as exc:
                        self._off(exc)
                return eager(copy, *args, **kwargs)

        run.twin = copy
        return run

    def _off(self, exc: Exception) -> None:
        """The compiler failed (not the model): every block runs eagerly from now on."""
        cause = getattr(exc, "inner_exception", None) or exc
        first = (str(cause).strip().splitlines() or [""])[0]
        log.warning("compile: off, blocks run eagerly: the compiler failed (%s: %s)", type(cause).__name__, first)
        self.enable(False)

    def _tell(self, line: str) -> None:
        if line not in self._told:
            self._told.add(line)
            log.info("compile: %s", line)

    @property
    def blocks(self) -> int:
        """Blocks given a compiled forward since the twins were last dropped."""
        return sum(f is not None for f in self._forwards.values())

    def clear(self) -> None:
        self._forwards.clear()
        self._limit_checked.clear()

    def enable(self, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            self.clear()


def _compiled(model: torch.nn.Module, kind: type, backend: str | Callable[..., object],
              afresh_if_full: bool) -> Callable[..., object]:
    """``kind.forward`` compiled for ``model``'s blocks, from a copy of its code object (dynamo's
    cache of compiled variants is per code object), made once per model, block class and backend;
    ``afresh_if_full`` (the first block of new twins: a LoRA set, a placement): made again where
    its variants reached dynamo's limit (LoRA sets and sizes add up in a session)."""
    forwards = COMPILED.get(model)
    if forwards is None:
        forwards = {}
        COMPILED.set(model, forwards)
    key = (kind, backend)
    made = forwards.get(key)
    held = _variants(made[0]) if made is not None and afresh_if_full else 0
    if held >= torch._dynamo.config.recompile_limit:
        log.info("compile: %s's %d compiled variants of %s reached torch's recompile_limit: compiling afresh",
                 type(model).__name__, held, kind.__name__)
        made = None
    if made is None:
        forward = kind.forward
        copy = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                                  forward.__defaults__, forward.__closure__)
        copy.__kwdefaults__ = forward.__kwdefaults__
        made = forwards[key] = (copy, torch.compile(copy, backend=backend))
    return made[1]


def _variants(function: Callable[..., object]) -> int:
    """How many compiled variants dynamo holds for ``function``'s code (0 where torch cannot say)."""
    entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    return len(entries(function.__code__)) if entries is not None else 0
