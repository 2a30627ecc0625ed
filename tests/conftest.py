"""Test bootstrap: import the pack under a stable package name without putting the repo root on
sys.path (its ``nodes/`` would shadow ComfyUI's top-level ``nodes`` module)."""

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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

pytest_plugins = ["fixtures.tiny_pipes"]
