"""Stage, step and interrupt hooks for one pipeline call, calling back into whatever host is given.

Why: a pipeline call is several stages (text encode, image encode, denoise, video or image decode,
audio decode) and only the denoise loop has a step callback. Forward pre-hooks on the unit each
stage repeats (a layer of every text encoder, a denoiser forward, the VAE decoder, which diffusers'
Wan, KL and LTX-2 VAEs call once per temporal chunk and per tile) publish the stage and check for
an interrupt before the unit runs, so a cancel stops a text encode within one layer and a chunked
or tiled decode within one chunk or tile.

The hooks are plain torch forward pre-hooks, not diffusers ``HookRegistry`` hooks: they never
enter the registry the offload transports own, so placing, re-placing and releasing cannot disturb
them and they cannot disturb any offload hook. They live for one call (`StageHooks` is a context
manager) and are removed on the way out, interrupted or not.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
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
STILL = "decoding"  # a text-to-image pipeline's VAE decode (a stage name the node view knows)
AUDIO = "audio decode"
VISION_PATH = re.compile(r"(^|\.)(vision|visual)", re.IGNORECASE)  # a VLM text encoder's image tower
UNITS = {TEXT: "layer", IMAGE: "", DENOISE: "step", VIDEO: "chunk", STILL: "", AUDIO: ""}


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
    the caller knows it (steps, decode chunks), text-encoder layers are counted from the model.

    ``quiet`` stages are checked for an interrupt but not published (a classic pipeline's denoise:
    its step callback publishes steps, however many denoiser forwards guidance makes per step);
    ``decode`` names the VAE decoder's stage (`VIDEO`, or `STILL` for an image pipeline).
    """

    def __init__(self, pipe: object, host: StageHost, totals: Mapping[str, int] | None = None, *,
                 quiet: Collection[str] = (), decode: str = VIDEO) -> None:
        self.pipe = pipe
        self.host = host
        self.totals = dict(totals or {})
        self.quiet = frozenset(quiet)
        self.decode = decode
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
        for text in text_encoders(modules).values():
            layers = layer_stack(text)
            for index, layer in enumerate(layers):
                self._hook(layer, self._layer(index, len(layers)))
        for model in denoisers(self.pipe).values():
            self._hook(model, self._counted(_Counter(DENOISE, self.totals.get(DENOISE, 0))))
        vae = modules.get("vae")
        for stage, part in ((IMAGE, "encoder"), (self.decode, "decoder")):
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
        if TEXT in self.quiet:
            return lambda: None
        return lambda: self.host.on_stage(TEXT, index + 1, total)

    def _counted(self, counter: _Counter) -> Callable[[], None]:
        def publish() -> None:
            if counter.stage in self.quiet:
                return
            counter.seen += 1
            total = max(counter.total, counter.seen) if counter.total else 0
            self.host.on_stage(counter.stage, counter.seen, total)

        return publish


def text_encoders(modules: Mapping[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """Every text encoder of a pipeline, in its order (Flux: ``text_encoder`` (CLIP) and
    ``text_encoder_2`` (T5); SD3 a third; Wan its UMT5, LTX-2 its Gemma: ``text_encoder``)."""
    return {name: m for name, m in modules.items() if name.startswith("text_encoder")}


def layer_stack(module: torch.nn.Module) -> torch.nn.ModuleList:
    """The longest ``ModuleList`` under ``module`` outside its vision tower (Qwen2.5-VL's 32 vision
    blocks outnumber its 28 text layers, and a text prompt never runs them): a text encoder's layers
    (longer than any projection list; the outermost wins a tie, T5's blocks over their sublayers)."""
    stacks = [(path, m) for path, m in module.named_modules() if isinstance(m, torch.nn.ModuleList)]
    text = [m for path, m in stacks if not VISION_PATH.search(path)] or [m for _, m in stacks]
    return max(text, key=len, default=torch.nn.ModuleList())
