"""Compiled block forwards (``compile_blocks``): a block's own code run through ``torch.compile``.

Why twins: the streamer's hooks on a block's parts bind weights between its ops, which
``torch.compile`` cannot trace (each would be a graph break). A block whose units are all bound
at its entry needs none of them, so its forward runs on a *twin*: a shallow copy of its module
tree that shares every parameter and buffer (whatever the streamer binds them to) but not the
hooked ``forward`` attributes. One compiled function per block class serves every block of that
class (dynamo reads the twin's parameters as inputs and guards on its structure, not its
identity), so a 40-block model compiles once per input shape. A block whose layers compute
through any other hook (fp8 matmuls, dequantising, an unfused LoRA) or hold tensor subclasses
(GGUF) runs eagerly: a twin would skip what those hooks do. Why not diffusers'
``compile_repeated_blocks``: it compiles the module's call, hooks and all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..log import get_logger
from ..state import REGISTRY, STREAM_HOOK
from .blocks import StreamBlock

log = get_logger("compile")

BACKEND = "inductor"  # torch.compile's backend (the CPU tests use "aot_eager": no code generation there)
PLAIN = (torch.Tensor, torch.nn.Parameter)


def twin(module: torch.nn.Module) -> torch.nn.Module:
    """``module``'s tree without the hooked ``forward`` attributes and registries, sharing its
    parameter and buffer dicts (so a weight bound by the streamer is bound in the twin too)."""
    copy = object.__new__(type(module))
    attrs = dict(vars(module))
    attrs.pop("forward", None)
    attrs.pop(REGISTRY, None)
    attrs["_modules"] = {name: None if child is None else twin(child) for name, child in module._modules.items()}
    copy.__dict__.update(attrs)
    return copy


def refusal(block: torch.nn.Module) -> str | None:
    """Why ``block`` cannot run as its twin (None: it can): a hook other than the streamer's on it
    or a layer under it, or a tensor subclass among its weights."""
    for name, module in block.named_modules():
        hooks = [h for h in getattr(vars(module).get(REGISTRY), "hooks", {}) if h != STREAM_HOOK]
        if hooks:
            return f"hook {hooks[0]} on {name or 'the block'}"
    for name, tensor in (*block.named_parameters(), *block.named_buffers()):
        if type(tensor) not in PLAIN:
            return f"{type(tensor).__name__} weight {name}"
    return None


class CompiledBlocks:
    """The compiled forwards of one streamer's blocks, made at a block's first compiled call and
    dropped when the hooks under the blocks may change (a weight write: a LoRA) and at release."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.calls = 0  # compiled forwards run (eager ones and CUDA graph captures)
        self._forwards: dict[int, Callable[..., object] | None] = {}  # block index -> its compiled forward
        self._told: set[str] = set()

    def forward(self, block: StreamBlock) -> Callable[..., object] | None:
        """``block``'s compiled forward (a twin's), or None: it runs eagerly."""
        if not self.enabled:
            return None
        if block.index not in self._forwards:
            self._forwards[block.index] = self._make(block)
        return self._forwards[block.index]

    def _make(self, block: StreamBlock) -> Callable[..., object] | None:
        kind = type(block.module).__name__
        why = refusal(block.module)
        if why is not None:
            self._tell(f"{kind} runs eagerly, not compiled: {why}")
            return None
        self._tell(f"{kind} blocks run compiled ({BACKEND}) wherever all their weights are bound at their entry")
        compiled = _compiled(type(block.module), BACKEND)
        copy = twin(block.module)

        def run(*args, **kwargs):
            self.calls += 1
            return compiled(copy, *args, **kwargs)

        run.twin = copy
        return run

    def _tell(self, line: str) -> None:
        if line not in self._told:
            self._told.add(line)
            log.info("compile: %s", line)

    @property
    def blocks(self) -> int:
        """Blocks that have run compiled since the twins were last dropped."""
        return sum(f is not None for f in self._forwards.values())

    def clear(self) -> None:
        self._forwards.clear()

    def enable(self, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            self.clear()


@functools.cache
def _compiled(kind: type, backend: str) -> Callable[..., object]:
    """One compiled ``forward`` per block class and backend, shared by every streamer."""
    return torch.compile(kind.forward, backend=backend)
