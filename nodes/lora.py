"""Load LoRA: adds a LoRA file from models/loras to a pipeline handle, without touching the weights.

Why a view and not a patch: ComfyUI caches node outputs and may feed one loaded pipeline to several
branches. The node returns a new handle carrying the LoRA set; the set is made effective when that
branch runs (``PipeHandle.prepare``), so a branch without the LoRA still gets the base output.
The file is read and matched here already, so a wrong file fails on this node, by name.
"""

from __future__ import annotations

import folder_paths
from comfy_api.latest import io

from ..offload_core.lora import INTO, LoraSpec, check
from .types import CATEGORY, DiffusersPipe, PipeHandle


class LoadLora(io.ComfyNode):
    """A LoRA for a diffusers pipeline; chain several to stack them (their deltas add up)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="DiffusersOffloadLoadLora",
            display_name="Load LoRA (diffusers)",
            category=CATEGORY,
            description="Applies a LoRA (diffusers/peft, kohya or ComfyUI keys) to a diffusers pipeline under "
                        "offload. Chain several to stack them; other branches of the same pipeline are unaffected.",
            inputs=[
                DiffusersPipe.Input("pipe"),
                io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras"),
                               tooltip="A .safetensors file in models/loras (or an extra_model_paths location)."),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01,
                               tooltip="Multiplies the LoRA's delta; 0 leaves the model unchanged."),
                io.Combo.Input("into", options=list(INTO), default="denoiser", optional=True,
                               tooltip="The denoiser it goes into: Wan 2.2 A14B's LoRAs come in pairs, the "
                                       "high-noise one into denoiser, the low-noise one into denoiser_2 "
                                       "(transformer_2); both: the same LoRA into each."),
            ],
            outputs=[DiffusersPipe.Output(display_name="pipe")],
        )

    @classmethod
    def execute(cls, pipe: PipeHandle, lora_name: str, strength: float, into: str = "denoiser") -> io.NodeOutput:
        spec = LoraSpec(folder_paths.get_full_path_or_raise("loras", lora_name), float(strength), into)
        check(pipe.pipe, spec)
        return io.NodeOutput(pipe.with_lora(spec))


NODES: list[type[io.ComfyNode]] = [LoadLora]
