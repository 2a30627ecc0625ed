"""MiniMax-H3 through ComfyUI: Load modular pipeline + Generate (H3) on the tiny H3, in-process.

What a user sees: VIDEO with its soundtrack, IMAGE frames and AUDIO out; fl2va from a first frame,
a last frame or both; a still (frames = 1) that leaves the next run on the same pipeline back on
the 5–15 s rule; audio off removing the audio decode block (the audio decoder never runs, the saved
file has no audio stream); sizes snapped with a note; a label and a bar per stage; Cancel stopping
a text encode within one layer, a denoise within one step and a decode within one chunk, with the
next run working; re-placing with unchanged settings touching no hook. Every component is given a
real transport (the settings below), so the stage hooks run beside real offload hooks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import pytest
import torch
from comfyhost import h3, harness
from comfyhost.capture import capture_class
from comfyhost.h3 import GEN, LOAD, assert_frames, capture_pipe, outputs
from fixtures.hook_inventory import hook_inventory

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]

CAPTURE = "DiffusersOffloadTest_CaptureH3"
UNIT_CLASSES = {  # the module each stage repeats, by class name
    "text encode": "Qwen3VLTextDecoderLayer",
    "denoise": "MiniMaxH3Transformer3DModel",
    "video decode": "MiniMaxH3VideoViTDecoder3d",
    "audio decode": "MiniMaxH3AudioBigVGANDecoder",
}


Capture = capture_class()


@pytest.fixture(scope="module")
def model(comfy: harness.ComfyHost, tiny_h3_dir: Path) -> Iterator[str]:
    yield from h3.linked(comfy, tiny_h3_dir, CAPTURE, Capture)


@pytest.fixture
def captured(model: str) -> dict[int, Any]:
    Capture.seen.clear()
    return Capture.seen


@pytest.fixture
def every_update(comfy: harness.ComfyHost, monkeypatch: pytest.MonkeyPatch) -> None:
    """2026 trees drop progress updates closer than 0.1 s; tiny units take less."""
    monkeypatch.setattr(comfy.comfy_utils, "PROGRESS_THROTTLE_MIN_INTERVAL", 0.0, raising=False)


@pytest.fixture
def units_run() -> Iterator[list[str]]:
    """Stage names of every unit module that finished a forward, in order (a global forward hook)."""
    names = {cls: stage for stage, cls in UNIT_CLASSES.items()}
    done: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, *_: done.append(names[type(module).__name__]) if type(module).__name__ in names else None
    )
    yield done
    handle.remove()


def graph(model: str, workflow: str = "t2va", **kwargs: Any) -> dict:
    return h3.graph(model, CAPTURE, workflow, **kwargs)


def with_frames(prompt: dict, **colours: int) -> dict:
    """Connect first_frame / last_frame to flat EmptyImage keyframes (another aspect than the canvas)."""
    for name, colour in colours.items():
        prompt[name] = {"class_type": "EmptyImage", "inputs": {"width": 48, "height": 40, "batch_size": 1,
                                                             "color": colour}}
        prompt[GEN]["inputs"][name] = [name, 0]
    return prompt


def saved(prompt: dict, prefix: str) -> dict:
    prompt["save"] = {"class_type": "SaveVideo", "inputs": {"video": [GEN, 0], "filename_prefix": prefix,
                                                           "format": "auto", "codec": "auto"}}
    return prompt


def texts(result: harness.RunResult) -> list[str]:
    return [text for node, text in result.progress_texts if node == GEN]


def test_t2va_gives_video_with_audio_frames_and_audio_with_a_label_per_stage(
    comfy: harness.ComfyHost, model: str, captured: list, every_update: None
) -> None:
    prompt = graph(model, outputs=(0, 1, 2, 3))  # not saved: AAC cannot encode the tiny audio VAE's 160 Hz
    capture_pipe(prompt, CAPTURE)

    result = comfy.run_prompt(prompt).raise_for_error()

    out = outputs(captured)
    video, images, audio, notes = out[0], out[1], out[2], out[3]
    assert notes == ""
    assert_frames(images, 124)
    assert set(audio) == {"waveform", "sample_rate"} and audio["sample_rate"] == 160
    assert audio["waveform"].shape == (1, 2, 828) and audio["waveform"].dtype == torch.float32
    components = video.get_components()
    assert torch.equal(components.images, images) and torch.equal(components.audio["waveform"], audio["waveform"])
    assert components.frame_rate == Fraction(24)
    labels = texts(result)
    for label in ("text encode layer 1/50", "text encode layer 50/50", "denoise step 2/2",
                  "video decode chunk 7/7", "audio decode 1/1"):
        assert label in labels
    assert labels.index("text encode layer 50/50") < labels.index("denoise step 1/2") < labels.index(
        "video decode chunk 1/7") < labels.index("audio decode 1/1")
    assert (7, 7) in [(p.value, p.total) for p in result.progress if p.node_id == GEN]
    pipe = out[9].pipe  # the model's own scheduler pair is what ran
    assert (pipe.scheduler.config.shift, pipe.audio_scheduler.config.shift) == (12.0, 3.0)


@pytest.mark.parametrize("keyframes", [{"first_frame": 0xC81E1E}, {"last_frame": 0x1E1EC8},
                                       {"first_frame": 0xC81E1E, "last_frame": 0x1E1EC8}],
                         ids=["first", "last", "both"])
def test_fl2va_from_a_first_a_last_or_both_frames(
    comfy: harness.ComfyHost, model: str, captured: list, keyframes: dict[str, int]
) -> None:
    result = comfy.run_prompt(with_frames(graph(model, "fl2va", outputs=(1, 2)), **keyframes)).raise_for_error()

    out = outputs(captured)
    assert_frames(out[1], 124)
    assert out[2]["waveform"].shape == (1, 2, 828)
    assert f"image encode {len(keyframes)}/{len(keyframes)}" in texts(result)


def test_a_workflow_mismatch_is_refused_by_name(comfy: harness.ComfyHost, model: str, captured: list) -> None:
    result = comfy.run_prompt(with_frames(graph(model, "t2va", outputs=(3,)), first_frame=0))

    assert not result.success and result.error["node_id"] == GEN
    assert "loaded for t2va: load it with workflow fl2va" in result.error["exception_message"]


def test_a_still_then_a_normal_run_on_the_same_pipeline(comfy: harness.ComfyHost, model: str, captured: list) -> None:
    comfy.run_prompt(graph(model, frames=1)).raise_for_error()
    still = outputs(captured)
    captured.clear()
    comfy.run_prompt(graph(model, frames=124, seed=1)).raise_for_error()
    clip = outputs(captured)

    assert_frames(still[1], 1)
    assert not still[2]["waveform"].any()  # a silent waveform of the still's length
    assert still[2]["waveform"].shape[-1] == round(still[2]["sample_rate"] / 24)
    assert still[3] == "a still has no soundtrack: audio off for this run"
    assert still[0].get_components().images.shape == (1, 32, 32, 3)
    assert_frames(clip[1], 124)
    assert clip[2]["waveform"].shape == (1, 2, 828)


def test_audio_off_removes_the_audio_decode_block(
    comfy: harness.ComfyHost, model: str, captured: list, units_run: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    h3 = comfy.pack_submodule("nodes.h3")
    views: list[Any] = []
    make_view = h3.run_view
    monkeypatch.setattr(h3, "run_view", lambda *a, **k: views.append(make_view(*a, **k)) or views[-1])

    result = comfy.run_prompt(saved(graph(model, generate_audio=False, seed=2), "h3/silent")).raise_for_error()

    out = outputs(captured)
    assert not out[2]["waveform"].any() and out[0].get_components().audio is None
    assert_frames(out[1], 124)
    (view,) = views
    assert not [n for n, b in view._blocks.sub_blocks.items() if type(b).__name__ == "MiniMaxH3AudioDecodeStep"]
    assert "audio decode" not in units_run and "video decode" in units_run  # the spy saw the decoders that ran
    assert not [t for t in texts(result) if t.startswith("audio decode")]
    (path,) = comfy.output_files(result, "save")
    with av.open(str(path)) as container:
        assert [s.type for s in container.streams] == ["video"]


def test_canvas_and_frames_are_snapped_with_a_note(comfy: harness.ComfyHost, model: str, captured: list) -> None:
    result = comfy.run_prompt(graph(model, width=40, height=24, frames=130)).raise_for_error()

    notes = outputs(captured)[3]
    assert notes.splitlines() == [
        "width 40 → 32 (multiple of 32 for MiniMax-H3)",
        "height 24 → 32 (multiple of 32 for MiniMax-H3)",
        "frames 130 → 141 (17n+5 at 24 fps, 5–15 s for MiniMax-H3)",
    ]
    assert notes in texts(result)
    assert_frames(outputs(captured)[1], 141)


@pytest.mark.parametrize(("stage", "unit"), [("text encode", 10), ("denoise", 2), ("video decode", 3)])
def test_cancel_stops_each_stage_within_one_unit_and_the_next_run_works(
    comfy: harness.ComfyHost, model: str, captured: list, units_run: list[str], monkeypatch: pytest.MonkeyPatch,
    stage: str, unit: int,
) -> None:
    """Cancel pressed while unit ``unit`` of ``stage`` is announced: not one more unit of it runs."""
    running = comfy.pack_submodule("nodes.running")
    make_host = running.stage_host
    at_flag: list[int] = []

    def pressing_cancel(node_id: str | None, pipe: Any = None) -> Any:
        host = make_host(node_id, pipe)

        def on_stage(name: str, i: int, n: int) -> None:
            host.on_stage(name, i, n)
            if (name, i) == (stage, unit):
                at_flag.append(units_run.count(stage))
                comfy.interrupt()

        return type(host)(on_stage=on_stage, check_interrupt=host.check_interrupt)

    monkeypatch.setattr(running, "stage_host", pressing_cancel)
    engine = comfy.pack_submodule("nodes.host").ENGINE
    ended: list[str] = []
    after_run = engine.after_run
    monkeypatch.setattr(engine, "after_run", lambda pipe: ended.append(type(pipe).__name__) or after_run(pipe))
    # a prompt per case, never encoded before: the text encoder runs (the prompt cache has no entry for it)
    prompt = graph(model, seed=30 + list(UNIT_CLASSES).index(stage), outputs=(3,), prompt=f"a robot, {stage} case")

    stopped = comfy.run_prompt(prompt)

    assert stopped.interrupted and not stopped.success
    assert ended == ["MiniMaxH3ModularPipeline"]  # the stopped call was still ended
    assert at_flag == [unit - 1] and units_run.count(stage) == unit - 1  # nothing of the stage ran after
    monkeypatch.setattr(running, "stage_host", make_host)
    units_run.clear()
    comfy.run_prompt(prompt).raise_for_error()
    # a cancelled encode cached nothing: the next run encodes the prompt (every layer); a finished one was kept
    assert units_run.count("text encode") == (50 if stage == "text encode" else 0)


def test_replacing_with_unchanged_settings_changes_no_hook(comfy: harness.ComfyHost, model: str,
                                                           captured: list) -> None:
    prompt = graph(model, outputs=(3,), seed=4)
    capture_pipe(prompt, CAPTURE)
    comfy.run_prompt(prompt).raise_for_error()
    handle = outputs(captured)[9]
    before = hooks(handle.pipe)
    prompt[GEN]["inputs"]["seed"] = 5

    comfy.run_prompt(prompt).raise_for_error()

    assert outputs(captured)[9] is handle  # the loader's output was reused: the same placed pipeline
    after = hooks(handle.pipe)
    assert before and after.keys() == before.keys() and all(after[k] is before[k] for k in before)


def hooks(pipe: Any) -> dict[tuple[str, str, str], Any]:
    """Every offload hook (registry entries, instance-level entries) and torch hook under the components."""
    return hook_inventory(pipe, ("text_encoder", "transformer", "vae", "audio_vae"), torch_hooks=True)


# -- ref2va: reference images ref_1..ref_9 -----------------------------------------------------------
@pytest.fixture(scope="module")
def ref_model(comfy: harness.ComfyHost, model: str, tiny_h3_ref_dir: Path) -> str:
    """The tiny H3 with its transformer_ref partition, listed by the loader (Capture registered by `model`)."""
    return ex.link_model(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]), tiny_h3_ref_dir)


def with_refs(prompt: dict, **refs: tuple[int, int, int]) -> dict:
    """Connect ref_i inputs to flat EmptyImage batches: name -> (width, height, batch size)."""
    for i, (name, (width, height, batch)) in enumerate(refs.items()):
        prompt[name] = {"class_type": "EmptyImage", "inputs": {"width": width, "height": height,
                                                              "batch_size": batch, "color": 0x1E1EC8 + 40 * i}}
        prompt[GEN]["inputs"][name] = [name, 0]
    return prompt


def test_ref2va_from_reference_images_gives_video_with_audio(
    comfy: harness.ComfyHost, ref_model: str, captured: list, units_run: list[str]
) -> None:
    prompt = with_refs(graph(ref_model, "ref2va", outputs=(0, 1, 2, 3)), ref_1=(48, 32, 1), ref_3=(32, 32, 2))
    capture_pipe(prompt, CAPTURE)

    result = comfy.run_prompt(prompt).raise_for_error()

    out = outputs(captured)
    assert out[3] == ""
    assert_frames(out[1], 124)
    assert out[2]["waveform"].shape == (1, 2, 828) and out[2]["sample_rate"] == 160
    components = out[0].get_components()
    assert torch.equal(components.images, out[1]) and torch.equal(components.audio["waveform"], out[2]["waveform"])
    labels = texts(result)
    assert "image encode 3/3" in labels  # ref_1's image and ref_3's two, each encoded at its own size
    assert labels.index("image encode 3/3") < labels.index("denoise step 1/2")
    assert units_run.count("denoise") == 2
    pipe = out[9].pipe  # the ref2va partition alone was loaded, and it is what denoised
    assert getattr(pipe, "transformer", None) is None and pipe.transformer_ref is not None


def test_a_ref2va_transformer_file_is_the_reference_transformer(
    comfy: harness.ComfyHost, ref_model: str, captured: list, tiny_h3_ref_dir: Path
) -> None:
    """ref2va with ``transformer_file``: the file (Comfy-Org's ``minimax_h3_ref2va_*`` layout) becomes
    ``transformer_ref``, the partition ref2va denoises with: the folder's weights in it give the
    folder's frames, a file with one bias moved moves them."""
    from diffusers import MiniMaxH3Transformer3DModel
    from fixtures.h3_files import comfy_h3_state_dict, write

    model = MiniMaxH3Transformer3DModel.from_pretrained(str(tiny_h3_ref_dir / "transformer_ref"))
    state = comfy_h3_state_dict(model.state_dict(), dict(model.config))
    folder = Path(comfy.folder_paths.get_folder_paths("diffusion_models")[0])
    write(state, folder / "h3-tiny-ref2va.safetensors")
    write({**state, "final_layer.video_out.bias": state["final_layer.video_out.bias"] + 0.5},
          folder / "h3-tiny-ref2va-moved.safetensors")

    def frames(**load: str) -> torch.Tensor:
        captured.clear()
        prompt = capture_pipe(with_refs(graph(ref_model, "ref2va", outputs=(1,), steps=2), ref_1=(32, 32, 1)), CAPTURE)
        prompt[LOAD]["inputs"] |= load
        comfy.run_prompt(prompt).raise_for_error()
        out = outputs(captured)
        assert getattr(out[9].pipe, "transformer", None) is None
        return out[1]

    reference = frames()
    torch.testing.assert_close(frames(transformer_file="h3-tiny-ref2va.safetensors"), reference, rtol=0, atol=0)
    assert not torch.equal(frames(transformer_file="h3-tiny-ref2va-moved.safetensors"), reference)


@pytest.mark.parametrize(("workflow", "inputs", "message"), [
    ("ref2va", {}, "loaded for ref2va, which needs at least one reference image: connect ref_1 (up to ref_9)"),
    ("t2va", {"ref_2": (32, 32, 1)}, "reference images (ref_2) are connected but the pipeline is loaded for t2va: "
                                     "load it with workflow ref2va"),
    ("fl2va", {"ref_1": (32, 32, 1)}, "reference images (ref_1) are connected but the pipeline is loaded for fl2va"),
    ("ref2va", {"ref_1": (32, 32, 4), "ref_2": (32, 32, 6)}, "10 reference images are connected (ref_1: 4, "
                                                              "ref_2: 6); MiniMax-H3 takes at most 9"),
    ("ref2va", {"ref_1": (160, 32, 1)}, "ref_1 is 160×32; MiniMax-H3 takes reference images within 1:4 and 4:1"),
], ids=["ref2va-without-references", "t2va-with-a-reference", "fl2va-with-a-reference", "too-many", "aspect"])
def test_reference_inputs_the_workflow_cannot_take_are_refused_by_name(
    comfy: harness.ComfyHost, ref_model: str, captured: list, workflow: str, inputs: dict, message: str
) -> None:
    prompt = graph(ref_model, workflow, outputs=(3,))
    if workflow == "fl2va":
        with_frames(prompt, first_frame=0)
    result = comfy.run_prompt(with_refs(prompt, **inputs))

    assert not result.success and result.error["node_id"] == GEN
    assert message in result.error["exception_message"]
    assert not captured


def test_ref2va_refuses_keyframes_beside_references(comfy: harness.ComfyHost, ref_model: str, captured: list) -> None:
    prompt = with_frames(with_refs(graph(ref_model, "ref2va", outputs=(3,)), ref_1=(32, 32, 1)), last_frame=0)

    result = comfy.run_prompt(prompt)

    assert not result.success and result.error["node_id"] == GEN
    assert ("a first or last frame is connected but the pipeline is loaded for ref2va: load it with workflow fl2va"
            in result.error["exception_message"])


def test_a_ref2va_still(comfy: harness.ComfyHost, ref_model: str, captured: list) -> None:
    comfy.run_prompt(with_refs(graph(ref_model, "ref2va", frames=1, outputs=(1, 3)), ref_1=(32, 48, 1))
                     ).raise_for_error()

    out = outputs(captured)
    assert_frames(out[1], 1)
    assert out[3] == "a still has no soundtrack: audio off for this run"
