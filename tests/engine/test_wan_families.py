"""The tiny Wan family folders (issue 24) under the engine: each family's placed output equals its
unplaced output (same seed), A14B runs and streams both denoisers, and the facts the nodes rely on
(ftfy declared; a TI2V-5B sibling needs the folder's flags) hold for the real diffusers code."""

from pathlib import Path

import pytest
import tomllib
import torch
from diffusers import WanImageToVideoPipeline
from diffusers_offload.offload_core import Engine, OffloadConfig
from fixtures.tiny_pipes import WAN_FAMILY_BUILDERS, load_wan_family, run_wan_family

ROOT = Path(__file__).resolve().parents[2]
STREAMED = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, device="cpu")  # tiny parts get real roles


@pytest.fixture
def load(tiny_wan_family):
    return lambda family: load_wan_family(tiny_wan_family(family))


def test_ftfy_is_declared_and_installed():
    """diffusers' WanImageToVideoPipeline calls ``ftfy.fix_text`` without the availability guard
    its text-to-video pipeline has: without ftfy every Wan I2V prompt fails with a NameError."""
    import ftfy  # noqa: F401

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "ftfy" in [d.split(";")[0].split(">")[0].split("=")[0].strip() for d in dependencies]
    assert "ftfy" in (ROOT / "requirements.txt").read_text().split()


@pytest.mark.parametrize("family", list(WAN_FAMILY_BUILDERS))
def test_placed_output_matches_unplaced_and_after_release(family, load):
    pipe = load(family)
    expected = run_wan_family(pipe)
    assert expected.shape == (1, 9, 3, 32, 32) and torch.isfinite(expected).all()
    engine = Engine()

    report = engine.place(pipe, STREAMED)
    placed = run_wan_family(pipe)
    engine.after_run(pipe)
    engine.release(pipe)

    assert torch.equal(placed, expected)
    assert torch.equal(run_wan_family(pipe), expected)
    assert report.component("transformer").details.get("blocks") == 2  # really streamed, by blocks


def test_wan21_i2v_image_encoder_is_placed_as_an_image_encoder(load):
    pipe = load("wan_i2v")
    engine = Engine()
    report = engine.place(pipe, STREAMED)
    engine.release(pipe)
    # the label (a CLIP vision model is no text encoder); the pin verdict follows it: this host
    # grants, and the tiny encoder's layers are under half of its bytes
    assert report.component("image_encoder").reason == "image encoder: pin granted, its layers under half of it: leaf groups"


@pytest.mark.parametrize("family", ["wan22_a14b", "wan22_a14b_i2v"])
def test_a14b_runs_and_streams_both_denoisers(family, load):
    """Step 1 (t=999) is above the boundary (0.9 x 1000): ``transformer``; step 2 below it:
    ``transformer_2``; each twice (CFG)."""
    pipe = load(family)
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    engine = Engine()

    report = engine.place(pipe, STREAMED)
    run_wan_family(pipe)
    engine.after_run(pipe)
    engine.release(pipe)

    assert calls == {"transformer": 2, "transformer_2": 2}
    assert all(report.component(name).details.get("blocks") == 2 for name in calls)
    assert report.plan.startswith("transformer: ") and "; transformer_2: " in report.plan


def test_ti2v_image_to_video_needs_the_folders_flags_not_only_its_components(load):
    """The bug behind the nodes' sibling construction: ``WanImageToVideoPipeline(**pipe.components)``
    has ``expand_timesteps=False``, so it concatenates noise, mask and image latents (48 + 4 + 48)
    for a 48-channel transformer; with the folder's flag it runs."""
    pipe = load("wan22_ti2v")
    components = {k: v for k, v in pipe.components.items() if k != "transformer_2"}

    with pytest.raises(RuntimeError, match="expected input.* to have 48 channels, but got 100 channels"):
        run_wan_family(WanImageToVideoPipeline(**components))
    sibling = WanImageToVideoPipeline(**components, expand_timesteps=pipe.config["expand_timesteps"])
    sibling.set_progress_bar_config(disable=True)
    assert run_wan_family(sibling).shape == (1, 9, 3, 32, 32)
