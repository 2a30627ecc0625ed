"""ComfyUI's key layouts of transformers text encoders (the names of its own model classes), as
transformers' names, so that ComfyUI's text-encoder files load into transformers' classes.

Gemma 3 (LTX-2's text encoder; ComfyUI's ``comfy/text_encoders/llama.py`` ``Gemma3_12B``):
``model.*`` is the language model, ``vision_model.*`` and ``multi_modal_projector.*`` the image
path, no ``lm_head`` (tied to the embeddings). A file may lack the image path: LTX-2 passes text
only, so the encoder is then built without it (``None`` where transformers' module was).

Qwen2.5-VL (Qwen-Image's text encoder; ComfyUI's ``Qwen25_7BVLI``, its ``qwen_2.5_vl_7b`` files):
``model.*`` is the language model, ``visual.*`` the vision tower (which a text-to-image run never
calls; a file may lack it), ``lm_head`` as transformers names it.

Qwen3 (Z-Image's and FLUX.2 [klein]'s text encoder, a ``Qwen3Model``; ComfyUI's ``qwen_3_4b`` /
``qwen_3_8b`` files): ``model.*`` is the whole model, which transformers names without the prefix (its
loader drops it, but a file holding stored layers is assigned to a model built empty, so the names
must be the model's own); the 8B file's ``lm_head`` is left out (those pipelines read hidden states).
Mistral Small 3.1's language model (FLUX.2 [dev]'s text encoder, a ``MistralModel``; ComfyUI's
``mistral_3_small_flux2`` files, ``Mistral3Small24B``) is laid out the same way; ComfyUI's pruned
ones stop after the 30 layers FLUX.2 reads, without the final norm: the model is built to the file's
depth, an identity for the norm (it only norms the last hidden state, which is then read unnormed, as
the whole model's hidden state 30 is).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Layout:
    """ComfyUI's prefixes -> transformers', and transformers' modules a file of it may lack."""

    prefixes: tuple[tuple[str, str], ...]
    optional: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()  # ComfyUI's key prefixes the model has no place for (left out)
    trimmed: bool = False  # a file may stop early (fewer layers, no final norm): the model is built to its depth
    sign: str = "model.layers."  # a key prefix only ComfyUI's layout has


LAYOUTS = {
    "Gemma3ForConditionalGeneration": Layout(
        prefixes=(("model.", "model.language_model."), ("vision_model.", "model.vision_tower."),
                  ("multi_modal_projector.", "model.multi_modal_projector.")),
        optional=("model.vision_tower.", "model.multi_modal_projector."),
    ),
    "Qwen2_5_VLForConditionalGeneration": Layout(
        prefixes=(("model.", "model.language_model."), ("visual.", "model.visual.")), optional=("model.visual.",),
    ),
    "Qwen3Model": Layout(prefixes=(("model.", ""),), unused=("lm_head.",)),
    "MistralModel": Layout(prefixes=(("model.", ""),), unused=("lm_head.",), trimmed=True),
}


def comfy_layout(cls_name: str, keys: list[str]) -> Layout | None:
    """The ComfyUI layout of ``cls_name`` when ``keys`` are in it, else None."""
    layout = LAYOUTS.get(cls_name)
    return layout if layout is not None and any(k.startswith(layout.sign) for k in keys) else None


def renamer(layout: Layout) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    def rename(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {next((new + k[len(old):] for old, new in layout.prefixes if k.startswith(old)), k): v
                for k, v in state.items() if not k.startswith(layout.unused)}

    return rename


def fitted(layout: Layout, keys: list[str]) -> Callable[[Any], Any]:
    """The config a file of ``keys`` fits: a trimmed layout's at the file's depth."""
    depth = len({k.split(".")[2] for k in keys if k.startswith(layout.sign)})

    def config(settings: Any) -> Any:
        if layout.trimmed and 0 < depth < settings.num_hidden_layers:
            settings.num_hidden_layers = depth
            if getattr(settings, "layer_types", None):
                settings.layer_types = settings.layer_types[:depth]
        return settings

    return config


def comfy_key(layout: Layout, key: str) -> str:
    """A transformers key under ComfyUI's name (the layout's renaming undone; a prefix the layout
    drops is not put back)."""
    return next((old + key[len(new):] for old, new in layout.prefixes if new and key.startswith(new)), key)


def drop_absent(model: torch.nn.Module, layout: Layout) -> list[str]:
    """The optional modules the file did not fill (still on the meta device), set to None, and a
    trimmed layout's missing final norm set to an identity; their names."""
    dropped = []
    if layout.trimmed and any(p.is_meta for p in model.norm.parameters()):
        model.norm = torch.nn.Identity()
        dropped.append("norm")
    for prefix in layout.optional:
        name = prefix.rstrip(".")
        module = model.get_submodule(name)
        if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, None)
            dropped.append(name)
    return dropped
