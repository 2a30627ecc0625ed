"""Stage, step and interrupt hooks for one pipeline call, calling back into whatever host is given.

Why: a pipeline call is several stages (text encode, image encode, denoise, video decode, audio
decode) and only the denoise loop has a step callback. Forward pre-hooks on the unit each stage
repeats (a text-encoder layer, a denoiser forward, a VAE decoder call per temporal chunk and tile)
publish the stage and check for an interrupt before the unit runs, so a cancel stops a text encode
within one layer and a chunked decode within one chunk.

The hooks are plain torch forward pre-hooks, not diffusers ``HookRegistry`` hooks: they never
enter the registry the offload transports own, so placing, re-placing and releasing cannot disturb
them and they cannot disturb any offload hook. They live for one call (`StageHooks` is a context
manager) and are removed on the way out, interrupted or not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType

import torch

from ..components import denoisers, iter_modules
from ..log import get_logger

log = get_logger("stages")

TEXT = "text encode"
IMAGE = "image encode"
DENOISE = "denoise"
VIDEO = "video decode"
AUDIO = "audio decode"
UNITS = {TEXT: "layer", IMAGE: "", DENOISE: "step", VIDEO: "chunk", AUDIO: ""}


def label(stage: str, i: int, n: int) -> str:
    """What the node shows: ``denoise step 3/20``, ``video decode chunk 2/7``, ``audio decode 1/1``
    (no ``/n`` when the total is unknown)."""
    head = f"{stage} {UNITS[stage]}".rstrip()
    return f"{head} {i}/{n}" if n else f"{head} {i}"


@dataclass(frozen=True)
class StageHost:
    """The host side: ``on_stage(stage, i, n)`` publishes, ``check_interrupt()`` raises the host's
    own exception when the user cancelled (it must not return normally then)."""

    on_stage: Callable[[str, int, int], None]
    check_interrupt: Callable[[], None]


@dataclass
class _Counter:
    stage: str
    total: int
    seen: int = field(default=0)


class StageHooks:
    """Forward pre-hooks for one call of ``pipe``; ``totals`` gives the unit count per stage where
    the caller knows it (steps, decode chunks), text-encoder layers are counted from the model."""

    def __init__(self, pipe: object, host: StageHost, totals: Mapping[str, int] | None = None) -> None:
        self.pipe = pipe
        self.host = host
        self.totals = dict(totals or {})
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> StageHooks:
        self.install()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.remove()

    def install(self) -> None:
        if self._handles:
            raise RuntimeError("stage hooks are already installed for this call")
        modules = dict(iter_modules(self.pipe))
        text = modules.get("text_encoder")
        if text is not None:
            layers = layer_stack(text)
            for index, layer in enumerate(layers):
                self._hook(layer, self._layer(index, len(layers)))
        for model in denoisers(self.pipe).values():
            self._hook(model, self._counted(_Counter(DENOISE, self.totals.get(DENOISE, 0))))
        vae = modules.get("vae")
        for stage, part in ((IMAGE, "encoder"), (VIDEO, "decoder")):
            inner = getattr(vae, part, None)
            if isinstance(inner, torch.nn.Module):
                self._hook(inner, self._counted(_Counter(stage, self.totals.get(stage, 0))))
        audio = getattr(modules.get("audio_vae"), "decoder", None)
        if isinstance(audio, torch.nn.Module):
            self._hook(audio, self._counted(_Counter(AUDIO, self.totals.get(AUDIO, 1))))
        log.debug("stage hooks on %d modules of %s", len(self._handles), type(self.pipe).__name__)

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    # -- internals ----------------------------------------------------------------------------
    def _hook(self, module: torch.nn.Module, publish: Callable[[], None]) -> None:
        def pre_hook(_module: torch.nn.Module, _args: tuple) -> None:
            publish()
            self.host.check_interrupt()

        self._handles.append(module.register_forward_pre_hook(pre_hook))

    def _layer(self, index: int, total: int) -> Callable[[], None]:
        return lambda: self.host.on_stage(TEXT, index + 1, total)

    def _counted(self, counter: _Counter) -> Callable[[], None]:
        def publish() -> None:
            counter.seen += 1
            total = max(counter.total, counter.seen) if counter.total else 0
            self.host.on_stage(counter.stage, counter.seen, total)

        return publish


def layer_stack(module: torch.nn.Module) -> torch.nn.ModuleList:
    """The longest ``ModuleList`` under ``module``: a text encoder's decoder layers (longer than a
    vision tower's blocks or any projection list)."""
    stacks: Iterator[torch.nn.ModuleList] = (m for m in module.modules() if isinstance(m, torch.nn.ModuleList))
    return max(stacks, key=len, default=torch.nn.ModuleList())
