"""Every Wan family, tried as a new user would: a tiny folder of each in models/diffusers, loaded by
'Load diffusers pipeline', run by 'Generate video', the frames bit-exact between offload mode
``none`` and the default ``auto`` (and ``auto`` with the tiny parts given real roles: streamed
transformers, leaf text encoder, on-demand VAE, same seed).

Families (issue 24): Wan 2.1 I2V (CLIP image encoder; diffusers' I2V pipeline needs ftfy),
Wan 2.2 TI2V-5B (``expand_timesteps``, 48-channel VAE: text- and image-to-video from one folder,
whichever class it names), Wan 2.2 A14B T2V and I2V (``transformer`` + ``transformer_2`` split at
``boundary_ratio``). Wan 2.1 T2V runs in test_generate.py.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyhost import harness
from comfyhost.capture import capture_class, capture_fixtures
from fixtures.tiny_wan_families import wan_start_image

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]

LOAD, GEN, SETTINGS_NODE = "1", "2", "3"
CAPTURE = "DiffusersOffloadTest_WanCapture"
START_IMAGE = "diffusers_offload_test_wan_start.png"
SIZE, FRAMES = 32, 9  # on every Wan grid: TI2V-5B's is 32 (VAE x16, patch 2), the others' 16
# Offload variants compared: the default auto (tiny parts stay resident under the floor), mode
# none, and auto with every part given its real role (what a big model gets).
MODES: dict[str, dict[str, Any] | None] = {
    "auto": None,
    "none": {"mode": "none"},
    "auto, streamed": {"resident_floor_mb": 0.0, "on_demand_threshold_gb": 0.0},
}
# (family, start image?) -> the pipeline class that runs it.
CASES = {
    ("wan_i2v", True): "WanImageToVideoPipeline",
    ("wan22_ti2v", False): "WanPipeline",
    ("wan22_ti2v", True): "WanImageToVideoPipeline",  # the sibling, with expand_timesteps
    ("wan22_ti2v_i2v_class", True): "WanImageToVideoPipeline",
    ("wan22_ti2v_i2v_class", False): "WanPipeline",  # the sibling, with expand_timesteps
    ("wan22_a14b", False): "WanPipeline",
    ("wan22_a14b_i2v", True): "WanImageToVideoPipeline",
}

Capture = capture_class()


@pytest.fixture(scope="module")
def models(comfy: harness.ComfyHost, tiny_wan_family: Callable[[str], Path]) -> Callable[[str], str]:
    """family -> the loader's name of its tiny folder (built on first use, linked into models/diffusers)."""
    root = Path(comfy.folder_paths.get_folder_paths("diffusers")[0])
    return lambda family: ex.link_model(root, tiny_wan_family(family))


@pytest.fixture(scope="module")
def start_image(comfy: harness.ComfyHost) -> str:
    """A two-colour 32x32 picture in ComfyUI's input folder, for LoadImage."""
    wan_start_image(SIZE).save(Path(comfy.folder_paths.get_input_directory()) / START_IMAGE)
    return START_IMAGE


capture_node, captured = capture_fixtures(CAPTURE, Capture)


def settings(comfy: harness.ComfyHost, **overrides: Any) -> dict[str, Any]:
    """The Offload settings node's inputs: its own defaults (as a fresh node in the UI), then ``overrides``."""
    types = comfy.nodes.NODE_CLASS_MAPPINGS["DiffusersOffloadSettings"].INPUT_TYPES()
    widgets = {**types["required"], **types.get("optional", {})}
    return {name: spec[1]["default"] for name, spec in widgets.items()} | overrides


