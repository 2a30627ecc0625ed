"""The model files a loader node offers from ComfyUI's folders: denoiser files (diffusion_models,
which covers unet, unet_gguf where a GGUF pack registered it, and checkpoints, where all-in-one
files such as LTX-2's hold a denoiser beside its VAE and others) and text-encoder files
(text_encoders, and clip_gguf where registered), each plus the ``.gguf`` files plain ComfyUI does
not list, listed and resolved through ``folder_paths`` so that ``extra_model_paths.yaml`` works."""

from __future__ import annotations

import os
from pathlib import Path

import folder_paths

from ..offload_core.formats.inspect import SingleFileError

NONE = "none"
PACK = "pack: "  # a config folder the pack carries, by name
DENOISER_FOLDERS = ("diffusion_models", "unet_gguf", "checkpoints")  # checkpoints: all-in-one files (LTX-2's)
TEXT_ENCODER_FOLDERS = ("text_encoders", "clip_gguf")


def _registered(name: str) -> bool:
    return name in getattr(folder_paths, "folder_names_and_paths", {})


def denoiser_files() -> list[str]:
    """Files in diffusion_models (which covers unet), unet_gguf where a GGUF pack registered it and
    checkpoints, plus the ``.gguf`` files of diffusion_models, which plain ComfyUI does not list."""
    return _listed(DENOISER_FOLDERS)


def text_encoder_files() -> list[str]:
    """Files in text_encoders (which covers clip) and clip_gguf where registered, plus the ``.gguf``
    files of text_encoders (T5 / UMT5 encoders in llama.cpp's layout)."""
    return _listed(TEXT_ENCODER_FOLDERS)


def _listed(folders: tuple[str, ...]) -> list[str]:
    names: set[str] = set(_gguf_files(folders[0]))
    for folder in folders:
        if _registered(folder):
            names.update(folder_paths.get_filename_list(folder))
    return sorted(names)


def _gguf_files(folder: str) -> dict[str, str]:
    """name -> path of the ``.gguf`` files under ``folder``'s paths (read-only listing: ComfyUI's
    own folder table is left as it is)."""
    found: dict[str, str] = {}
    for root in folder_paths.get_folder_paths(folder) if _registered(folder) else ():
        files, _dirs = folder_paths.recursive_search(root, excluded_dir_names=[".git"])
        for name in folder_paths.filter_files_extensions(files, {".gguf"}):
            found.setdefault(name, os.path.join(root, name))
    return found


def full_path(folders: tuple[str, ...], name: str) -> str:
    for folder in folders:
        if _registered(folder):
            path = folder_paths.get_full_path(folder, name)
            if path:
                return path
    gguf = _gguf_files(folders[0])
    if name in gguf:
        return gguf[name]
    raise SingleFileError(f"no file {name!r} in ComfyUI's {' / '.join(folders)} folders: put it there (or in an "
                          "extra_model_paths.yaml location) and refresh")


def optional(folders: tuple[str, ...], name: str) -> str | None:
    return None if name == NONE else full_path(folders, name)


def comfy_package() -> Path:
    """The folder of ComfyUI's ``comfy`` package, where it ships its tokenizers (not
    ``folder_paths.base_path``, which ``--base-directory`` moves)."""
    import comfy.sd1_clip

    return Path(comfy.sd1_clip.__file__).resolve().parent
