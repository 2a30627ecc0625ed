"""MiniMax-H3's transformer and text encoder built directly in fp8 storage, one tensor at a time.

Why: at full depth (50 transformer blocks, 64 text layers) the two models hold ~66 B parameters,
~130 GB in bf16, more than the bench host's 128 GiB. Built here, host memory only ever holds what
the fp8 model keeps (its fp8 Linear weights plus the bf16 rest), never the bf16 model.

How: the model is made at full depth on the meta device (its structure, config and per-layer
attributes such as ``layer_idx`` as its constructor sets them), and a real copy at depth 1 (the
template) on the bench device, seeded and cast as ``from_pretrained`` casts a checkpoint (the
constructor's init, rotary tables, the fp32 islands). Each meta tensor is then made on the device
and moved to pageable host memory: a Linear weight or bias inside the layer stack is drawn afresh
with the mean and spread the constructor gave layer 0 (every layer differs); everything else is
the template's tensor (a layer's norms repeat layer 0's). The Linear weights that the pack stores in
fp8 (``formats.fp8``'s own selection, as ``store_fp8`` makes it) are stored as ComfyUI's
fp8_scaled files hold them: ``fp8(w / s)`` with a per-tensor scale ``s = amax(w) / fp8_max``,
and the model is marked with ``formats.fp8.mark_fp8`` and those scales, as the single-file loader
marks an fp8_scaled denoiser: the engine sees what a user's fp8_scaled file gives it (the pack's
selection leaves ``_keep_in_fp32_modules`` in fp32, and its dequantising hook answers diffusers'
``get_parameter_dtype``, which H3 casts its text input to).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch

from . import GiB, pack
from .models import cast_like_from_pretrained, nbytes

pack()
from diffusers_offload.offload_core.formats.fp8 import _linears, mark_fp8  # noqa: E402
from diffusers_offload.offload_core.log import get_logger  # noqa: E402

log = get_logger("bench.h3_fp8")

# The layer stack of each model: its layers are drawn afresh, the rest comes from the template.
TOWERS = {"transformer": "transformer_blocks", "text_encoder": "model.language_model.layers"}


def fp8_builder(device: torch.device, dtype: torch.dtype, storage: torch.dtype):
    """For ``models.build_h3(build_other=...)``: the transformer and the text encoder built
    directly in ``storage``; the other models as usual."""
    return lambda name, make: build_fp8(make, TOWERS[name], device, dtype, storage) if name in TOWERS else None


def build_fp8(
    make: Callable[..., torch.nn.Module],
    tower: str,
    device: torch.device,
    dtype: torch.dtype,
    storage: torch.dtype,
) -> torch.nn.Module:
    """The model ``make()`` builds, on the host, its eligible Linear weights in ``storage``
    (scaled per tensor), computing in ``dtype``; ``make(1)`` must build it with one layer."""
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = make()
    with torch.device(device):
        template = make(1)
    cast_like_from_pretrained(template, dtype)
    eligible = {name for name, _layer in _linears(model)}
    generator = torch.Generator(device).manual_seed(1)
    scales = _materialize(model, template, tower, eligible, device, storage, generator)
    del template
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model.requires_grad_(False)
    mark_fp8(model, dtype, scales, source=f"{type(model).__name__} (built in fp8)")
    log.info(
        "%s built in %s: %.2f GiB in %.1f s",
        type(model).__name__,
        str(storage).removeprefix("torch."),
        nbytes(model) / GiB,
        time.perf_counter() - t0,
    )
    return model


def _materialize(
    model: torch.nn.Module,
    template: torch.nn.Module,
    tower: str,
    eligible: set[str],
    device: torch.device,
    storage: torch.dtype,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Replace every meta parameter and buffer of ``model`` by a host tensor; returns the fp8
    weights' scales by layer name. Tied tensors stay tied (one host tensor per meta tensor)."""
    layer = re.compile(rf"^{re.escape(tower)}\.\d+(?=\.|$)")
    made: dict[int, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        source = template.get_submodule(layer.sub(f"{tower}.0", name))
        fresh = layer.match(name) is not None and isinstance(module, torch.nn.Linear)
        for slot in ("_parameters", "_buffers"):
            own = getattr(module, slot)
            for key, meta in list(own.items()):
                if meta is None:
                    continue
                if id(meta) not in made:
                    fp8 = key == "weight" and name in eligible
                    made[id(meta)], scale = _make(
                        getattr(source, slot)[key], fresh, fp8, device, storage, generator
                    )
                    if scale is not None:
                        scales[name] = scale
                host = made[id(meta)]
                own[key] = torch.nn.Parameter(host, requires_grad=False) if slot == "_parameters" else host
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{type(model).__name__}: tensors left on the meta device: {left[:5]}")
    return scales


def _make(
    like: torch.Tensor,
    fresh: bool,
    fp8: bool,
    device: torch.device,
    storage: torch.dtype,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One host tensor from the template's ``like``: drawn afresh (``fresh``) or copied, then stored
    in fp8 with its scale (``fp8``, floating weights only)."""
    value, owned = (_drawn_like(like, generator), True) if fresh else (like.detach(), False)
    scale = None
    if fp8 and value.is_floating_point():
        value, scale = _quantize(value, storage)
        owned = True
    return _to_host(value, device, copy=not owned), scale


def _drawn_like(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random values with ``like``'s mean, spread, shape and dtype (zeros stay zeros)."""
    std, mean = torch.std_mean(like.detach().float(), correction=0)
    noise = torch.randn(like.shape, generator=generator, device=like.device, dtype=torch.float32)
    return noise.mul_(std).add_(mean).to(like.dtype)


def _quantize(weight: torch.Tensor, storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(fp8(w / s), s)`` with ``s = amax(w) / fp8_max`` (fp32, on the host); an all-zero weight
    is stored unscaled."""
    amax = weight.detach().abs().amax().float()
    if amax.item() == 0:
        return weight.to(storage), None
    scale = amax / torch.finfo(storage).max
    return (weight.float() / scale).to(storage), scale.cpu()


def _to_host(t: torch.Tensor, device: torch.device, copy: bool) -> torch.Tensor:
    """Pageable host memory, where a loaded model rests; ``copy``: never the template's storage."""
    if device.type != "cpu":
        return t.to("cpu")
    return t.clone() if copy else t
