"""The pack's V3 extension: every node class, gathered from the node files' ``NODES`` lists."""

from __future__ import annotations

import importlib
from pathlib import Path

from comfy_api.latest import ComfyExtension, io

from . import loaders, report, settings


class DiffusersOffloadExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [*loaders.NODES, *settings.NODES, *report.NODES, *_generate_nodes()]


def _generate_nodes() -> list[type[io.ComfyNode]]:
    """The Generate nodes live in ``generate.py`` (written alongside); listed once the file exists.
    Only its presence is checked: a generate.py that fails to import must fail loudly."""
    if not Path(__file__).with_name("generate.py").is_file():
        return []
    return importlib.import_module(".generate", __package__).NODES
