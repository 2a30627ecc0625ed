"""MiniMax-H3 ref2va with video and audio references through ComfyUI: Generate (H3)'s ref_video_1…3
(VIDEO, with its soundtrack) and ref_audio_1…3 (AUDIO) beside the reference images, on the tiny H3.

What a user sees: a run with an image, a video (ComfyUI's own CreateVideo, i.e. a
VideoFromComponents, with a soundtrack) and an audio clip gives video with audio; the pipeline is
called with the references in the stated order (images, videos, audio clips) at their own rates;
bad input is refused by name before the pipeline is called; the new sockets come after every
input a saved workflow already has. The images' own cases are test_h3's.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyhost import harness
from comfyhost.capture import capture_class
from diffusers.modular_pipelines.minimax_h3 import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from fixtures.tiny_h3_ref import SMALL_CANVAS, build_tiny_h3_ref

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]

LOAD, GEN, CAPTURE = "1", "2", "DiffusersOffloadTest_CaptureH3AV"
NODE = "DiffusersOffloadGenerateH3"
RATE = 160  # the tiny audio VAE's sample rate: no resampling (torchaudio is optional here)
SETTINGS = {
    "mode": "auto", "use_stream": True, "record_stream": False, "pin_memory": True, "pin_reserve_gb": 4.0,
    "on_demand_threshold_gb": 0.0, "resident_floor_mb": 0.0, "always": "", "never": "", "preload": "auto",
    "prefetch_window": 1, "device": "", "measures_path": "",
}  # fmt: skip
OLD_INPUTS = [  # the node's inputs before the video and audio references, in order
    "pipe", "prompt", "seed", "steps", "width", "height", "frames", "duration", "generate_audio",
    "vae_scale_factor", "first_frame", "last_frame", *(f"ref_{i}" for i in range(1, 10)),
]  # fmt: skip
NEW_INPUTS = [*(f"ref_video_{i}" for i in (1, 2, 3)), *(f"ref_audio_{i}" for i in (1, 2, 3))]


def source_class(kind: str) -> type:
    """A test node whose output is the ``kind`` value stored under its key (ComfyUI's LoadAudio
    needs torchaudio, and no core node makes a VIDEO without frames)."""

    class Source:
        values: dict[str, Any] = {}
        RETURN_TYPES = (kind,)
        FUNCTION = "run"
        CATEGORY = "testing"

        @classmethod
        def INPUT_TYPES(cls) -> dict[str, Any]:
            return {"required": {"key": ("STRING", {"default": ""})}}

        @classmethod
        def IS_CHANGED(cls, **_: Any) -> float:
            return float("nan")

        def run(self, key: str) -> tuple[Any]:
            return (self.values[key],)

    return Source


Capture, AudioSource, VideoSource = capture_class(), source_class("AUDIO"), source_class("VIDEO")
NODES = {
    CAPTURE: Capture,
    "DiffusersOffloadTest_Audio": AudioSource,
    "DiffusersOffloadTest_Video": VideoSource,
}


@pytest.fixture(scope="module")
def ref_model(comfy: harness.ComfyHost, tiny_models_root: Path) -> Iterator[str]:
    """The tiny H3 with its ref2va partition on a small canvas (a video reference is put on the
    canvas rule: see tiny_h3_ref), listed by the loader; the test nodes registered."""
    folder = build_tiny_h3_ref(tiny_models_root / "tiny-minimax-h3-ref-av", canvas=SMALL_CANVAS)
    model = ex.link_model(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]), folder)
    with pytest.MonkeyPatch.context() as patch:
        for name, node in NODES.items():
            patch.setitem(comfy.nodes.NODE_CLASS_MAPPINGS, name, node)
        yield model


@pytest.fixture
def captured(ref_model: str) -> list[tuple[int, Any]]:
    Capture.seen.clear()
    AudioSource.values.clear()
    VideoSource.values.clear()
    return Capture.seen


@pytest.fixture
def calls(comfy: harness.ComfyHost, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every pipeline call the node makes (its run view, wrapped)."""
    h3 = comfy.pack_submodule("nodes.h3")
    make_view = h3.run_view
    seen: list[dict[str, Any]] = []

    def spying(*args: Any, **kwargs: Any) -> Any:
        view = make_view(*args, **kwargs)
        return lambda **call: seen.append(call) or view(**call)

    monkeypatch.setattr(h3, "run_view", spying)
    return seen


def graph(model: str, workflow: str = "ref2va", **inputs: Any) -> dict:
    """Settings -> Load modular pipeline -> Generate (H3) -> a Capture per output slot."""
    values = {"prompt": "<Picture 1> walks like <Video 1>, speaking as <Audio 1>", "seed": 0, "steps": 3,
              "width": 32, "height": 32, "frames": 124, "duration": 0.0, "generate_audio": True,
              "vae_scale_factor": 0, **inputs}  # fmt: skip
    prompt = {
        "s": {"class_type": "DiffusersOffloadSettings", "inputs": SETTINGS},
        LOAD: {"class_type": "DiffusersOffloadLoadModularPipeline",
               "inputs": {"model": model, "workflow": workflow, "dtype": "fp32", "offload": ["s", 0]}},
        GEN: {"class_type": NODE, "inputs": {"pipe": [LOAD, 0], **values}},
    }  # fmt: skip
    for slot in range(4):
        prompt[f"c{slot}"] = {"class_type": CAPTURE, "inputs": {"value": [GEN, slot], "slot": slot}}
    return prompt