def graph(comfy: harness.ComfyHost, model: str, image: str | None, offload: dict[str, Any] | None,
          seed: int = 3) -> dict[str, Any]:
    """Load (fp32, with the settings when given) -> Generate video (CFG, 2 steps) -> Capture of
    frames (slot 1) and notes (slot 3); a Placement report of the loaded pipe."""
    prompt: dict[str, Any] = {
        LOAD: {"class_type": "DiffusersOffloadLoadPipeline", "inputs": {"model": model, "dtype": "fp32"}},
        GEN: {"class_type": "DiffusersOffloadGenerateVideo", "inputs": {
            "pipe": [LOAD, 0], "prompt": "a tiny red cat", "negative_prompt": "blurry", "seed": seed, "steps": 2,
            "guidance": 5.0, "width": SIZE, "height": SIZE, "frames": FRAMES, "fps": 0.0}},
        "frames": {"class_type": CAPTURE, "inputs": {"value": [GEN, 1], "slot": 1}},
        "notes": {"class_type": CAPTURE, "inputs": {"value": [GEN, 3], "slot": 3}},
        "report": {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": [LOAD, 0]}},
    }
    if offload is not None:
        prompt[SETTINGS_NODE] = {"class_type": "DiffusersOffloadSettings", "inputs": settings(comfy, **offload)}
        prompt[LOAD]["inputs"]["offload"] = [SETTINGS_NODE, 0]
    if image is not None:
        prompt["img"] = {"class_type": "LoadImage", "inputs": {"image": image}}
        prompt[GEN]["inputs"]["start_image"] = ["img", 0]
    return prompt


def run(comfy: harness.ComfyHost, captured: list[tuple[int, Any]], prompt: dict[str, Any]) -> tuple[Any, str, str]:
    """(frames, notes, report text) of one prompt."""
    captured.clear()
    result = comfy.run_prompt(prompt).raise_for_error()
    seen = dict(captured)
    return seen[1], seen[3], "\n".join(result.outputs["report"]["text"])


@pytest.mark.parametrize(("family", "with_image"), list(CASES), ids=[f"{f}-{'i2v' if i else 't2v'}" for f, i in CASES])
def test_wan_family_runs_bit_exact_between_mode_none_and_auto(
    comfy: harness.ComfyHost, models: Callable[[str], str], start_image: str, captured: list[tuple[int, Any]],
    family: str, with_image: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="diffusers_offload.nodes")
    model = models(family)
    image = start_image if with_image else None

    outs = {name: run(comfy, captured, graph(comfy, model, image, offload)) for name, offload in MODES.items()}

    frames, notes, report = outs["none"]
    assert isinstance(frames, torch.Tensor) and frames.shape == (FRAMES, SIZE, SIZE, 3)
    assert torch.isfinite(frames).all() and notes == ""  # 32 px, 9 frames: on the grid, nothing noted
    for name, (other, _, other_report) in outs.items():
        assert torch.equal(other, frames), f"{family}: {name} differs from mode none"
        assert f", mode {name.split(',')[0]}:" in other_report.splitlines()[0]
    ran = CASES[(family, with_image)]
    loaded = report.split(" on ", 1)[0]
    if ran != loaded:  # the other mode of a TI2V-5B folder: its sibling class, with the folder's flags
        assert f"running {ran} with the components and flags of {loaded}" in caplog.text


def test_a_ti2v_start_image_changes_the_video(
    comfy: harness.ComfyHost, models: Callable[[str], str], start_image: str, captured: list[tuple[int, Any]],
) -> None:
    """Same seed, same folder: with a start image the first latent frame is the image's, so the
    video differs from the text-only one (the sibling really conditions on it)."""
    model = models("wan22_ti2v")
    t2v, _, _ = run(comfy, captured, graph(comfy, model, None, None))
    i2v, _, _ = run(comfy, captured, graph(comfy, model, start_image, None))
    assert not torch.equal(t2v, i2v)


@pytest.mark.parametrize("family", ["wan22_a14b", "wan22_a14b_i2v"])
def test_a14b_report_names_both_denoisers_in_its_preload_line(
    comfy: harness.ComfyHost, models: Callable[[str], str], start_image: str, captured: list[tuple[int, Any]],
    family: str,
) -> None:
    image = start_image if family.endswith("i2v") else None
    _, _, report = run(comfy, captured, graph(comfy, models(family), image, MODES["auto, streamed"]))

    lines = report.splitlines()
    (preload,) = [line for line in lines if line.strip().startswith("preload:")]
    assert preload.strip().startswith("preload: transformer: ") and "; transformer_2: " in preload
    for name in ("transformer", "transformer_2"):
        (line,) = [row for row in lines if row.split()[:1] == [name]]
        assert "blocks kept" in line, line  # both streamed by blocks


def test_guidance_2_guides_a14b_s_second_expert_and_is_noted_ignored_with_one_denoiser(
    comfy: harness.ComfyHost, models: Callable[[str], str], captured: list[tuple[int, Any]],
) -> None:
    """``guidance_2`` is A14B's ``guidance_scale_2`` (its second step runs ``transformer_2``): equal to
    guidance, the frames of 0 (as guidance); another value, other frames. TI2V-5B (one denoiser)
    notes it ignored."""
    def frames_with(family: str, guidance_2: float) -> tuple[torch.Tensor, str]:
        prompt = graph(comfy, models(family), None, None)
        prompt[GEN]["inputs"]["guidance_2"] = guidance_2
        frames, notes, _ = run(comfy, captured, prompt)
        return frames, notes

    same, notes = frames_with("wan22_a14b", 0.0)
    assert notes == ""
    assert torch.equal(frames_with("wan22_a14b", 5.0)[0], same)  # graph()'s guidance is 5.0
    assert not torch.equal(frames_with("wan22_a14b", 1.5)[0], same)
    one, one_notes = frames_with("wan22_ti2v", 1.5)
    assert "WanPipeline has one denoiser: guidance_2 ignored" in one_notes
    assert torch.equal(one, frames_with("wan22_ti2v", 0.0)[0])


def test_high_noise_steps_split_a14b_s_steps_between_its_experts_for_one_call(
    comfy: harness.ComfyHost, tiny_wan_family: Callable[[str], Path],
) -> None:
    """``Call.expert_split``: of 4 steps, the high-noise expert (``transformer``) runs exactly the
    first ``high`` (each step one CFG forward pair), the low-noise one the rest; the folder's
    ``boundary_ratio`` is back after the call; a one-denoiser pipeline notes it ignored."""
    from fixtures.tiny_wan_families import WAN22_CALL, load_wan_family

    calls = comfy.pack_submodule("nodes.call")
    pipe = load_wan_family(tiny_wan_family("wan22_a14b"))
    ran: list[str] = []
    for name in ("transformer", "transformer_2"):
        getattr(pipe, name).register_forward_pre_hook(lambda *_, n=name: ran.append(n))
    for high in (1, 2, 3, 4):
        ran.clear()
        call = calls.Call(pipe)
        with call.expert_split(4, high):
            pipe(**{**WAN22_CALL, "num_inference_steps": 4, "guidance_scale": 1.0})
        assert ran == ["transformer"] * high + ["transformer_2"] * (4 - high), high  # guidance 1: no CFG pass
        assert pipe.config.boundary_ratio == 0.9 and call.notes == []
    one = calls.Call(load_wan_family(tiny_wan_family("wan22_ti2v")))
    with one.expert_split(4, 2):
        pass
    assert one.notes == ["WanPipeline has one denoiser: high_noise_steps ignored"]


def test_a_lora_goes_into_the_expert_its_into_names(
    comfy: harness.ComfyHost, models: Callable[[str], str], captured: list[tuple[int, Any]],
    tiny_wan_family: Callable[[str], Path], tmp_path: Path,
) -> None:
    """Load LoRA's ``into`` on A14B through the nodes: into the high-noise expert, the low-noise
    one, or both, each gives frames of its own (and none is the base's)."""
    import shutil

    from fixtures.tiny_loras import wan_lora
    from fixtures.tiny_wan_families import load_wan_family

    source = wan_lora(load_wan_family(tiny_wan_family("wan22_a14b")).transformer, tmp_path / "lora", seed=5)
    name = "tiny_a14b_expert_lora.safetensors"
    shutil.copyfile(source, Path(comfy.folder_paths.get_folder_paths("loras")[0]) / name)

    def frames(into: str | None) -> torch.Tensor:
        prompt = graph(comfy, models("wan22_a14b"), None, None)
        if into is not None:
            prompt["lora"] = {"class_type": "DiffusersOffloadLoadLora",
                              "inputs": {"pipe": [LOAD, 0], "lora_name": name, "strength": 1.0, "into": into}}
            prompt[GEN]["inputs"]["pipe"] = ["lora", 0]
        return run(comfy, captured, prompt)[0]

    outs = [frames(into) for into in (None, "denoiser", "denoiser_2", "both")]
    assert all(not torch.equal(a, b) for i, a in enumerate(outs) for b in outs[i + 1:])


@pytest.mark.parametrize(
    ("family", "with_image", "message"),
    [
        ("wan_i2v", False, "WanImageToVideoPipeline is image-to-video: connect a start_image"),
        ("wan22_a14b", True, "WanPipeline is text-to-video and takes no start image"),
        ("wan22_a14b_i2v", False, "WanImageToVideoPipeline is image-to-video: connect a start_image"),
    ],
)
def test_a_one_mode_wan_folder_refuses_the_other_mode_by_name(
    comfy: harness.ComfyHost, models: Callable[[str], str], start_image: str, family: str, with_image: bool,
    message: str,
) -> None:
    """Wan 2.1 and A14B transformers take 16 (T2V) or 36 (I2V) channels: no sibling can run them."""
    prompt = graph(comfy, models(family), start_image if with_image else None, None)
    for node in ("frames", "notes", "report"):
        del prompt[node]
    prompt["out"] = {"class_type": "PreviewAny", "inputs": {"source": [GEN, 3]}}

    result = comfy.run_prompt(prompt)

    assert not result.success and result.error["node_id"] == GEN
    assert message in result.error["exception_message"]


def test_the_sibling_carries_the_folders_flags_and_shares_its_components(
    comfy: harness.ComfyHost, tiny_wan_family: Callable[[str], Path],
) -> None:
    """``pipeline_for``: built from ``pipe.components`` alone, a TI2V-5B sibling would have
    ``expand_timesteps=False`` and feed 100 channels (48 noise + 4 mask + 48 image latents) to the
    48-channel transformer; it gets the loaded pipeline's flags instead."""
    from fixtures.tiny_wan_families import load_wan_family

    calls = comfy.pack_submodule("nodes.call")
    image = torch.zeros(1, SIZE, SIZE, 3)
    for family, sibling_class in (("wan22_ti2v", "WanImageToVideoPipeline"),
                                  ("wan22_ti2v_i2v_class", "WanPipeline")):
        pipe = load_wan_family(tiny_wan_family(family))
        sibling = calls.pipeline_for(pipe, None if sibling_class == "WanPipeline" else image)

        assert type(sibling).__name__ == sibling_class
        assert sibling.config["expand_timesteps"] is True and sibling.config["boundary_ratio"] is None
        assert sibling.transformer is pipe.transformer and sibling.vae is pipe.vae
        assert calls.pipeline_for(pipe, image if sibling_class == "WanPipeline" else None) is pipe


def test_a14b_through_the_nodes_shares_one_budget_between_its_denoisers(
    comfy: harness.ComfyHost, models: Callable[[str], str], captured: list[tuple[int, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Generate video on a scripted card on which both denoisers' plans do not fit at once (as
    on a GPU: kept pieces on the device): the starting denoiser takes the idle one's kept blocks
    in one give_back, both keep blocks, run 2 keeps what run 1 kept, frames bit-exact vs none."""
    shared = comfy.pack_submodule("offload_core.preload.shared")
    planner = comfy.pack_submodule("offload_core.preload.planner")
    streamer_cls = comfy.pack_submodule("offload_core.transport.streamer").BlockStreamer
    host = comfy.pack_submodule("nodes.host")
    margin = comfy.pack_submodule("offload_core.preload.fit").margin
    monkeypatch.setattr(planner, "growth_threshold", lambda largest: 0)  # tiny blocks regrow
    monkeypatch.setattr(planner, "process_store", comfy.pack_submodule("offload_core.preload.measures").MeasureStore)
    monkeypatch.setattr(shared, "ROOM_MARGIN", 0)  # 512 MiB would take every tiny block
    monkeypatch.setattr(streamer_cls, "device_bytes", lambda self: self.head_bytes() + self.kept_bytes())
    live: list[Any] = []
    at_end: dict[str, int] = {}  # each denoiser's kept bytes as its last forward of the run ended
    notify = streamer_cls.notify

    def noting(self, event, **info):
        if event == "forward":
            live[:] = [self, *[s for s in live if s is not self]][:2]  # the running one first
        if event == "forward_end" and self in denoisers():
            at_end[str(denoisers().index(self))] = self.kept_bytes()
        return notify(self, event, **info)

    monkeypatch.setattr(streamer_cls, "notify", noting)
    activations = 64 << 10

    def denoisers() -> list[Any]:  # the placed pipeline's two streamers
        return [s.transport for pipe in list(host.ENGINE._pipelines) for n, s in host.ENGINE.states(pipe).items()
                if n in ("transformer", "transformer_2") and isinstance(s.transport, streamer_cls)]

    class Card(host.ComfyMemory):
        def device_free(self, device):
            placed = denoisers()
            whole = max((sum(p.nbytes for p in s.pieces) for s in placed), default=0)
            capacity = sum(s.head_bytes() for s in placed) + activations + margin(activations) + whole * 3 // 2
            return (capacity - self.allocated(device), 0)

        def allocated(self, device):
            return sum(s.device_bytes() for s in denoisers())

        def peak_allocated(self, device):
            return self.allocated(device) - live[0].device_bytes() + live[0].weights_at_peak() + activations

        def allocator_retries(self, device):
            return 0

    takes: list[tuple[int, int, int]] = []
    take = shared.SharedBudget.take_idle

    def counted(self, running, need, why):
        idle = [m for _n, m in self.idle(running)]
        calls = []
        for member in idle:
            monkeypatch.setattr(member, "give_back", lambda n, m=member, real=member.give_back: calls.append(n) or real(n))
        freed = take(self, running, need, why)
        takes.append((need, freed, len(calls)))
        return freed

    monkeypatch.setattr(shared.SharedBudget, "take_idle", counted)
    model = models("wan22_a14b")
    expected = [run(comfy, captured, graph(comfy, model, None, {"mode": "none"}, seed=s))[0] for s in (5, 6)]
    monkeypatch.setattr(host.ENGINE, "memory", Card())
    kept = []
    for seed, frames_none in zip((5, 6), expected, strict=True):
        takes.clear()
        at_end.clear()
        frames, _, _ = run(comfy, captured, graph(comfy, model, None, MODES["auto, streamed"], seed=seed))
        assert torch.equal(frames, frames_none)
        needed = [t for t in takes if t[0] > 0]
        assert needed and all(freed >= need and calls == 1 for need, freed, calls in needed), takes
        assert len(at_end) == 2 and all(at_end.values()), at_end  # both denoisers kept blocks
        kept.append(dict(at_end))
    assert kept[1] == kept[0]
