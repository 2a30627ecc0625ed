"""A classic run stopped mid-way inside a real ComfyUI, on the tiny Flux and Wan pipelines: Cancel
in a text encode and in a decode, and an out-of-memory error the engine cannot absorb.

What a user sees: Cancel takes effect within one text-encoder layer (every text encoder: Flux's
CLIP and T5, Wan's UMT5) and within one decoder chunk or tile, not only between denoise steps; the
label names each stage; the next run gives the output of a run never interrupted; nothing of the
pack is left on the pipeline (same hooks, same placement report). The prompt-embedding cache keeps
only finished encodes: a cancelled text encode leaves no entry (the next run encodes the prompt
again), a cancelled decode keeps its prompt's entry (the next run skips the text encoder). An out-of-memory error says what
was on the device per component, the free memory at the start and what to change, and leaves
nothing placed, even when ComfyUI does not unload its models itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyhost import harness
from comfyhost.capture import capture_class
from fixtures.hook_inventory import hook_inventory

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]

LOAD, GEN, CAPTURE = "1", "2", "DiffusersOffloadTest_CaptureInterrupts"
SETTINGS = {  # every role gets a transport on the tiny models (leaf text encoders, on-demand VAE)
    "mode": "auto", "use_stream": True, "record_stream": False, "pin_memory": True, "pin_reserve_gb": 4.0,
    "on_demand_threshold_gb": 0.0, "resident_floor_mb": 0.0, "always": "", "never": "", "preload": "auto",
    "prefetch_window": 1, "device": "", "measures_path": "",
}
UNIT_CLASSES = {  # the module each stage repeats, by class name
    "text encode": ("CLIPEncoderLayer", "T5Block", "UMT5Block"),
    "decode": ("Decoder", "WanDecoder3d"),
}
FAMILIES = {  # node, frames output slot, decode stage label, text layers per encoder
    "flux": ("DiffusersOffloadGenerateImage", 0, "decoding", 2),
    "wan": ("DiffusersOffloadGenerateVideo", 1, "video decode", 2),
}
COMPONENTS = {"flux": ("text_encoder", "text_encoder_2", "transformer", "vae"),
              "wan": ("text_encoder", "transformer", "vae")}

Capture = capture_class()


@pytest.fixture(scope="module")
def models(comfy: harness.ComfyHost, tiny_flux_dir: Path, tiny_wan_dir: Path) -> Iterator[dict[str, str]]:
    root = Path(comfy.folder_paths.get_folder_paths("diffusers")[0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(comfy.nodes.NODE_CLASS_MAPPINGS, CAPTURE, Capture)
        yield {family: ex.link_model(root, folder) for family, folder in
               (("flux", tiny_flux_dir), ("wan", tiny_wan_dir))}


@pytest.fixture
def captured(models: dict[str, str]) -> dict[int, Any]:
    Capture.seen.clear()
    return Capture.seen


@pytest.fixture
def units_run() -> Iterator[list[str]]:
    """Stage names of every unit module that finished a forward, in order (a global forward hook)."""
    names = {cls: stage for stage, classes in UNIT_CLASSES.items() for cls in classes}
    done: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, *_: done.append(names[type(module).__name__]) if type(module).__name__ in names else None
    )
    yield done
    handle.remove()


def graph(models: dict[str, str], family: str, seed: int, prompt: str = "a tiny red cat", **settings: Any) -> dict:
    """Settings -> Load (fp32) -> Generate -> Capture of the frames (slot 0) and of the loaded pipe (9)."""
    node, slot, _, _ = FAMILIES[family]
    values = {"prompt": prompt, "negative_prompt": "", "seed": seed, "steps": 2, "guidance": 0.0,
              "width": 32, "height": 32, **({"batch_size": 1} if family == "flux" else {"frames": 9, "fps": 0.0})}
    return {
        "s": {"class_type": "DiffusersOffloadSettings", "inputs": {**SETTINGS, **settings}},
        LOAD: {"class_type": "DiffusersOffloadLoadPipeline",
               "inputs": {"model": models[family], "dtype": "fp32", "offload": ["s", 0]}},
        GEN: {"class_type": node, "inputs": {"pipe": [LOAD, 0], **values}},
        "c0": {"class_type": CAPTURE, "inputs": {"value": [GEN, slot], "slot": 0}},
        "c9": {"class_type": CAPTURE, "inputs": {"value": [LOAD, 0], "slot": 9}},
    }


def texts(result: harness.RunResult) -> list[str]:
    return [text for node, text in result.progress_texts if node == GEN]


COUNTERS = ("moves", "sync_loads", "ooms")  # report details that count runs, not describe the placement


def state(handle: Any, family: str) -> tuple[dict, dict]:
    """What the pack leaves on a pipeline between runs: its placement report (less the run
    counters, and the prompt cache's summary: `cached` checks the cache) and every hook."""
    report = handle.report().to_dict()
    report.pop("prompt_cache")
    report["components"] = [{**c, "details": {k: v for k, v in c["details"].items() if k not in COUNTERS}}
                            for c in report["components"]]
    return report, hook_inventory(handle.pipe, COMPONENTS[family], torch_hooks=True)


def cached(comfy: harness.ComfyHost, handle: Any) -> int:
    """How many encoded prompts the pipeline's prompt-embedding cache holds."""
    return len(comfy.pack_submodule("offload_core.state").PROMPT_CACHE.get(handle.pipe).entries)


@pytest.mark.parametrize(("family", "stage", "unit"), [
    ("flux", "text encode", 3),  # T5's first layer: the second text encoder is stopped too
    ("flux", "decode", 1),
    ("wan", "text encode", 2),
    ("wan", "decode", 1),
    ("wan", "decode", 2),  # the second latent frame's chunk: a decode stopped half-way
])
def test_cancel_in_text_encode_or_decode_stops_within_one_unit_and_the_next_run_is_the_reference(
    comfy: harness.ComfyHost, models: dict[str, str], captured: dict, units_run: list[str],
    monkeypatch: pytest.MonkeyPatch, family: str, stage: str, unit: int,
) -> None:
    """Cancel pressed when the ``unit``-th unit of ``stage`` (counted over every text encoder) is
    announced: that unit and every later one never run."""
    seed = 100 + 10 * list(FAMILIES).index(family) + unit + (5 if stage == "decode" else 0)  # no cache hits
    prompt = f"a cat, case {seed}"
    comfy.run_prompt(graph(models, family, seed, prompt, pin_reserve_gb=4.5)).raise_for_error()
    frames = dict(captured)[0]  # another pipeline (other settings), never interrupted
    comfy.run_prompt(graph(models, family, seed=7, prompt="warm")).raise_for_error()
    handle = dict(captured)[9]
    before, entries = state(handle, family), cached(comfy, handle)
    target = "text encode" if stage == "text encode" else FAMILIES[family][2]
    running = comfy.pack_submodule("nodes.running")
    make_host = running.stage_host
    announced: list[int] = []
    at_flag: list[int] = []

    def pressing_cancel(node_id: str | None, pipe: Any = None, bar: bool = True) -> Any:
        host = make_host(node_id, pipe, bar)

        def on_stage(name: str, i: int, n: int) -> None:
            host.on_stage(name, i, n)
            if name == target:
                announced.append(i)
                if len(announced) == unit:
                    at_flag.append(units_run.count(stage))
                    comfy.interrupt()

        return type(host)(on_stage=on_stage, check_interrupt=host.check_interrupt)

    monkeypatch.setattr(running, "stage_host", pressing_cancel)
    units_run.clear()

    stopped = comfy.run_prompt(graph(models, family, seed, prompt))

    assert stopped.interrupted and not stopped.success
    assert at_flag == [unit - 1] and units_run.count(stage) == unit - 1  # not one unit ran after the request
    if stage == "decode":
        assert units_run.count("text encode") > 0  # the earlier stages ran whole
    assert dict(captured)[9] is handle and state(handle, family) == before  # nothing left on the pipeline
    encoded = stage == "decode"  # the text encode finished: its prompt is cached; a cancelled one is not
    assert cached(comfy, handle) == entries + encoded
    monkeypatch.setattr(running, "stage_host", make_host)
    again = comfy.run_prompt(graph(models, family, seed, prompt)).raise_for_error()
    assert torch.equal(dict(captured)[0], frames), "the run after an interrupt differs from the reference"
    layers = FAMILIES[family][3]
    encodes = [t for t in texts(again) if t.startswith("text encode")]
    if encoded:
        assert encodes == []  # served from the prompt cache
    else:  # encoded again, from the first layer
        assert [f"text encode layer {i}/{layers}" for i in range(1, layers + 1)] == encodes[:layers]
    assert cached(comfy, handle) == entries + 1
    assert any(t.startswith(f"{FAMILIES[family][2]} ") for t in texts(again)) and state(handle, family) == before


def test_video_decode_is_labelled_per_latent_frame_chunk(comfy: harness.ComfyHost, models: dict[str, str],
                                                          captured: dict) -> None:
    result = comfy.run_prompt(graph(models, "wan", seed=61)).raise_for_error()

    decode = [t for t in texts(result) if t.startswith("video decode")]
    assert decode == ["video decode chunk 1/3", "video decode chunk 2/3", "video decode chunk 3/3"]  # 9 frames: 3
    flux = comfy.run_prompt(graph(models, "flux", seed=61)).raise_for_error()
    assert [t for t in texts(flux) if t.startswith("decoding ")] == ["decoding 1/1"]
    assert [t for t in texts(flux) if t.startswith("text encode")] == [
        "text encode layer 1/2", "text encode layer 2/2"] * 2  # CLIP, then T5


def test_out_of_memory_names_the_device_use_and_what_to_change_and_leaves_nothing_placed(
    comfy: harness.ComfyHost, models: dict[str, str], captured: dict, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The denoiser's forward raises torch's OOM once; ComfyUI's own unload-all is disabled, so only
    the node's handling can have released the placement."""
    comfy.run_prompt(graph(models, "wan", seed=71)).raise_for_error()
    handle = dict(captured)[9]
    running = comfy.pack_submodule("nodes.running")
    oom = comfy.pack_submodule("offload_core.oom")
    read: list[str] = []

    def scripted(memory: Any, device: str) -> Any:
        read.append(str(device))
        return oom.DeviceReading(str(device), 3 * 2**30, 12 * 2**30)

    monkeypatch.setattr(running, "read_device", scripted)
    monkeypatch.setattr(comfy.model_management, "unload_all_models", lambda: None)
    raised: list[int] = []

    def out_of_memory_once(module: Any, args: Any) -> None:
        if not raised:
            raised.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    hook = handle.pipe.transformer.register_forward_pre_hook(out_of_memory_once)
    try:
        failed = comfy.run_prompt(graph(models, "wan", seed=72))
    finally:
        hook.remove()

    assert not failed.success and not failed.interrupted and failed.error["node_id"] == GEN
    assert failed.error["exception_type"].endswith("RunOutOfMemory")
    message = failed.error["exception_message"]
    for part in ("Out of memory on cpu running WanPipeline",
                 "Free on cpu when the run started: 3.00 GiB of 12.00 GiB.",
                 "On the device at the error", "  transformer: ", "  vae: ", "  text_encoder: ",
                 "set preload 'off'", "--disable-cuda-malloc", "fewer frames",
                 "torch: CUDA out of memory. Tried to allocate 2.00 GiB"):
        assert part in message, f"{part!r} missing from:\n{message}"
    assert read == ["cpu"]
    after = handle.report()
    assert after.device_bytes == 0 and {c.role for c in after.components} == {"unplaced"}  # nothing left placed
    assert not hook_inventory(handle.pipe, COMPONENTS["wan"], torch_hooks=True)
    comfy.run_prompt(graph(models, "wan", seed=72)).raise_for_error()
    assert dict(captured)[0].shape == (9, 32, 32, 3) and handle.report().device == "cpu"
