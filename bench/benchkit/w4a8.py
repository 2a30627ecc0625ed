"""A W4A8 copy of a bench model, made in memory on the device: each tower block's Linear becomes the
pack's `W4A8Linear` over weights quantized by comfy-kitchen's own ``quantize_w4a8_int8_weight``
(fp8 group scales, group 16, ConvRot 256), as a ComfyUI ``asym_w4a8_int8`` file loads.

Why not write a file and load it: the loader path is CPU-tested; the bench times the layer's
kernels and the transfer of its packed bytes at 14B.
"""

from __future__ import annotations

import torch

STORAGE = "w4a8"
CONF = dict(group_size=16, convrot_groupsize=256)


def to_w4a8(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> int:
    """Replace the blocks' Linear layers (input widths ConvRot divides) in place; returns how many."""
    from comfy_kitchen.tensor.w4a8_int8 import quantize_w4a8_int8_weight
    from diffusers_offload.offload_core.formats.w4a8 import W4A8Conf, W4A8Linear

    conf = W4A8Conf(**CONF)
    count = 0
    for block in blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear) or child.in_features % conf.convrot_groupsize:
                    continue
                qdata, s_rel, s_channel, _corr, codebook = quantize_w4a8_int8_weight(child.weight.data, **CONF)
                layer = W4A8Linear(child.in_features, child.out_features, child.bias is not None, conf,
                                   codebook=codebook is not None, compute=child.weight.dtype, device="meta")
                layer.weight = torch.nn.Parameter(qdata, requires_grad=False)
                layer.weight_s_rel, layer.weight_s_channel = s_rel, s_channel  # buffers
                if codebook is not None:
                    layer.weight_codebook = codebook
                if child.bias is not None:
                    layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                parent._modules[name] = layer
                count += 1
    return count
