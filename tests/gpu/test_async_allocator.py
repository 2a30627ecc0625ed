"""ComfyUI's default allocator (``backend:cudaMallocAsync``): a streamed denoiser whose plan changes
runs there as CUDA graphs, equal to the graph-free run, without the allocator's warning about
freeing a graph's allocation; the driver's graph memory is counted and given back, and a launch short
of it is waited for, eagerly, or else a shortage; in a process of its own (the backend is chosen before CUDA starts).
Skipped without CUDA (CI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA device of sm_89 or newer (fp8 matmuls)")


def test_a_streamed_plan_runs_as_graphs_under_cuda_malloc_async() -> None:
    check = Path(__file__).with_name("async_allocator_check.py")
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    done = subprocess.run([sys.executable, "-m", "pytest", str(check), "-q", "-s", "-p", "no:cacheprovider"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=Path(__file__).parents[2])
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-3000:]
    assert "free of a captured allocation" not in said  # a graph frees its own allocations (`graphs._copy_out`)
