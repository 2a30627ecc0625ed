"""Prompt-embedding cache: a text encoder does not run again for what it has already encoded.

Why: users run one graph again and again changing the seed; the text encode (H3's 62 GiB Qwen3-VL:
a minute from pageable memory) is paid on every run for the same prompt. The cache sits on the
pipeline's encode entry: a classic pipeline's ``encode_prompt`` / ``encode_image`` (wrapped on the
instance), and a modular pipeline's text-encoder steps (MiniMax-H3's, whose class is swapped for a
caching subclass on the instance; both installed and undone through ``state.py``).

Key: everything that changes what is encoded: the call's arguments after defaults (prompt, negative
prompt, max sequence length, number per prompt, guidance on/off, device, dtype; tensors and images
by content hash), the pipeline's device, and for a modular step its class, its declared inputs and
the model facts it reads. The encoders' identity (each module object, its dtype and the LoRA it
effectively carries) is held beside the entries: when it changes, every entry goes (a LoRA applied
or removed changes the weights). A call with an argument that cannot be fingerprinted runs unchanged.

Entries live in host memory, not VRAM: the device is the scarce resource (a 1 GiB cache would be a
tenth of a small card, taken from the denoiser's preload), and moving a few MiB of embeddings back
costs well under a millisecond. Bounded by bytes, least recently used out first; dropped with the
pipeline's placement (``Engine.release``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..components import iter_modules
from ..log import get_logger
from ..state import LORA, PROMPT_CACHE, restore_class, swap_class, unwrap_entries, wrap_entry

log = get_logger("prompt_cache")

CLASSIC_ENTRIES = ("encode_prompt", "encode_image")
ENCODER_PREFIXES = ("text_encoder", "image_encoder")
# Model facts a modular text-encoder step reads off the pipeline (MiniMax-H3: which hidden state,
# and the modality tags of its rows).
MODULAR_FACTS = ("text_encoder_layer", "text_tag", "video_tag")


class Uncacheable(TypeError):
    """A value the key cannot be made from (the call then runs without the cache)."""


# -- keys -------------------------------------------------------------------------------------
def fingerprint(value: Any) -> object:
    """A hashable stand-in for ``value`` that changes whenever the value does (content hashes for
    tensors, arrays and images); `Uncacheable` for anything else."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return (type(value).__name__, value)
    if isinstance(value, (torch.device, torch.dtype)):
        return (type(value).__name__, str(value))
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), _digest(_tensor_bytes(value)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(fingerprint(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), fingerprint(v)) for k, v in value.items())))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, tuple((f.name, fingerprint(getattr(value, f.name)))
                                            for f in dataclasses.fields(value)))
    array = _as_array(value)
    if array is not None:
        return (type(value).__name__, getattr(value, "mode", ""), array.dtype.str, array.shape,
                _digest(array.tobytes()))
    raise Uncacheable(f"{type(value).__name__} cannot be fingerprinted")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _as_array(value: Any):
    """A numpy view of a numpy array or a PIL image, else None."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch
        return None
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("PIL.") and hasattr(value, "tobytes"):
        return np.asarray(value)
    return None


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def encoders_identity(pipe: object) -> tuple:
    """Each encoder of ``pipe`` (held weakly), its dtype and the LoRA that changes its weights."""
    out = []
    for name, module in iter_modules(pipe):
        if name.startswith(ENCODER_PREFIXES):
            param = next(module.parameters(), None)
            out.append((name, weakref.ref(module), str(param.dtype) if param is not None else "", _lora_of(module),
                        _peft_of(module)))
    return tuple(out)


def _lora_of(module: torch.nn.Module) -> tuple:
    """The LoRA set a component carries, when it changes this component's weights (a set covering
    only the denoiser leaves the text encoder's entries valid)."""
    carried = LORA.get(module)
    if carried is None or not (carried.backups or carried.hooks):
        return ()
    return carried.signature


