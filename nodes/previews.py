"""Live previews: one small image per denoise step on the generate node, as KSampler shows them.

Why: a diffusers pipeline runs its own loop, so ComfyUI's ``latent_preview.prepare_callback`` never
runs. The pieces are ComfyUI's own: ``latent_preview.get_previewer`` (it reads the user's preview
method, ``--preview-method`` or the per-prompt setting, and picks TAESD when asked and its file
is in ``models/vae_approx``, else the linear latent→RGB factors) with a ``comfy.latent_formats``
class per family; the image goes out with the step's progress update (``ProgressBar``), which the
server sends over the websocket. With previews off nothing here is built or run.

What this module adds is the bridge from diffusers' latents to ComfyUI's layout: Flux's packed
2×2 patches unpacked to 16 channels (Flux.2: 128 channels for its own reshape), LTX-2's token rows
unpacked to (B, C, F, H, W), H3's patch rows unpatchified; a video shows its middle latent frame.
As KSampler previews the denoised estimate (x0), not the noisy sample, flow-matching samples are
turned into x0: from two successive samples and their sigmas on a classic pipeline (exact for
Euler), from the denoiser's velocity on H3. A family with no matching factors (tiny test models,
H3 on ComfyUI trees without its format) gets a rough fixed projection, said once in the log.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import comfy.latent_formats as latent_formats
import comfy.utils
import latent_preview
import torch
from comfy.cli_args import LatentPreviewMethod, args

from ..offload_core.components import denoisers, patch_of

log = logging.getLogger("diffusers_offload.nodes")

# comfy.latent_formats classes per family, first that fits the latent's channels; names missing
# from the running ComfyUI are skipped (LTXAV and MiniMaxH3Video are 2026 additions).
FORMATS: Mapping[str, tuple[str, ...]] = {
    "flux": ("Flux", "Flux2"),
    "wan": ("Wan21", "Wan22"),
    "ltx2": ("LTXAV", "LTXV"),
    "minimax_h3": ("MiniMaxH3Video",),
}
FORMAT = "JPEG"
_said: set[tuple[str, ...]] = set()

Preview = Any  # what ProgressBar.update_absolute takes: ("JPEG", PIL image, max size)
View = Callable[[torch.Tensor], torch.Tensor | None]


def enabled() -> bool:
    """The user's preview method (ComfyUI sets it per prompt on trees that have the setting)."""
    return args.preview_method != LatentPreviewMethod.NoPreviews


def say_once(*key: str, text: str) -> None:
    if key not in _said:
        _said.add(key)
        log.info("%s", text)


class Rough(latent_formats.LatentFormat):
    """Latent→RGB for a latent no ComfyUI format fits: channel c feeds colour c mod 3 (all three
    below 3 channels), scaled so unit-variance latents fill the range. Shapes, not colours."""

    def __init__(self, channels: int) -> None:
        self.latent_channels = channels
        if channels < 3:
            self.latent_rgb_factors = [[0.5 / math.sqrt(channels)] * 3 for _ in range(channels)]
        else:
            counts = [len(range(colour, channels, 3)) for colour in range(3)]
            self.latent_rgb_factors = [
                [0.5 / math.sqrt(counts[c % 3]) if k == c % 3 else 0.0 for k in range(3)] for c in range(channels)
            ]


def fits(fmt: Any, channels: int) -> bool:
    factors = getattr(fmt, "latent_rgb_factors", None)
    if factors is None:
        return False
    if getattr(fmt, "latent_rgb_factors_reshape", None) is not None:  # Flux.2: factors after its own reshape
        return fmt.latent_channels == channels
    return len(factors) == channels


def latent_format(family: str, channels: int) -> Any:
    """ComfyUI's latent format for this family and channel count, else `Rough`."""
    for name in FORMATS.get(family, ()):
        cls = getattr(latent_formats, name, None)
        fmt = cls() if cls is not None else None
        if fmt is not None and fits(fmt, channels):
            return fmt
    say_once(family, str(channels), text=f"previews: no latent→RGB factors for {family} latents with {channels} "
                                         "channels in this ComfyUI; rough previews (shapes, not colours)")
    return Rough(channels)


