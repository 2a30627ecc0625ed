"""A random LoRA file for a bench model (lora_bench.py, mapped_check.py): rank ``rank`` on every
attention projection of every Wan block, each delta's RMS a fixed fraction of its weight's."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj")  # add_*: i2v only
DELTA = 0.1  # each layer's delta RMS as a fraction of its weight's RMS


def write_lora(m: torch.nn.Module, rank: int, folder: Path) -> tuple[Path, int]:
    """A random rank-``rank`` LoRA on every attention projection of every block; (path, layers)."""
    gen = torch.Generator().manual_seed(2)
    tensors: dict[str, torch.Tensor] = {}
    for name, mod in m.named_modules():
        parts = name.split(".")
        if not (isinstance(mod, torch.nn.Linear) and parts[0] == "blocks" and len(parts) > 3
                and parts[2] in ("attn1", "attn2") and ".".join(parts[3:]) in PROJECTIONS):
            continue
        out_f, in_f = mod.weight.shape
        rms = mod.weight.detach().float().pow(2).mean().sqrt().item()
        down = torch.randn(rank, in_f, generator=gen) / in_f**0.5  # delta = up @ down: RMS = DELTA * rms
        up = torch.randn(out_f, rank, generator=gen) * (DELTA * rms * (in_f / rank) ** 0.5)
        tensors[f"transformer.{name}.lora_A.weight"] = down.to(torch.bfloat16)
        tensors[f"transformer.{name}.lora_B.weight"] = up.to(torch.bfloat16)
    config = {"transformer.r": rank, "transformer.lora_alpha": rank, "transformer.target_modules": list(PROJECTIONS)}
    path = folder / "pytorch_lora_weights.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "lora_adapter_metadata": json.dumps(config)})
    return path, len(tensors) // 2
