"""Stored-layer copies of a bench model, made in memory on the device: each tower block's Linear
becomes one of the pack's stored layers over weights quantized by comfy-kitchen's own quantizers,
as a ComfyUI file loads: ``w4a8`` (`W4A8Linear`, ``quantize_w4a8_int8_weight``: fp8 group scales,
group 16, ConvRot 256), ``w4a4`` (`W4A4Linear`, ``quantize_convrot_w4a4_weight``: ConvRot 256, int4
MMA), ``nvfp4`` (`NVFP4Linear`, ``TensorCoreNVFP4Layout.quantize``) or ``mxfp8`` (`MXFP8Linear`,
``TensorCoreMXFP8Layout.quantize``).

Why not write a file and load it: the loader path is CPU-tested; the bench times the layers'
kernels and the transfer of their packed bytes at 14B.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

W4A8, W4A4, NVFP4, MXFP8 = "w4a8", "w4a4", "nvfp4", "mxfp8"
STORAGES = (W4A8, W4A4, NVFP4, MXFP8)
CONF = dict(group_size=16, convrot_groupsize=256)


def _w4a8(child: torch.nn.Linear) -> torch.nn.Module | None:
    from comfy_kitchen.tensor.w4a8_int8 import quantize_w4a8_int8_weight
    from diffusers_offload.offload_core.formats.w4a8 import W4A8Conf, W4A8Linear

    if child.in_features % CONF["convrot_groupsize"]:
        return None
    qdata, s_rel, s_channel, _corr, codebook = quantize_w4a8_int8_weight(child.weight.data, **CONF)
    layer = W4A8Linear(child.in_features, child.out_features, child.bias is not None, W4A8Conf(**CONF),
                       codebook=codebook is not None, compute=child.weight.dtype, device="meta")
    layer.weight = torch.nn.Parameter(qdata, requires_grad=False)
    layer.weight_s_rel, layer.weight_s_channel = s_rel, s_channel  # buffers
    if codebook is not None:
        layer.weight_codebook = codebook
    return layer


def _nvfp4(child: torch.nn.Linear) -> torch.nn.Module:
    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout
    from diffusers_offload.offload_core.formats.nvfp4 import NVFP4Linear

    packed, params = TensorCoreNVFP4Layout.quantize(child.weight.data)
    layer = NVFP4Linear(child.in_features, child.out_features, child.bias is not None, child.weight.dtype, None,
                        device="meta")
    layer.weight = torch.nn.Parameter(packed, requires_grad=False)
    layer.weight_scale, layer.weight_scale_2 = params.block_scale, params.scale.reshape(())  # buffers
    return layer


def _w4a4(child: torch.nn.Linear) -> torch.nn.Module | None:
    from comfy_kitchen.tensor.convrot_w4a4 import quantize_convrot_w4a4_weight
    from diffusers_offload.offload_core.formats.w4a4 import GROUP, W4A4Conf, W4A4Linear

    conf = W4A4Conf(convrot_groupsize=CONF["convrot_groupsize"])
    if child.in_features % conf.convrot_groupsize or child.in_features % GROUP:
        return None
    qdata, scale = quantize_convrot_w4a4_weight(child.weight.data, conf.convrot_groupsize, GROUP)
    layer = W4A4Linear(child.in_features, child.out_features, child.bias is not None, conf, child.weight.dtype,
                       device="meta")
    layer.weight = torch.nn.Parameter(qdata, requires_grad=False)
    layer.weight_scale = scale.float()  # a buffer
    return layer


def _mxfp8(child: torch.nn.Linear) -> torch.nn.Module:
    from comfy_kitchen.tensor.mxfp8 import TensorCoreMXFP8Layout
    from diffusers_offload.offload_core.formats.mxfp8 import MXFP8Linear

    weight, params = TensorCoreMXFP8Layout.quantize(child.weight.data)
    layer = MXFP8Linear(child.in_features, child.out_features, child.bias is not None, child.weight.dtype,
                        device="meta")
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = params.scale  # a buffer
    return layer


MAKERS: dict[str, Callable[[torch.nn.Linear], torch.nn.Module | None]] = {W4A8: _w4a8, W4A4: _w4a4, NVFP4: _nvfp4,
                                                                          MXFP8: _mxfp8}


def to_stored(model: torch.nn.Module, blocks: list[torch.nn.Module], storage: str) -> int:
    """Replace the blocks' Linear layers in place by ``storage`` layers (W4A8: those of input widths
    ConvRot divides); returns how many."""
    count = 0
    for block in blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                layer = MAKERS[storage](child) if isinstance(child, torch.nn.Linear) else None
                if layer is None:
                    continue
                if child.bias is not None:
                    layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                parent._modules[name] = layer
                count += 1
    return count
