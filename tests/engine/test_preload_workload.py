"""Workload key of a block call, and parsing of the preload policy."""

from dataclasses import dataclass

import pytest
import torch
from diffusers_offload.offload_core.preload.fit import GIB, MIB
from diffusers_offload.offload_core.preload.policy import AUTO, OFF, Policy, parse_policy
from diffusers_offload.offload_core.preload.workload import entry_signature, scaled_workload, workload_of


@dataclass
class Inputs:
    hidden: torch.Tensor
    scale: float = 1.0


def test_largest_top_level_tensor():
    assert workload_of((torch.zeros(2, 3), torch.zeros(5)), {"t": torch.zeros(4, 4)}) == 16


def test_one_level_into_containers():
    assert workload_of(([torch.zeros(7)],), {}) == 7
    assert workload_of(((1, torch.zeros(3, 3)),), {}) == 9
    assert workload_of((), {"kw": {"x": torch.zeros(11)}}) == 11
    assert workload_of((Inputs(torch.zeros(2, 6)),), {}) == 12


def test_not_deeper_than_one_level():
    assert workload_of(([[torch.zeros(100)]], torch.zeros(3)), {}) == 3


def test_no_tensor_is_zero():
    assert workload_of((1, "x", None), {"flag": True}) == 0


def test_resolution_changes_the_workload():
    low = workload_of((torch.zeros(1, 1024, 64),), {})
    assert workload_of((torch.zeros(1, 4096, 64),), {}) != low


def test_a_new_entry_scales_the_known_workload_by_the_input_that_grew_most():
    text = torch.zeros(1, 512, 4096)
    image = entry_signature((torch.zeros(1, 16, 1, 64, 64),), {"text": text, "t": torch.zeros(1)})
    video = entry_signature((torch.zeros(1, 16, 21, 60, 104),), {"text": text, "t": torch.zeros(1)})
    assert scaled_workload(video, image, known_workload=1024) == pytest.approx(1024 * 21 * 60 * 104 / 64**2, abs=1)
    assert scaled_workload(image, video, known_workload=32760) == pytest.approx(32760 * 64**2 / (21 * 60 * 104), abs=1)


def test_entries_of_another_structure_give_no_guess():
    one = entry_signature((torch.zeros(1, 16, 64, 64),), {})
    assert scaled_workload(entry_signature((torch.zeros(1, 16, 64, 64), torch.zeros(2)), {}), one, 10) is None
    assert scaled_workload(entry_signature((torch.zeros(16, 64, 64),), {}), one, 10) is None


@pytest.mark.parametrize(
    ("value", "policy"),
    [
        ("auto", AUTO),
        (" OFF ", OFF),
        (12, Policy("fixed", 12 * GIB)),  # a number is GiB
        (0.5, Policy("fixed", GIB // 2)),
        ("12", Policy("fixed", 12 * GIB)),
        ("12.5 GB", Policy("fixed", int(12.5 * GIB))),
        ("800MB", Policy("fixed", 800 * MIB)),
        ("0", Policy("fixed", 0)),
        (OFF, OFF),
    ],
)
def test_parse_policy(value, policy):
    assert parse_policy(value) == policy


@pytest.mark.parametrize("value", ["lots", "12 parsecs", "-3 GB", -1, float("nan"), float("inf"), "nan", "inf"])
def test_parse_policy_rejects_nonsense(value):
    with pytest.raises(ValueError, match="preload"):
        parse_policy(value)
