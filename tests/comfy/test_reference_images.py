"""Generate image's reference images inside a real ComfyUI: an image-editing pipeline that takes
several (tiny FLUX.2 [klein] and [dev], a tiny Qwen-Image-Edit Plus) gets every image of the connected batch,
in order, as the PIL images diffusers' own call takes; one that takes one (the first
Qwen-Image-Edit) the first, with a note; FLUX.1 Kontext the size asked for; a text-to-image pipeline given one, and an edit pipeline given none, are
refused by name."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import diffusers
import pytest
import torch
from comfyhost import harness
from comfyhost.capture import capture_class, capture_fixtures
from fixtures import flux2_dev_files, flux2_klein_files, qwen_image_edit_files
from PIL import Image

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]
_tiny_flux2_klein = flux2_klein_files.tiny_flux2_klein_dir
_tiny_flux2_dev = flux2_dev_files.tiny_flux2_dev_dir
_tiny_qwen_image_edit = qwen_image_edit_files.tiny_qwen_image_edit_dir

CAPTURE = "DiffusersOffloadTest_Capture"
GEN = "2"
COLORS = (0xFF2020, 0x20A0FF)
Capture = capture_class()
capture_node, captured = capture_fixtures(CAPTURE, Capture)


def graph(model: str, colors: tuple[int, ...], seed: int = 3) -> dict[str, Any]:
    """Load (fp32) -> Generate image with a batch of plain 64 x 64 images of ``colors`` (none: no
    reference) -> Capture of the images."""
    prompt: dict[str, Any] = {
        "1": {"class_type": "DiffusersOffloadLoadPipeline", "inputs": {"model": model, "dtype": "fp32"}},
        GEN: {"class_type": "DiffusersOffloadGenerateImage", "inputs": {
            "pipe": ["1", 0], "prompt": "a red fox", "negative_prompt": "", "seed": seed, "steps": 2,
            "guidance": 0.0, "width": 32, "height": 32, "batch_size": 1}},
        "c": {"class_type": CAPTURE, "inputs": {"value": [GEN, 0], "slot": 0}},
    }
    for i, color in enumerate(colors):
        prompt[f"img{i}"] = {"class_type": "EmptyImage",
                             "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": color}}
    if len(colors) == 2:
        prompt["batch"] = {"class_type": "ImageBatch", "inputs": {"image1": ["img0", 0], "image2": ["img1", 0]}}
    if colors:
        prompt[GEN]["inputs"]["reference_images"] = ["batch" if len(colors) == 2 else "img0", 0]
    return prompt


def direct(folder: Path, colors: tuple[int, ...], seed: int = 3, single: bool = False) -> torch.Tensor:
    """The folder's own pipeline called by diffusers with the same references as PIL images (``single``:
    the one image), as ComfyUI's IMAGE [B, H, W, C]."""
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    images = [Image.new("RGB", (64, 64), ((c >> 16) & 255, (c >> 8) & 255, c & 255)) for c in colors]
    image = images[0] if single else images or None
    out = pipe(prompt="a red fox", image=image, height=32, width=32, num_inference_steps=2,
               generator=torch.Generator("cpu").manual_seed(seed), output_type="pt")
    return out.images.permute(0, 2, 3, 1).float()


def linked(comfy: harness.ComfyHost, folder: Path) -> str:
    return ex.link_model(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]), folder)


@pytest.fixture(scope="module")
def klein(comfy: harness.ComfyHost, tiny_flux2_klein_dir: Path) -> str:
    return linked(comfy, tiny_flux2_klein_dir)


def test_every_reference_image_reaches_flux2_in_order_as_diffusers_takes_them(
    comfy: harness.ComfyHost, klein: str, tiny_flux2_klein_dir: Path, captured: list[Any]
) -> None:
    runs = [(), COLORS[:1], COLORS, COLORS[::-1]]
    for colors in runs:
        comfy.run_prompt(graph(klein, colors)).raise_for_error()

    images = [value for _, value in captured]
    assert len(images) == len(runs)
    for colors, image in zip(runs, images, strict=True):
        assert torch.allclose(image, direct(tiny_flux2_klein_dir, colors), atol=1e-5), colors
    assert len({image.sum().item() for image in images}) == len(runs)  # each reference set changes the image


