"""Live previews inside a real ComfyUI: one preview image per denoise step on the generate node.

What a user sees: with a preview method set (``--preview-method`` or the per-prompt setting), each
step's progress update carries a JPEG preview at the latent's size, sent to the browser as
KSampler's are (the server's UNENCODED_PREVIEW_IMAGE event); with previews off none is made; the
generated output is the same either way. Unit checks cover the real geometries the tiny models
lack: Flux's packed 2×2 patches, ComfyUI's factors per family, and the x0 estimate.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyhost import harness
from comfyhost.capture import capture_class

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]

IMAGE, VIDEO, H3 = "DiffusersOffloadGenerateImage", "DiffusersOffloadGenerateVideo", "DiffusersOffloadGenerateH3"
CAPTURE = "DiffusersOffloadTest_CapturePreviews"
GEN = "2"

Capture = capture_class()


@pytest.fixture(scope="module")
def models(comfy: harness.ComfyHost, tiny_flux_dir: Path, tiny_wan_dir: Path, tiny_ltx2_dir: Path,
           tiny_h3_dir: Path) -> Iterator[dict[str, str]]:
    root = Path(comfy.folder_paths.get_folder_paths("diffusers")[0])
    folders = {"flux": tiny_flux_dir, "wan": tiny_wan_dir, "ltx2": tiny_ltx2_dir, "h3": tiny_h3_dir}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(comfy.nodes.NODE_CLASS_MAPPINGS, CAPTURE, Capture)
        yield {family: ex.link_model(root, folder) for family, folder in folders.items()}


@pytest.fixture(scope="module")
def previews(comfy: harness.ComfyHost) -> Any:
    return comfy.pack_submodule("nodes.previews")


@pytest.fixture
def method(comfy: harness.ComfyHost, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``method("auto")`` sets the preview method as ``--preview-method`` does; the extra data it
    returns carries it as the per-prompt setting too (trees that have one reset it per prompt)."""
    monkeypatch.setattr(comfy.comfy_utils, "PROGRESS_THROTTLE_MIN_INTERVAL", 0.0, raising=False)
    cli = importlib.import_module("comfy.cli_args")

    def set_method(name: str) -> dict[str, str]:
        monkeypatch.setattr(cli.args, "preview_method", cli.LatentPreviewMethod(name))
        return {"preview_method": name}

    return set_method


def graph(model: str, node: str, **inputs: Any) -> dict[str, Any]:
    """Load (fp32) -> Generate -> Capture of the frames/images output."""
    values: dict[str, Any] = {"prompt": "a tiny red cat", "seed": 0, "steps": 3, "width": 48, "height": 32}
    if node != H3:
        values.update(negative_prompt="", guidance=0.0)
        values.update({"batch_size": 1} if node == IMAGE else {"frames": 9, "fps": 0.0})
        load = {"class_type": "DiffusersOffloadLoadPipeline", "inputs": {"model": model, "dtype": "fp32"}}
    else:
        values.update(width=32, frames=124, duration=0.0, generate_audio=False, vae_scale_factor=0)
        load = {"class_type": "DiffusersOffloadLoadModularPipeline",
                "inputs": {"model": model, "workflow": "t2va", "dtype": "fp32"}}
    prompt = {"1": load, GEN: {"class_type": node, "inputs": {"pipe": ["1", 0], **values, **inputs}}}
    prompt["c"] = {"class_type": CAPTURE, "inputs": {"value": [GEN, 0 if node == IMAGE else 1], "slot": 0}}
    return prompt


def sent_previews(result: harness.RunResult) -> list[Any]:
    """What the server was given to send to the browser as preview images, in order."""
    event = importlib.import_module("protocol").BinaryEventTypes.UNENCODED_PREVIEW_IMAGE
    return result.events_named(event)


def run(comfy: harness.ComfyHost, prompt: dict[str, Any], extra: dict[str, str]) -> tuple[harness.RunResult, Any]:
    Capture.seen.clear()
    result = comfy.run_prompt(prompt, extra_data=extra).raise_for_error()
    ((_, output),) = Capture.seen
    return result, output


@pytest.mark.parametrize(
    ("family", "node", "size"),
    [
        ("flux", IMAGE, (48, 32)),  # tiny Flux: VAE x1, 1 channel packed 2x2 -> the full canvas
        ("wan", VIDEO, (6, 4)),  # tiny Wan: VAE x8, 16 channels (Wan 2.1's factors), 3 latent frames
        ("ltx2", VIDEO, (32, 16)),  # LTX-2 snaps 48 -> 64; tiny VAE x2; token rows unpacked
        ("h3", H3, (2, 2)),  # H3: the canvas snaps to 32x32; tiny VAE x16; patch rows unpatchified
    ],
)
def test_one_preview_per_step_of_the_latent_size_and_the_output_unchanged(
    comfy: harness.ComfyHost, models: dict[str, str], method: Any, family: str, node: str, size: tuple[int, int]
) -> None:
    prompt = graph(models[family], node)
    comfy.free(unload_models=False)  # the same prompt runs twice: no cached outputs
    plain, without = run(comfy, prompt, method("none"))
    comfy.free(unload_models=False)

    shown, with_previews = run(comfy, prompt, method("auto"))

    steps = 2 if node == H3 else 3  # H3's steps count the sigma grid's final 0
    images = sent_previews(shown)
    assert len(images) == steps
    assert [fmt for fmt, _, _ in images] == ["JPEG"] * steps
    assert {image.size for _, image, _ in images} == {size}
    ticks = [(p.value, p.total) for p in shown.progress if p.node_id == GEN and p.has_preview]
    assert ticks == [(i, steps) for i in range(1, steps + 1)]
    assert sent_previews(plain) == [] and not any(p.has_preview for p in plain.progress)
    assert torch.equal(with_previews, without)


