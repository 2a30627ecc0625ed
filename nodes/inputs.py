"""The templates' input files (the MiniMax-H3 keyframes) copied into ComfyUI's input folder, so a
template opens without missing files. A file of the same name already there is never
overwritten: it may be the user's."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import folder_paths

log = logging.getLogger("diffusers_offload.nodes")

SHIPPED = Path(__file__).resolve().parent.parent / "example_workflows" / "input"


def ship_template_inputs(shipped: Path = SHIPPED) -> list[str]:
    """Copy each shipped input missing from ComfyUI's input folder; returns the names copied."""
    target = Path(folder_paths.get_input_directory())
    copied = []
    for source in sorted(p for p in shipped.glob("*") if p.is_file()):
        if not (target / source.name).exists():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target / source.name)
            copied.append(source.name)
    if copied:
        log.info("copied the templates' inputs %s into %s", ", ".join(copied), target)
    return copied
