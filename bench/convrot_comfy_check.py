"""ComfyUI's int8 convrot layers (comfy-kitchen's ``int8_tensorwise`` with ``convrot``) read by the
pack against ComfyUI's own quantized Linear (``comfy.ops.mixed_precision_ops``) loading the same
tensors: for each group size and width, ComfyUI's decoded weight against the pack's rotation back
(`formats.convrot.rotate_back`: bits), and the layer's output against the pack's `RotatingLinear`
(input rotated, weight ``(q·s)`` in bf16) and against the dense decoded weight. ComfyUI quantises
each input row to int8 before its int8 matmul, so its output is not the dense one's bits: the table
gives each one's distance from the float32 product of the original weight. CPU; needs a 2026
ComfyUI tree (int8 convrot, comfy-kitchen). CI's ComfyUI (v0.3.75) has no int8 layers, hence a
script, not a test.

    PYTHONPATH=<comfy-aimdo, comfy-kitchen> python bench/convrot_comfy_check.py --comfy-dir .gpu/comfyui
"""

from __future__ import annotations

import json

import torch
from benchkit import comfy_on_cpu, pack


def main() -> None:
    comfy_on_cpu()
    import comfy.ops
    import torch.nn.functional as F
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout

    pack()
    from diffusers_offload.offload_core.formats.convrot import RotatingLinear, rotate_back

    ops = comfy.ops.mixed_precision_ops({"mixed_ops": True}, torch.bfloat16)
    print("| group | width | decoded weight = ComfyUI's | ours vs float32 | dense vs float32 | ComfyUI vs float32 "
          "| ours vs ComfyUI |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for group, width in ((16, 64), (64, 256), (256, 1024), (256, 5120)):
        torch.manual_seed(group + width)
        w = torch.randn(96, width, dtype=torch.bfloat16) / width**0.5
        q, params = TensorWiseINT8Layout.quantize(w, is_weight=True, per_channel=True, convrot=True,
                                                  convrot_groupsize=group)
        conf = {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": group}
        theirs = ops.Linear(width, 96, bias=False)
        theirs.load_state_dict({"weight": q, "weight_scale": params.scale,
                                "comfy_quant": torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)},
                               strict=False)
        decoded = theirs.weight.dequantize().float()
        same = torch.equal(rotate_back(q.float() * params.scale, group).to(torch.bfloat16).float(), decoded)
        ours = torch.nn.Linear(width, 96, bias=False, dtype=torch.bfloat16)
        ours.weight.data = (q.float() * params.scale).to(torch.bfloat16)
        ours.__class__, ours.convrot_group = RotatingLinear, group
        x = torch.randn(64, width, dtype=torch.bfloat16)
        with torch.no_grad():
            exact = F.linear(x.float(), w.float())
            outs = {"ours": ours(x).float(), "dense": F.linear(x, decoded.to(torch.bfloat16)).float(),
                    "comfy": theirs(x).float()}
        rel = {k: ((v - exact).norm() / exact.norm()).item() for k, v in outs.items()}
        gap = ((outs["ours"] - outs["comfy"]).norm() / outs["comfy"].norm()).item()
        print(f"| {group} | {width} | {same} | {rel['ours']:.2e} | {rel['dense']:.2e} | {rel['comfy']:.2e} | {gap:.2e} |")


if __name__ == "__main__":
    main()