def _peft_of(module: torch.nn.Module) -> tuple:
    """diffusers' own LoRA loading (PEFT adapters) on the encoder: names, active set, scales."""
    config = getattr(module, "peft_config", None)
    if not config:
        return ()
    active = getattr(module, "active_adapters", ())
    active = active() if callable(active) else active
    scales = tuple(sorted((n, float(getattr(m, "scaling", {}).get(a, 0))) for n, m in module.named_modules()
                          for a in (active or ()) if hasattr(m, "scaling"))[:64])
    return tuple(sorted(config)), tuple(active or ()), scales


# -- storage ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Stored:
    """A tensor output kept in host memory, with the device it is handed back on."""

    tensor: torch.Tensor
    device: torch.device


def _pack(value: Any) -> tuple[Any, int]:
    """(host-side copy of ``value``, its bytes); `Uncacheable` for outputs it cannot rebuild."""
    if isinstance(value, torch.Tensor):
        host = value.detach().to("cpu", copy=True)
        return _Stored(host, value.device), host.numel() * host.element_size()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        packed = [_pack(v) for v in value]
        return type(value)(p for p, _ in packed), sum(n for _, n in packed)
    if isinstance(value, dict) and type(value) is dict:
        packed = {k: _pack(v) for k, v in value.items()}
        return {k: p for k, (p, _) in packed.items()}, sum(n for _, n in packed.values())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value, 0
    raise Uncacheable(f"an output of type {type(value).__name__} is not cached")


def _unpack(value: Any) -> Any:
    """A fresh copy on the original device (a caller may write into what it gets)."""
    if isinstance(value, _Stored):
        return value.tensor.to(value.device, copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_unpack(v) for v in value)
    if isinstance(value, dict):
        return {k: _unpack(v) for k, v in value.items()}
    return value


class PromptCache:
    """Encoded outputs by key, least recently used first out, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int, device: torch.device) -> None:
        self.max_bytes = max_bytes
        self.device = device
        self.entries: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._identity: tuple = ()

    def resize(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._evict(0)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def check_encoders(self, identity: tuple) -> None:
        """Drop every entry when an encoder changed (another module, a dtype, a LoRA)."""
        if identity != self._identity:
            if self.entries:
                log.info("prompt cache: the encoders' weights changed, %d entries dropped", len(self.entries))
            self.clear()
            self._identity = identity

    def call(self, what: str, parts: tuple, run: Callable[[], Any]) -> tuple[Any, bool]:
        """``run()``'s output, from the cache when ``parts`` were seen; (output, hit)."""
        if self.max_bytes <= 0:
            return run(), False
        try:
            key = (what, str(self.device), fingerprint(parts))
        except Uncacheable as exc:
            log.debug("prompt cache: %s not cached (%s)", what, exc)
            return run(), False
        found = self.entries.get(key)
        if found is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            log.debug("prompt cache hit: %s (%d entries, %.2f MiB)", what, len(self.entries), self.nbytes / 2**20)
            return _unpack(found[0]), True
        out = run()
        self.misses += 1
        self._store(what, key, out)
        return out, False

    def _store(self, what: str, key: tuple, out: Any) -> None:
        try:
            packed, nbytes = _pack(out)
        except Uncacheable as exc:
            log.debug("prompt cache miss: %s ran, output not kept (%s)", what, exc)
            return
        if nbytes > self.max_bytes:
            log.debug("prompt cache miss: %s ran, output of %.2f MiB exceeds the cache", what, nbytes / 2**20)
            return
        self._evict(nbytes)
        self.entries[key] = (packed, nbytes)
        self.nbytes += nbytes
        log.debug("prompt cache miss: %s ran and was kept (%d entries, %.2f MiB)", what, len(self.entries),
                  self.nbytes / 2**20)

    def _evict(self, room: int) -> None:
        while self.entries and self.nbytes + room > self.max_bytes:
            _key, (_value, nbytes) = self.entries.popitem(last=False)
            self.nbytes -= nbytes

    def summary(self) -> str:
        return (f"{len(self.entries)} entries, {self.nbytes / 2**20:.2f} MiB of "
                f"{self.max_bytes / 2**30:.2f} GiB, {self.hits} hits, {self.misses} misses")