def middle_frame(x: torch.Tensor) -> torch.Tensor:
    """Batch item 0; of a video (B, C, F, H, W) its middle latent frame, kept 5-D for ComfyUI's previewers."""
    x = x[:1]
    if x.ndim == 5:
        mid = x.shape[2] // 2
        x = x[:, :, mid : mid + 1]
    return x


def classic_view(pipe: Any, family: str, call: Mapping[str, Any]) -> View | None:
    """latents of a classic call → (1, C, H, W) or (1, C, F, H, W) in ComfyUI's layout; None: unknown."""
    if family == "flux" and {"height", "width"} <= call.keys():
        height, width, scale = int(call["height"]), int(call["width"]), int(pipe.vae_scale_factor)
        if hasattr(pipe, "_unpatchify_latents"):  # Flux.2: rows of 2×2-patchified channels, row-major
            return lambda x: x[:1].reshape(1, height // (2 * scale), width // (2 * scale), -1).permute(0, 3, 1, 2)
        return lambda x: pipe._unpack_latents(x[:1], height, width, scale)
    if family == "ltx2" and {"height", "width", "num_frames"} <= call.keys():
        frames = (int(call["num_frames"]) - 1) // pipe.vae_temporal_compression_ratio + 1
        height = int(call["height"]) // pipe.vae_spatial_compression_ratio
        width = int(call["width"]) // pipe.vae_spatial_compression_ratio
        patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
        return lambda x: pipe._unpack_latents(x[:1], frames, height, width, patch, patch_t)
    return lambda x: x if x.ndim in (4, 5) else None


def flow_sigma(scheduler: Any, sigmas: list[float] | None) -> tuple[float | None, list[float] | None]:
    """The sigma of the sample a step just produced, when the schedule is flow matching (sigmas in [0, 1])."""
    if sigmas is None:
        table = getattr(scheduler, "sigmas", None)
        if not isinstance(table, torch.Tensor) or table.numel() == 0:
            return None, None
        sigmas = table.float().cpu().tolist()
    index = getattr(scheduler, "step_index", None)
    if index is None or not 0 <= index < len(sigmas) or max(sigmas) > 1.0 + 1e-3:
        return None, sigmas
    return sigmas[index], sigmas


class Denoised:
    """x0 from successive flow-matching samples: x_t = x0 + σ·(ε − x0) is a line in σ, so the last
    two samples extrapolated to σ = 0 give the x0 the step moved towards (exact for Euler)."""

    def __init__(self) -> None:
        self.last: tuple[torch.Tensor, float] | None = None

    def __call__(self, x: torch.Tensor, sigma: float | None) -> torch.Tensor:
        last, self.last = self.last, (None if sigma is None else (x, sigma))
        if sigma is None or last is None or last[0].shape != x.shape or last[1] - sigma < 1e-6:
            return x
        previous, sigma_before = last
        return (x * sigma_before - previous * sigma) / (sigma_before - sigma)


class Previewer:
    """ComfyUI's previewer for one run, made on the first latent (its channels pick the format)."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.impl: Any = None
        self.made = False

    def __call__(self, x0: torch.Tensor) -> Preview | None:
        if not self.made:
            self.made = True
            self.impl = latent_preview.get_previewer(x0.device, latent_format(self.family, x0.shape[1]))
        return None if self.impl is None else self.impl.decode_latent_to_preview_image(FORMAT, x0)


class StepPreviews:
    """Previews of a classic call, from ``callback_on_step_end``'s latents. Any failure turns them off
    for the rest of the run (logged once): a preview never stops a generation."""

    def __init__(self, family: str, call: Mapping[str, Any]) -> None:
        self.family = family
        self.call = call
        self.view: View | None = None
        self.previewer = Previewer(family)
        self.denoised = Denoised()
        self.sigmas: list[float] | None = None
        self.off = False

    def __call__(self, pipe: Any, latents: torch.Tensor | None) -> Preview | None:
        if self.off or not isinstance(latents, torch.Tensor):
            return None
        try:
            return self._preview(pipe, latents)
        except Exception:
            self.off = True
            log.warning("previews off for this run of %s", type(pipe).__name__, exc_info=True)
            return None

    @torch.no_grad()
    def _preview(self, pipe: Any, latents: torch.Tensor) -> Preview | None:
        if self.view is None:
            self.view = classic_view(pipe, self.family, self.call)
        x = self.view(latents)
        if x is None:
            self.off = True
            say_once(type(pipe).__name__, text=f"previews: {type(pipe).__name__} latents of shape "
                                               f"{tuple(latents.shape)} have no known layout; no previews")
            return None
        sigma, self.sigmas = flow_sigma(getattr(pipe, "scheduler", None), self.sigmas)
        return self.previewer(self.denoised(middle_frame(x).float(), sigma))


class H3Previews:
    """Previews of a MiniMax-H3 call: a forward hook on the denoiser reads its input rows (x_t) and its
    output (H3's velocity points to the data: x0 = x_t + σ·v) and unpatchifies the middle target frame.
    ``latent_grid`` is (latent frames, latent height, latent width) of the generated video; the
    target rows are the last ones (conditioning rows come first). A plain torch hook for the call's
    length, like the stage hooks, so it never meets the offload hooks' registry."""

    def __init__(self, pipe: Any, node_id: str | None, steps: int, latent_grid: tuple[int, int, int]) -> None:
        self.pipe = pipe
        self.steps = steps
        self.grid = latent_grid
        self.bar = comfy.utils.ProgressBar(max(steps, 1), node_id=node_id)
        self.previewer = Previewer("minimax_h3")
        self.sigmas: list[float] | None = None
        self.seen = 0
        self.off = False
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> H3Previews:
        if enabled():
            for model in denoisers(self.pipe).values():
                self.handles.append(model.register_forward_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc_info: object) -> None:
        while self.handles:
            self.handles.pop().remove()

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        self.seen += 1
        if self.off:
            return
        try:
            image = self._preview(module, kwargs.get("hidden_states", args[0] if args else None), output)
        except Exception:
            self.off = True
            log.warning("previews off for this MiniMax-H3 run", exc_info=True)
            return
        if image is not None:
            self.bar.update_absolute(self.seen, max(self.steps, self.seen), image)

    @torch.no_grad()
    def _preview(self, module: torch.nn.Module, rows: Any, output: Any) -> Preview | None:
        velocity = output[0] if isinstance(output, (tuple, list)) else getattr(output, "sample", output)
        if not isinstance(rows, torch.Tensor) or not isinstance(velocity, torch.Tensor):
            return None
        if self.sigmas is None:
            self.sigmas = self.pipe.scheduler.sigmas.float().cpu().tolist()
        sigma = self.sigmas[min(self.seen - 1, len(self.sigmas) - 1)]
        frame = self._frame(rows[0].float(), patch_of(module)) + sigma * self._frame(velocity[0].float(), patch_of(module))
        return self.previewer(frame)

    def _frame(self, rows: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
        """(rows, C·pt·ph·pw) → (1, C, 1, H, W): the middle frame of the target rows."""
        frames, height, width = self.grid
        pt, ph, pw = patch
        gh, gw = height // ph, width // pw
        per_frame = gh * gw
        row_frames = max(frames // pt, 1)
        start = rows.shape[0] - row_frames * per_frame
        if start < 0:  # fewer rows than the grid says: show the last frame
            start, row_frames = rows.shape[0] - per_frame, 1
        first = start + (row_frames // 2) * per_frame
        cells = rows[first : first + per_frame].reshape(gh, gw, -1, pt, ph, pw)
        image = cells.permute(2, 3, 0, 4, 1, 5).reshape(cells.shape[2], pt, height, width)
        return image[:, pt // 2][None, :, None]