def image(prompt: dict, name: str, width: int = 32, height: int = 32, batch: int = 1) -> dict:
    prompt[name] = {"class_type": "EmptyImage",
                    "inputs": {"width": width, "height": height, "batch_size": batch, "color": 0xC81E1E}}  # fmt: skip
    prompt[GEN]["inputs"][name] = [name, 0]
    return prompt


def audio(
    prompt: dict, name: str, waveform: torch.Tensor, rate: int = RATE, target: str | None = None
) -> dict:
    """A test AUDIO source wired into ``target`` (default: the Generate input ``name``)."""
    AudioSource.values[name] = {"waveform": waveform, "sample_rate": rate}
    prompt[f"a_{name}"] = {"class_type": "DiffusersOffloadTest_Audio", "inputs": {"key": name}}
    node, socket = (GEN, name) if target is None else (target, "audio")
    prompt[node]["inputs"][socket] = [f"a_{name}", 0]
    return prompt


def video(
    prompt: dict,
    name: str,
    frames: int = 8,
    fps: float = 12.0,
    soundtrack: torch.Tensor | None = None,
    rate: int = RATE,
    width: int = 32,
) -> dict:
    """ComfyUI's CreateVideo (a VideoFromComponents) from EmptyImage frames, with a test AUDIO soundtrack."""
    prompt[f"f_{name}"] = {
        "class_type": "EmptyImage",
        "inputs": {"width": width, "height": 32, "batch_size": frames, "color": 0x1E1EC8},
    }
    prompt[name] = {"class_type": "CreateVideo", "inputs": {"images": [f"f_{name}", 0], "fps": fps}}
    if soundtrack is not None:
        audio(prompt, f"{name}_sound", soundtrack, rate, target=name)
    prompt[GEN]["inputs"][name] = [name, 0]
    return prompt


def outputs(seen: list[tuple[int, Any]]) -> dict[int, Any]:
    return dict(seen)


def test_ref2va_from_an_image_a_video_with_sound_and_an_audio_clip(
    comfy: harness.ComfyHost, ref_model: str, captured: list, calls: list[dict[str, Any]]
) -> None:
    soundtrack, clip = torch.rand(1, 2, 240) - 0.5, torch.rand(1, 1, 320) - 0.5
    prompt = graph(ref_model)  # wired audio first, then the video, then the image: the order is the node's
    audio(prompt, "ref_audio_1", clip)
    video(prompt, "ref_video_2", frames=8, fps=12.0, soundtrack=soundtrack)
    image(prompt, "ref_3", width=48)

    result = comfy.run_prompt(prompt).raise_for_error()

    out = outputs(captured)
    assert out[3] == ""
    assert out[1].shape == (124, 32, 32, 3) and out[2]["waveform"].shape == (1, 2, 828)
    assert out[2]["sample_rate"] == RATE and out[0].get_components().audio is not None
    (call,) = calls
    assert [type(r) for r in call["references"]] == [
        MiniMaxH3ImageReference, MiniMaxH3VideoReference, MiniMaxH3AudioReference,
    ]  # fmt: skip
    picture, clip_ref, sound_ref = call["references"]
    assert picture.image.size == (48, 32)
    frames = (
        clip_ref.frames
    )  # CreateVideo's frames at their own rate: uint8 (T, 3, H, W), as diffusers reads them
    assert clip_ref.fps == 12.0 and frames.dtype == torch.uint8 and tuple(frames.shape) == (8, 3, 32, 32)
    assert frames[:, :, 0, 0].tolist() == [[30, 30, 200]] * 8  # EmptyImage's 0x1E1EC8
    assert clip_ref.sample_rate == RATE and torch.equal(clip_ref.audio, soundtrack[0])
    assert sound_ref.sample_rate == RATE and torch.equal(sound_ref.audio, clip[0])
    labels = [text for node, text in result.progress_texts if node == GEN]
    assert "image encode 2/2" in labels  # the image still, then the video's 16 frames at 24 fps: one chunk


def test_the_reference_sockets_come_after_every_input_a_saved_workflow_has(comfy: harness.ComfyHost) -> None:
    info = ex.object_info(comfy, NODE)
    inputs = [(name, kind, optional) for name, kind, _, optional in ex.schema_inputs(info)]
    names = [name for name, _, _ in inputs]
    assert names == OLD_INPUTS + NEW_INPUTS  # a saved workflow's sockets keep their places
    assert [(kind, optional) for _, kind, optional in inputs[len(OLD_INPUTS) :]] == [("VIDEO", True)] * 3 + [
        ("AUDIO", True)
    ] * 3
    description = info["description"]
    assert (
        "images (ref_1…ref_9), then videos (ref_video_1…3), then audio clips (ref_audio_1…3)" in description
    )


