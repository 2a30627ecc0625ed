"""A silent model's AUDIO output inside a real ComfyUI: silence as long as the clip, which ComfyUI's
own SaveAudio and PreviewAudio take (issue 22, item 2)."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import pytest
import torch
from comfyhost import harness
from comfyhost.capture import capture_class

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]

CAPTURE = "DiffusersOffloadTest_SilentCapture"
AUDIO_NODES = ("SaveAudio", "PreviewAudio")
Capture = capture_class()


def _audio_nodes(comfy: harness.ComfyHost) -> dict[str, type]:
    """ComfyUI's SaveAudio / PreviewAudio. Without torchaudio ComfyUI skips their file at start-up;
    they only resample for Opus, so the real file is loaded here with a stand-in torchaudio."""
    mappings = comfy.nodes.NODE_CLASS_MAPPINGS
    if all(name in mappings for name in AUDIO_NODES):
        return {name: mappings[name] for name in AUDIO_NODES}
    stub = types.ModuleType("torchaudio")
    stub.functional = types.SimpleNamespace(resample=None)  # type: ignore[attr-defined]
    path = comfy.comfy_dir / "comfy_extras" / "nodes_audio.py"
    spec = importlib.util.spec_from_file_location("diffusers_offload_test_nodes_audio", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "torchaudio", stub)
        spec.loader.exec_module(module)
    found = getattr(module, "NODE_CLASS_MAPPINGS", None)
    if found is None:  # a V3 file: ask its extension for the node classes
        extension = comfy.loop.run_until_complete(module.comfy_entrypoint())
        nodes = comfy.loop.run_until_complete(extension.get_node_list())
        found = {node.GET_SCHEMA().node_id: node for node in nodes}
    return {name: found[name] for name in AUDIO_NODES}


@pytest.fixture(scope="module")
def wan(comfy: harness.ComfyHost, tiny_wan_dir: Path) -> Iterator[str]:
    """The tiny Wan listed by the loader, with the audio nodes and a capture node registered."""
    model = ex.link_model(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]), tiny_wan_dir)
    with pytest.MonkeyPatch.context() as patch:
        for name, node in _audio_nodes(comfy).items():
            patch.setitem(comfy.nodes.NODE_CLASS_MAPPINGS, name, node)
        patch.setitem(comfy.nodes.NODE_CLASS_MAPPINGS, CAPTURE, Capture)
        yield model


def graph(model: str, **inputs: Any) -> dict[str, Any]:
    values = {"prompt": "a tiny red cat", "negative_prompt": "", "seed": 0, "steps": 2, "guidance": 0.0,
              "width": 32, "height": 32, "frames": 9, "fps": 0.0, **inputs}
    return {
        "1": {"class_type": "DiffusersOffloadLoadPipeline", "inputs": {"model": model, "dtype": "fp32"}},
        "2": {"class_type": "DiffusersOffloadGenerateVideo", "inputs": {"pipe": ["1", 0], **values}},
        "save": {"class_type": "SaveAudio", "inputs": {"audio": ["2", 2], "filename_prefix": "silent/wan"}},
        "preview": {"class_type": "PreviewAudio", "inputs": {"audio": ["2", 2]}},
        "cap": {"class_type": CAPTURE, "inputs": {"value": ["2", 2], "slot": 2}},
    }


def _samples(path: Path) -> tuple[int, int, list[float]]:
    """(sample rate, samples, peak per decoded frame) of an audio-only file."""
    with av.open(str(path)) as container:
        assert [s.type for s in container.streams] == ["audio"]
        rate = container.streams.audio[0].codec_context.sample_rate
        frames = [frame.to_ndarray() for frame in container.decode(audio=0)]
    return rate, sum(f.shape[-1] for f in frames), [float(abs(f).max()) for f in frames]


@pytest.mark.parametrize(("fps", "frames", "seconds"), [(0.0, 9, 9 / 16), (8.0, 13, 13 / 8)])
def test_a_silent_models_audio_is_silence_as_long_as_the_clip_and_saves(
    comfy: harness.ComfyHost, wan: str, fps: float, frames: int, seconds: float
) -> None:
    Capture.seen.clear()

    result = comfy.run_prompt(graph(wan, fps=fps, frames=frames)).raise_for_error()

    ((_, audio),) = Capture.seen
    assert set(audio) == {"waveform", "sample_rate"} and audio["sample_rate"] == 44100
    waveform = audio["waveform"]
    assert waveform.dtype == torch.float32 and waveform.shape == (1, 1, round(seconds * 44100))
    assert not waveform.any()
    (saved,) = comfy.output_files(result, "save")
    (previewed,) = comfy.output_files(result, "preview")
    assert saved.suffix == previewed.suffix == ".flac"
    for path in (saved, previewed):
        rate, samples, peaks = _samples(path)
        assert (rate, samples) == (44100, round(seconds * 44100)) and max(peaks) == 0.0
