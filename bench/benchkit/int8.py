"""An int8 copy of a bench model, made in memory on the device: each tower block's Linear weight
quantized per row by comfy-kitchen's own ``TensorWiseINT8Layout`` (with ``convrot``: rotated in
groups of 256 first, as Comfy-Org's ``*_int8_convrot`` files are), then marked by the pack's
`fp8.mark_fp8` as a ComfyUI ``int8_tensorwise`` file loads (a convrot Linear rotates its input).

Why not write a file and load it: the loader path is CPU-tested; the bench times the int8 cast, the
input rotation and the transfer of int8 bytes at 14B.
"""

from __future__ import annotations

import torch

STORAGES = ("int8", "int8_convrot", "int8_torchcast")  # _torchcast: plain int8 without the cast kernel
GROUP = 256  # comfy-kitchen's default convrot_groupsize


def to_int8(model: torch.nn.Module, blocks: list[torch.nn.Module], storage: str) -> int:
    """Quantize the blocks' Linear weights in place (``int8_convrot``: convrot where ``GROUP``
    divides the width) and mark the model; returns how many layers rotate their input.
    ``int8_torchcast``: the streamer's int8 units cast by torch, weight by weight (the kernel off)."""
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
    from diffusers_offload.offload_core.formats.fp8 import mark_fp8
    from diffusers_offload.offload_core.transport import fp8_kernel

    convrot = storage == "int8_convrot"
    if storage == "int8_torchcast":
        fp8_kernel.cast_int8_into = lambda *_args: False

    in_blocks = {id(m) for block in blocks for m in block.modules()}
    scales, groups = {}, {}
    for name, layer in model.named_modules():
        if id(layer) not in in_blocks or not isinstance(layer, torch.nn.Linear):
            continue
        rotate = convrot and layer.in_features % GROUP == 0
        q, params = TensorWiseINT8Layout.quantize(layer.weight.data, is_weight=True, per_channel=True,
                                                  convrot=rotate, convrot_groupsize=GROUP)
        layer.weight = torch.nn.Parameter(q, requires_grad=False)
        scales[name] = params.scale.float()
        if rotate:
            groups[name] = GROUP
    mark_fp8(model, torch.bfloat16, scales, source="bench int8", convrot=groups)
    return len(groups)
