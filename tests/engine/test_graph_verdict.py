"""`graph_worth.device_paced` on the clocks measured on the GPU (bench/README.md, runs 53-68): the
models whose graphs gained nothing read device-paced (graphs stand aside), the one they sped up
reads host-paced (graphs stay)."""

from __future__ import annotations

import pytest
from diffusers_offload.offload_core.transport.graph_worth import device_paced

# (eager launch s, device s) of one forward
NO_GAIN = {"FLUX.2 [dev] fp8, its verdict line": (0.316, 0.571), "FLUX.2 [dev] bf16": (0.2844, 0.5568),
           "Z-Image Turbo bf16": (0.0960, 0.1530)}
GAIN = {"Wan-14B image-like, fp8 matmuls (machine 1)": (0.063, 0.063),
        "Wan-14B image-like, fp8 matmuls (machine 2)": (0.076, 0.076)}


@pytest.mark.parametrize("clocks", NO_GAIN.values(), ids=NO_GAIN.keys())
def test_a_forward_its_graphs_could_not_speed_up_is_device_paced(clocks: tuple[float, float]) -> None:
    assert device_paced(*clocks)


@pytest.mark.parametrize("clocks", GAIN.values(), ids=GAIN.keys())
def test_a_forward_whose_launch_is_its_step_is_host_paced(clocks: tuple[float, float]) -> None:
    assert not device_paced(*clocks)