# -- installing on a pipeline -------------------------------------------------------------------
def install(pipe: object, max_bytes: int, device: torch.device) -> PromptCache:
    """Put the cache on ``pipe``'s encode entries (again after a re-placement: entries are kept
    unless the device changed)."""
    cache: PromptCache | None = PROMPT_CACHE.get(pipe)
    if cache is not None and cache.device == device:
        cache.resize(max_bytes)
        return cache
    remove(pipe)
    cache = PromptCache(max_bytes, device)
    PROMPT_CACHE.set(pipe, cache)
    for entry in CLASSIC_ENTRIES:
        if callable(getattr(type(pipe), entry, None)):
            wrap_entry(pipe, entry, _classic(pipe, entry))
    for block in text_steps(getattr(pipe, "_blocks", None)):
        swap_class(block, _caching_class(type(block)))
    return cache


def remove(pipe: object) -> None:
    """Undo `install`: wrapped entries and swapped step classes gone, the entries dropped."""
    cache: PromptCache | None = PROMPT_CACHE.pop(pipe)
    if cache is not None:
        cache.clear()
    unwrap_entries(pipe)
    for block in text_steps(getattr(pipe, "_blocks", None), swapped=True):
        restore_class(block)


def _classic(pipe: object, entry: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    import inspect

    signature = inspect.signature(getattr(type(pipe), entry))
    pipe_ref = weakref.ref(pipe)

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        def cached(*args: Any, **kwargs: Any) -> Any:
            owner = pipe_ref()
            cache = PROMPT_CACHE.get(owner) if owner is not None else None
            if cache is None:
                return method(*args, **kwargs)
            bound = signature.bind(owner, *args, **kwargs)
            bound.apply_defaults()
            cache.check_encoders(encoders_identity(owner))
            parts = tuple((k, v) for k, v in bound.arguments.items() if k != "self")
            return cache.call(entry, parts, lambda: method(*args, **kwargs))[0]

        return cached

    return wrap


def text_steps(blocks: Any, swapped: bool = False) -> list[Any]:
    """The modular blocks under ``blocks`` that run the text encoder themselves (leaf blocks whose
    expected components include ``text_encoder``)."""
    found: list[Any] = []
    subs = getattr(blocks, "sub_blocks", None) or {}
    if blocks is not None and not subs:
        names = {getattr(s, "name", None) for s in _safe(lambda: blocks.expected_components) or ()}
        if "text_encoder" in names and (not swapped or getattr(type(blocks), "_caches_prompts", False)):
            found.append(blocks)
    for sub in subs.values():
        found += text_steps(sub, swapped)
    return found


def _safe(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception:
        return None


_CLASSES: dict[type, type] = {}


def _caching_class(base: type) -> type:
    """``base`` with a ``__call__`` that serves its outputs from the pipeline's cache."""
    if getattr(base, "_caches_prompts", False):
        return base
    made = _CLASSES.get(base)
    if made is None:
        made = type(base.__name__, (base,), {"__call__": _cached_step_call, "_caches_prompts": True,
                                              "__module__": base.__module__, "__qualname__": base.__qualname__})
        _CLASSES[base] = made
    return made


def _cached_step_call(self: Any, components: Any, state: Any) -> tuple[Any, Any]:
    base_call = super(type(self), self).__call__
    cache: PromptCache | None = PROMPT_CACHE.get(components)
    if cache is None:
        return base_call(components, state)
    cache.check_encoders(encoders_identity(components))
    block_state = self.get_block_state(state)
    inputs = tuple((p.name, getattr(block_state, p.name, None)) for p in self.inputs if p.name)
    facts = tuple((name, _safe(lambda n=name: getattr(components, n))) for name in MODULAR_FACTS)
    device = str(_safe(lambda: components._execution_device))
    outputs = [p for p in self.intermediate_outputs if p.name]
    ran: list[tuple[Any, Any]] = []

    def run() -> tuple:
        ran.append(base_call(components, state))
        return tuple(state.get(p.name) for p in outputs)

    values, hit = cache.call(type(self).__qualname__, (inputs, facts, device), run)
    if not hit:
        return ran[0]
    for param, value in zip(outputs, values, strict=True):
        state.set(param.name, value, param.kwargs_type)
    return components, state
