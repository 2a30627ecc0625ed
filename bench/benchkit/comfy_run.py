"""What the ComfyUI-side benches (comfy_coexist.py, wan22_node.py, single_file_node.py,
image_pipeline_node.py) do alike with a booted host: build their files in a process of their own,
check the tree, check the pack's nodes loaded, queue a prompt and report its error, whether
DynamicVRAM is on. No torch import here (ComfyUI's start-up must import it first)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any


def offline() -> None:
    """No hub access and no bytecode files, unless the caller's environment says otherwise."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONDONTWRITEBYTECODE"):
        os.environ.setdefault(key, "1")


def rerun_json(flag: str, prefix: str) -> dict[str, Any]:
    """Run this script again with ``flag`` (a process of its own: its allocations and RNG never touch
    this one) and read the JSON of its last ``prefix`` line; stop with its output if it failed."""
    res = subprocess.run([sys.executable, str(Path(sys.argv[0]).resolve()), flag, *sys.argv[1:]],
                         stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(prefix + " ")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"{flag} failed (rc={res.returncode}):\n{res.stdout[-4000:]}")
    return json.loads(lines[-1][len(prefix) + 1:])


def comfy_tree(path: str) -> Path:
    """The ComfyUI tree at ``path``, refused by name when it has no ``main.py``."""
    tree = Path(path).resolve()
    if not (tree / "main.py").is_file():
        raise SystemExit(f"no ComfyUI tree at {tree} (set --comfy-dir or COMFYUI_PATH)")
    return tree


def require_nodes(host: Any, *node_ids: str) -> None:
    """Stop with ComfyUI's last start-up lines when the pack did not register ``node_ids``."""
    status = host.pack_status()
    missing = [n for n in node_ids if n not in status.node_ids]
    if missing:
        print("\n".join(host.init_log[-40:]))
        raise SystemExit(f"our pack did not load ({', '.join(missing)} missing): {status}")


def queue(host: Any, prompt: dict[str, Any], outputs: list[str], label: str) -> str | None:
    """Run ``prompt`` through ComfyUI's executor up to ``outputs``; None, or the error in one line
    (printed with its traceback under ``label``)."""
    try:
        result = host.run_prompt(prompt, outputs)
    except Exception as exc:  # report, do not hide
        traceback.print_exc()
        return f"{type(exc).__name__}: {str(exc)[:400]}"
    if result.success:
        return None
    e = result.error or {}
    err = f"{e.get('node_type')}: {e.get('exception_type')}: {str(e.get('exception_message'))[:400]}"
    print(f"[{label}] FAILED {err}\n{''.join(e.get('traceback', []))[-3000:]}", flush=True)
    return err


def aimdo_enabled() -> bool:
    """Whether ComfyUI's DynamicVRAM is on (the 2026 tree's switch; absent from v0.3.75)."""
    try:
        import comfy.memory_management
    except ImportError:
        return False
    return bool(getattr(comfy.memory_management, "aimdo_enabled", False))
