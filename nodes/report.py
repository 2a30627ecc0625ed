"""Placement report: where every component of a pipeline lives, as text on the node and a STRING."""

from __future__ import annotations

from comfy_api.latest import io, ui

from .types import CATEGORY, DiffusersPipe, PipeHandle
from .web_api import search_aliases


class PlacementReportNode(io.ComfyNode):
    """Places the pipeline as a run would (a no-op when already placed) and shows the stats block."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadReport",
            **search_aliases("offload"),
            display_name="Placement report",
            category=CATEGORY,
            description="Shows each component's role, size, dtype and where its weights are.",
            inputs=[DiffusersPipe.Input("pipe")],
            outputs=[io.String.Output(display_name="report")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **inputs: object) -> float:
        """Never cached: placement changes between runs (preload, ComfyUI taking memory back)."""
        return float("nan")

    @classmethod
    def execute(cls, pipe: PipeHandle) -> io.NodeOutput:
        text = pipe.prepare().text()
        return io.NodeOutput(text, ui=ui.PreviewText(text))


NODES: list[type[io.ComfyNode]] = [PlacementReportNode]