def test_previews_off_build_nothing(comfy: harness.ComfyHost, models: dict[str, str], method: Any,
                                    previews: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    monkeypatch.setattr(previews.latent_preview, "get_previewer", lambda *a: made.append("previewer"))
    monkeypatch.setattr(previews.StepPreviews, "__init__", lambda *a: made.append("step previews"))

    comfy.run_prompt(graph(models["wan"], VIDEO, seed=5), extra_data=method("none")).raise_for_error()

    assert made == []


def test_a_failing_preview_turns_previews_off_and_the_run_goes_on(
    comfy: harness.ComfyHost, models: dict[str, str], method: Any, previews: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def broken(*args: Any) -> None:
        calls.append(1)
        raise RuntimeError("no preview today")

    monkeypatch.setattr(previews, "classic_view", broken)

    result = comfy.run_prompt(graph(models["flux"], IMAGE, seed=6), extra_data=method("auto")).raise_for_error()

    assert calls == [1] and sent_previews(result) == []
    assert [p.value for p in result.progress if p.node_id == GEN] == [1, 2, 3]


def test_flux_packed_latents_unpack_to_16_channels_with_comfyuis_flux_factors(
    comfy: harness.ComfyHost, previews: Any, flux_pipe: Any
) -> None:
    """FLUX.1 geometry: VAE x8, 16 channels packed 2x2 into 64 (the tiny model has 1 channel)."""
    flux_pipe.vae_scale_factor = 8
    latents = torch.randn(1, 16, 64, 96)
    packed = flux_pipe._pack_latents(latents, 1, 16, 64, 96)
    assert packed.shape == (1, 48 * 32, 64)

    view = previews.classic_view(flux_pipe, "flux", {"height": 512, "width": 768})

    assert torch.equal(view(packed), latents)
    assert type(previews.latent_format("flux", 16)).__name__ == "Flux"


@pytest.mark.parametrize(("family", "channels", "name"), [
    ("wan", 16, "Wan21"), ("wan", 48, "Wan22"), ("ltx2", 128, "LTXV"), ("flux", 5, "Rough"), ("other", 4, "Rough"),
])
def test_comfyuis_latent_format_per_family_else_a_rough_one(previews: Any, family: str, channels: int,
                                                            name: str) -> None:
    fmt = previews.latent_format(family, channels)
    assert type(fmt).__name__ in {name, "LTXAV"} and previews.fits(fmt, channels)


def test_the_x0_estimate_is_exact_on_a_flow_line_and_a_video_shows_its_middle_frame(previews: Any) -> None:
    x0, noise = torch.randn(1, 4, 5, 6, 7), torch.randn(1, 4, 5, 6, 7)
    denoised = previews.Denoised()

    first = denoised(x0 + 0.9 * (noise - x0), 0.9)
    later = denoised(x0 + 0.4 * (noise - x0), 0.4)

    assert torch.equal(first, x0 + 0.9 * (noise - x0))  # nothing to extrapolate from yet
    torch.testing.assert_close(later, x0)
    assert torch.equal(previews.middle_frame(x0), x0[:, :, 2:3])
    assert previews.Denoised()(x0, None) is x0  # not flow matching: the sample itself


def test_h3_rows_unpatchify_to_the_middle_target_frame_and_x0_follows_h3s_velocity(
    comfy: harness.ComfyHost, previews: Any
) -> None:
    """Rows as H3's prepare step makes them (frame-major patches, conditioning rows first), and the
    x0 H3's scheduler steps towards (its velocity points to the data)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
    from diffusers.schedulers import MiniMaxH3Scheduler

    latents = torch.randn(1, 6, 5, 8, 12)  # 5 latent frames of 8x12, patch (1, 2, 2)
    rows = torch.cat([torch.randn(2 * 4 * 6, 24), patchify_video_latents(latents, (1, 2, 2))])
    shown = previews.H3Previews(None, None, 4, (5, 8, 12))

    assert torch.equal(shown._frame(rows, (1, 2, 2)), latents[:, :, 2:3])

    scheduler = MiniMaxH3Scheduler(shift=3.0)
    scheduler.set_timesteps(5)
    x, velocity = torch.randn(10, 24), torch.randn(10, 24)
    sigma, sigma_next = scheduler.sigmas[0], scheduler.sigmas[1]
    stepped = scheduler.step(velocity, scheduler.timesteps[0], x, return_dict=False)[0]
    x0 = x + sigma * velocity
    torch.testing.assert_close(stepped, sigma_next / sigma * x + (1 - sigma_next / sigma) * x0)