def stereo(batch: int = 1, samples: int = 160) -> torch.Tensor:
    return torch.zeros(batch, 2, samples)


BAD = {  # case: (workflow, how to wire it, what the error says)
    "four-audio-clips": ("ref2va", lambda p: audio(audio(image(p, "ref_1"), "ref_audio_1", stereo(2)),
                                                   "ref_audio_2", stereo(2)),
                         "4 reference audio clips are connected (ref_audio_1: 2, ref_audio_2: 2); MiniMax-H3 takes "
                         "at most 3"),
    "thirteen-in-all": ("ref2va", lambda p: audio(video(video(video(image(p, "ref_1", batch=9), "ref_video_1"),
                                                                    "ref_video_2"), "ref_video_3"),
                                                  "ref_audio_3", stereo()),
                        "13 references are connected (9 images, 3 videos, 1 audio clip); MiniMax-H3 takes at most "
                        "12 in all"),
    "video-on-t2va": ("t2va", lambda p: video(p, "ref_video_1"),
                      "reference videos (ref_video_1) are connected but the pipeline is loaded for t2va: load it "
                      "with workflow ref2va"),
    "audio-on-t2va": ("t2va", lambda p: audio(image(p, "ref_1"), "ref_audio_2", stereo()),
                      "references (ref_1, ref_audio_2) are connected but the pipeline is loaded for t2va"),
    "video-without-frames": ("ref2va", lambda p: empty_video(p, "ref_video_2"),
                             "ref_video_2 has no frames ((0, 0, 0, 3)): connect a video with at least one frame"),
    "audio-at-0-hz": ("ref2va", lambda p: audio(image(p, "ref_1"), "ref_audio_1", stereo(), rate=0),
                      "ref_audio_1 has a sample rate of 0: MiniMax-H3 needs the rate the samples run at"),
    "soundtrack-at-0-hz": ("ref2va", lambda p: video(p, "ref_video_1", soundtrack=stereo(), rate=0),
                           "ref_video_1's soundtrack has a sample rate of 0"),
    "audio-alone": ("ref2va", lambda p: audio(p, "ref_audio_1", stereo()),
                    "reference audio clips (ref_audio_1) without a reference image or video: MiniMax-H3 pairs "
                    "reference audio with at least one of them"),
    "six-channels": ("ref2va", lambda p: audio(image(p, "ref_1"), "ref_audio_1", torch.zeros(1, 6, 160)),
                     "ref_audio_1 has 6 channels; MiniMax-H3 takes mono or stereo"),
    "video-too-short": ("ref2va", lambda p: video(p, "ref_video_1", frames=6, fps=24.0),
                        "ref_video_1 gives 6 frames at 24 fps; MiniMax-H3 reads a reference video in groups that "
                        "need at least 13 frames at 24 fps"),
    "video-in-a-still": ("ref2va", lambda p: video(p, "ref_video_1", frames=24, fps=24.0),
                         "ref_video_1 cannot condition a still (frames = 1)"),
}  # fmt: skip


def empty_video(prompt: dict, name: str) -> dict:
    from comfy_api.latest import InputImpl, Types

    parts = Types.VideoComponents(images=torch.zeros(0, 0, 0, 3), frame_rate=Fraction(24))
    VideoSource.values[name] = InputImpl.VideoFromComponents(parts)
    prompt[f"v_{name}"] = {"class_type": "DiffusersOffloadTest_Video", "inputs": {"key": name}}
    prompt[GEN]["inputs"][name] = [f"v_{name}", 0]
    return prompt


@pytest.mark.parametrize("case", list(BAD))
def test_bad_video_and_audio_references_are_refused_by_name_before_the_pipeline_runs(
    comfy: harness.ComfyHost, ref_model: str, captured: list, calls: list, case: str
) -> None:
    workflow, wire, message = BAD[case]
    prompt = wire(graph(ref_model, workflow, **({"frames": 1} if case == "video-in-a-still" else {})))

    result = comfy.run_prompt(prompt)

    assert not result.success and result.error["node_id"] == GEN
    assert message in result.error["exception_message"]
    assert not calls and not captured


@pytest.mark.skipif(
    importlib.util.find_spec("torchaudio") is not None, reason="torchaudio resamples the clip"
)
def test_audio_at_another_rate_without_torchaudio_is_refused(
    comfy: harness.ComfyHost, ref_model: str, captured: list, calls: list
) -> None:
    prompt = audio(image(graph(ref_model), "ref_1"), "ref_audio_1", stereo(), rate=44100)

    result = comfy.run_prompt(prompt)

    assert not result.success and not calls
    assert (
        "ref_audio_1 is at 44100 Hz; the audio VAE takes 160 Hz and resampling needs torchaudio, which is not "
        "installed" in result.error["exception_message"]
    )
