"""Test bootstrap: import the pack under a stable package name without putting the repo root on
sys.path (its ``nodes/`` would shadow ComfyUI's top-level ``nodes`` module)."""

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# MKL's strict reproducibility, read when MKL first runs: without it, a CPU matmul can round
# differently for a weight at an 8-byte file offset (safetensors' zero-copy load) than for the same
# bytes in the engine's aligned buffers, and "bit-exact against unplaced" would test the CPU's
# kernels, not the engine (seen on an AMD EPYC runner: Flux's norm linears, 2.4e-7).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

ROOT = Path(__file__).resolve().parents[1]
PKG = "diffusers_offload"

if PKG not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        PKG, ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[PKG] = _mod
    _spec.loader.exec_module(_mod)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ only: fixtures, harness

pytest_plugins = ["fixtures.tiny_pipes", "fixtures.edit_areas"]
