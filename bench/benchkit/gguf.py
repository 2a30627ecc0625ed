"""GGUF-quantized copies of a bench model, made in memory on the device: each tower block's Linear
becomes diffusers' ``GGUFLinear`` over a ``GGUFParameter`` of packed blocks, as
``from_single_file`` with ``GGUFQuantizationConfig`` loads a community file.

Why not write a file and load it: quantizing a 14B model with the ``gguf`` package's numpy code
takes far longer than a GPU call allows. Q8_0 is quantized for real (per-32 fp16 scale, int8
codes); Q4_K blocks are random codes with finite fp16 scales (the gguf package cannot make
K-quants; the bench times their dequantisation and transfer, and compares streamed outputs with
the resident GGUF model's, not with bf16).
"""

from __future__ import annotations

import torch

QTYPES = ("gguf_q8_0", "gguf_q4_k", "gguf_q8_0_torch", "gguf_q4_k_torch")  # _torch: the pack's kernel off


def _q8_0(w: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    blocks = w.float().reshape(rows, cols // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(d > 0, blocks / d, torch.zeros_like(blocks)).round().clamp(-127, 127).to(torch.int8)
    packed = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return packed.reshape(rows, cols // 32 * 34)


def _q4_k(w: torch.Tensor) -> torch.Tensor:
    rows, cols = w.shape
    g = torch.Generator(device=w.device).manual_seed(0)
    packed = torch.randint(0, 256, (rows, cols // 256, 144), generator=g, dtype=torch.uint8, device=w.device)
    scales = torch.full((rows, cols // 256, 2), 2.0**-10, dtype=torch.float16, device=w.device)  # d, dmin
    packed[..., :4] = scales.view(torch.uint8)
    return packed.reshape(rows, cols // 256 * 144)


def to_gguf(model: torch.nn.Module, blocks: list[torch.nn.Module], storage: str) -> int:
    """Replace the blocks' Linear layers (widths the quant type divides) in place; returns how many.
    ``*_torch``: the same with the pack's GGUF kernel switched off (the side-by-side anchor)."""
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter
    from gguf import GGMLQuantizationType

    if storage.endswith("_torch"):  # diffusers' own dequantisation, as without the pack's GGUF kernel
        from diffusers_offload.offload_core.transport import gguf_kernel

        gguf_kernel.dequantized = lambda *_args: None
    qtype, pack, width = {"gguf_q8_0": (GGMLQuantizationType.Q8_0, _q8_0, 32),
                          "gguf_q4_k": (GGMLQuantizationType.Q4_K, _q4_k, 256)}[storage.removesuffix("_torch")]
    count = 0
    for block in blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                if not isinstance(child, torch.nn.Linear) or child.in_features % width:
                    continue
                layer = GGUFLinear(child.in_features, child.out_features, child.bias is not None,
                                   compute_dtype=child.weight.dtype, device="meta")
                layer.weight = GGUFParameter(pack(child.weight.data), quant_type=qtype)
                if child.bias is not None:
                    layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                layer.requires_grad_(False)
                parent._modules[name] = layer
                count += 1
    return count