def test_references_of_other_sizes_come_through_the_second_and_third_inputs(
    comfy: harness.ComfyHost, klein: str, tiny_flux2_klein_dir: Path, captured: list[Any]
) -> None:
    """A batch holds one size: images of other sizes come through reference_images_2 and _3, after
    the first input's, each keeping its own size."""
    prompt = graph(klein, COLORS[:1])
    sizes = {"img_2": (96, 64, 0x20A0FF), "img_3": (64, 80, 0x30FF30)}
    for n, (node, (width, height, color)) in enumerate(sizes.items(), start=2):
        prompt[node] = {"class_type": "EmptyImage",
                        "inputs": {"width": width, "height": height, "batch_size": 1, "color": color}}
        prompt[GEN]["inputs"][f"reference_images_{n}"] = [node, 0]

    comfy.run_prompt(prompt).raise_for_error()

    pipe = diffusers.DiffusionPipeline.from_pretrained(tiny_flux2_klein_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    images = [Image.new("RGB", (64, 64), (255, 32, 32)),
              *(Image.new("RGB", (w, h), ((c >> 16) & 255, (c >> 8) & 255, c & 255)) for w, h, c in sizes.values())]
    want = pipe(prompt="a red fox", image=images, height=32, width=32, num_inference_steps=2,
                generator=torch.Generator("cpu").manual_seed(3), output_type="pt").images.permute(0, 2, 3, 1)
    ((_, got),) = captured
    assert torch.allclose(got, want.float(), atol=1e-5)


@pytest.mark.parametrize("folder", ["tiny_qwen_image_edit_dir", "tiny_flux2_dev_dir"])
def test_qwen_image_edit_plus_and_flux2_dev_get_every_reference_image_in_order(
    comfy: harness.ComfyHost, request: pytest.FixtureRequest, captured: list[Any], folder: str
) -> None:
    source = request.getfixturevalue(folder)
    runs = [COLORS, COLORS[::-1]]
    for colors in runs:
        comfy.run_prompt(graph(linked(comfy, source), colors)).raise_for_error()

    images = [value for _, value in captured]
    for colors, image in zip(runs, images, strict=True):
        assert torch.allclose(image, direct(source, colors), atol=1e-5), colors
    assert not torch.equal(*images)


def test_a_one_image_pipeline_takes_the_first_reference_with_a_note(
    comfy: harness.ComfyHost, tmp_path: Path, captured: list[Any]
) -> None:
    """The first Qwen-Image-Edit takes one image: the first of the batch, and the node says so."""
    folder = qwen_image_edit_files.build_tiny_qwen_image_edit(tmp_path / "qwen-image-edit-v1",
                                                              pipeline="QwenImageEditPipeline")
    prompt = graph(linked(comfy, folder), COLORS)
    prompt["n"] = {"class_type": CAPTURE, "inputs": {"value": [GEN, 1], "slot": 1}}

    comfy.run_prompt(prompt).raise_for_error()

    (_, image), (_, notes) = sorted(captured, key=lambda seen: seen[0])
    assert notes == "reference_images: QwenImageEditPipeline takes one, the first of 2 is used"
    assert torch.allclose(image, direct(folder, COLORS[:1], single=True), atol=1e-5)


def test_kontext_is_given_the_size_asked_for_as_its_area(comfy: harness.ComfyHost, tiny_flux_dir: Path) -> None:
    """FLUX.1 Kontext rescales its output to an area (1024² by default) at the asked aspect: the call
    carries width × height as that area, so the image is the size asked for."""
    call = comfy.pack_submodule("nodes.call")
    grid = comfy.pack_submodule("nodes.grid")
    pipe = diffusers.FluxKontextPipeline(**diffusers.FluxPipeline.from_pretrained(tiny_flux_dir).components)
    assembled = call.Call(pipe)
    assembled.size(grid.model_grid(pipe, "flux"), 48, 32)
    assert (assembled.kwargs["width"], assembled.kwargs["height"], assembled.kwargs["max_area"]) == (48, 32, 48 * 32)
    plain = call.Call(diffusers.FluxPipeline.from_pretrained(tiny_flux_dir))
    plain.size(grid.model_grid(plain.pipe, "flux"), 48, 32)
    assert "max_area" not in plain.kwargs


@pytest.mark.parametrize(("model", "colors", "message"), [
    ("flux", COLORS[:1], "FluxPipeline takes no reference image: load an image-editing model"),
    ("qwen_edit", (), "QwenImageEditPlusPipeline edits an image: connect reference_images"),
])
def test_a_pipeline_given_references_it_cannot_take_or_none_it_needs_is_refused_by_name(
    comfy: harness.ComfyHost, tiny_flux_dir: Path, tiny_qwen_image_edit_dir: Path, captured: list[Any],
    model: str, colors: tuple[int, ...], message: str,
) -> None:
    folder = {"flux": tiny_flux_dir, "qwen_edit": tiny_qwen_image_edit_dir}[model]

    result = comfy.run_prompt(graph(linked(comfy, folder), colors))

    assert not result.success and result.error["node_id"] == GEN
    assert message in result.error["exception_message"]
