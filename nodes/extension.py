"""The pack's V3 extension: every node class, and the web view connected to the host.

The wiring lives here so that data flows one way: ``host.py`` announces patcher events to
whoever subscribed, ``web_api.py`` reports what it is handed, and neither imports the other.
"""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from . import generate, h3, host, loaders, lora, report, settings, single_file, web_api
from .inputs import ship_template_inputs


def connect_web_view() -> None:
    """Feed the page: the engine's report as its source, the patcher events as its triggers, and
    the state route (at import, since v0.3.x never calls ``on_load``, and on load for later
    servers; idempotent, a no-op without a server or once the app is running)."""
    web_api.connect(host.ENGINE.report)
    host.subscribe("web_view", loaded=web_api.loaded, changed=web_api.changed, finished=web_api.finished)
    web_api.register_routes()


connect_web_view()
ship_template_inputs()  # the templates' keyframes, where LoadImage finds them


class DiffusersOffloadExtension(ComfyExtension):
    async def on_load(self) -> None:
        web_api.register_routes()

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [*loaders.NODES, *generate.NODES, *h3.NODES, *lora.NODES, *settings.NODES, *report.NODES,
                *single_file.NODES]
