"""When the engine turns PyTorch's expandable segments on: only for the native allocator, and
never over a choice the user made in the allocator configuration (the effect on fragmentation is
measured on the GPU: see bench/README.md)."""

import pytest
import torch
from diffusers_offload.offload_core import memory
from diffusers_offload.offload_core.memory import prefer_expandable_segments, wants_expandable_segments


@pytest.mark.parametrize(("conf", "backend", "wanted"), [
    ("", "native", True),
    ("max_split_size_mb:128", "native", True),
    ("expandable_segments:False", "native", False),
    ("garbage_collection_threshold:0.8,expandable_segments:True", "native", False),
    ("backend:cudaMallocAsync", "cudaMallocAsync", False),
])
def test_expandable_segments_are_wanted_only_where_nobody_chose(conf, backend, wanted):
    assert wants_expandable_segments(conf, backend) is wanted


def test_a_cpu_placement_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.setattr(memory, "_expandable_turned_on", False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    prefer_expandable_segments(torch.device("cpu"))
    assert memory._expandable_turned_on is False
