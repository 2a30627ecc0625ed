"""The pack's V3 extension: every node class, gathered from the node files' ``NODES`` lists."""

from __future__ import annotations

import importlib
from pathlib import Path

from comfy_api.latest import ComfyExtension, io

from . import h3, loaders, lora, report, settings, web_api

# The page's state route: at import (v0.3.x never calls on_load) and on load (later servers);
# idempotent, and a no-op without a server or once the app is running.
web_api.register_routes()


class DiffusersOffloadExtension(ComfyExtension):
    async def on_load(self) -> None:
        web_api.register_routes()

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [*loaders.NODES, *h3.NODES, *lora.NODES, *settings.NODES, *report.NODES, *_generate_nodes()]


def _generate_nodes() -> list[type[io.ComfyNode]]:
    """The Generate nodes live in ``generate.py`` (written alongside); listed once the file exists.
    Only its presence is checked: a generate.py that fails to import must fail loudly."""
    if not Path(__file__).with_name("generate.py").is_file():
        return []
    return importlib.import_module(".generate", __package__).NODES
