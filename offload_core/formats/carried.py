"""Configs the pack carries (configs-only copies of the Wan-AI diffusers folders of Wan 2.1 / 2.2,
of FLUX.1 dev / schnell, FLUX.2 [klein] 4B / 9B (distilled and base) and [dev], LTX-2 19B dev / distilled,
Z-Image Turbo, Qwen-Image and MiniMax-H3's modular folder, written by
``tools/write_carried_configs.py``), so a user holding only ComfyUI single files needs no diffusers
folder: the classic one whose transformer fits the denoiser file's shape is picked. They hold no
tokenizer: Wan's, LTX-2's and FLUX.2 [dev]'s come from the text-encoder file (Comfy-Org's UMT5, Gemma 3
and Mistral files carry theirs, which is what ComfyUI's own tokenizers read), FLUX.1's, FLUX.2
[klein]'s, Z-Image's, Qwen-Image's and H3's from the folders ComfyUI ships them in (a folder's ``tokenizers.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..log import get_logger
from .denoiser_shapes import FILE_READERS, config_shape, file_shape
from .file_tokenizers import tokenizer_from_file
from .inspect import SingleFileError, SingleFileInfo, inspect_file

log = get_logger("single_file")

ROOT = Path(__file__).with_name("carried_configs")
MODULAR_INDEX = "modular_model_index.json"
SHIPPED = "tokenizers.json"  # a carried folder's tokenizers that ComfyUI ships: name -> {"comfyui": subfolder, kwargs}
FAMILIES = "Wan 2.1 / 2.2, FLUX.1, FLUX.2, LTX-2, Z-Image Turbo, Qwen-Image and Qwen-Image-Edit"
# What tells variants of one shape apart, in their folders' and files' names.
NAME_WORDS = ("distilled", "base", "kontext", "2509", "edit")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def carried(root: Path | None = None, index: str = "model_index.json") -> list[Path]:
    """The config folders the pack carries (under ``root``, the pack's by default), by name: the
    classic pipelines' (``model_index.json``), or with ``index`` the modular ones'."""
    root = Path(root or ROOT)
    return sorted(p for p in root.iterdir() if (p / index).is_file()) if root.is_dir() else []


def carried_modular(root: Path | None = None) -> list[Path]:
    """The modular pipeline folders the pack carries (MiniMax-H3's)."""
    return carried(root, MODULAR_INDEX)


def by_name(name: str) -> Path:
    """The carried config folder called ``name``."""
    folders = [*carried(), *carried_modular()]
    found = [p for p in folders if p.name == name]
    if not found:
        raise SingleFileError(f"the pack carries no config folder {name!r}: it carries "
                              f"{', '.join(p.name for p in folders)}")
    return found[0]


def pick(denoiser: Path, two_experts: bool, root: Path | None = None) -> Path:
    """The carried config folder (under ``root``, the pack's by default) that fits ``denoiser`` (see `choose`)."""
    if not Path(denoiser).is_file():
        raise SingleFileError(f"{denoiser} does not exist: pick a file from models/diffusion_models")
    chosen = choose(inspect_file(Path(denoiser)), two_experts, carried(root))
    log.info("%s: the pack's %s configs", Path(denoiser).name, chosen.name)
    return chosen


def choose(info: SingleFileInfo, two_experts: bool, folders: list[Path]) -> Path:
    """The one of ``folders`` whose transformer has the shape of the denoiser ``info`` describes and
    which has a second expert exactly when ``two_experts`` (Wan 2.2 A14B); a file of another family,
    or of no carried shape, is refused saying what it is."""
    if info.family not in FILE_READERS:
        raise SingleFileError(f"{info.path} looks like {info.looks_like}: the pack carries configs for {FAMILIES} "
                              "only; pick a diffusers config folder of its family (models/diffusers)")
    shape = file_shape(info)
    fits = [f for f in folders if config_shape(f / "transformer", info.family) == shape]
    chosen = _by_name(info.path, [f for f in fits if (f / "transformer_2").is_dir() == two_experts])
    if not chosen:
        hint = ("; Wan 2.2 A14B: its high-noise file goes in denoiser, its low-noise one in denoiser_2"
                if fits and not two_experts else "; leave denoiser_2 at 'none'" if fits else "")
        second = " with a second expert" if two_experts else ""
        raise SingleFileError(f"{info.path} is a {info.family} denoiser of {shape}{second}: none of the configs the "
                              f"pack carries ({', '.join(f.name for f in folders)}) fits it{hint}; else pick a "
                              "diffusers config folder of its model")
    return chosen[0]


def _by_name(path: Path, folders: list[Path]) -> list[Path]:
    """Of folders of one shape, those whose name has each of `NAME_WORDS` exactly when the file's
    does (LTX-2's dev and distilled models, FLUX.2 [klein]'s distilled and base ones, FLUX.1-dev and
    Kontext, Qwen-Image and its Edit and Edit-2509 models share every shape; diffusers' own
    conversions tell the first two by the file name, and BFL's and Comfy-Org's files are named so)."""
    name = Path(path).name.lower()
    for word in NAME_WORDS:
        if any(word in f.name.lower() for f in folders):
            folders = [f for f in folders if (word in f.name.lower()) == (word in name)] or folders
    return folders


def missing_tokenizers(folder: Path, index: dict, files: dict[str, Path | None],
                       comfy_tokenizers: Path | None) -> dict[str, Any]:
    """The tokenizers config ``folder`` lacks (the carried folders hold none), by component name:
    each from the folder ComfyUI ships it in where the folder's ``tokenizers.json`` names one (under
    ``comfy_tokenizers``, ComfyUI's ``comfy`` package folder), else read from the sentencepiece model
    its text-encoder file carries (`file_tokenizers`; ``tokenizer_2`` from ``text_encoder_2``); and a
    ``processor`` whose folder holds its image configs but no tokenizer, around ``tokenizer``."""
    shipped = _shipped_entries(folder)
    out: dict[str, Any] = {}
    for name, spec in index.items():
        if not name.startswith("tokenizer") or not (isinstance(spec, list) and all(spec)) or (folder / name).is_dir():
            continue
        if name in shipped:
            out[name] = shipped_tokenizer(folder, name, str(spec[1]), comfy_tokenizers)
            continue
        encoder = files.get(name.replace("tokenizer", "text_encoder"))
        if encoder is None:
            raise SingleFileError(f"the config folder {folder} has no {name}: pick the text-encoder file, whose "
                                  "tokenizer the pack reads")
        out[name] = tokenizer_from_file(Path(encoder), str(spec[1]), f"the config folder {folder}")
    spec, configs = index.get("processor"), folder / "processor"
    tokenizer_held = any((configs / f).is_file() for f in TOKENIZER_FILES)
    if isinstance(spec, list) and all(spec) and configs.is_dir() and not tokenizer_held:
        if "tokenizer" not in out:
            raise SingleFileError(f"the config folder {folder} has a processor without a tokenizer and no tokenizer "
                                  "to build it around: use a diffusers config folder with a tokenizer")
        out["processor"] = processor_around(configs, str(spec[1]), out["tokenizer"])
    return out


def processor_around(configs: Path, cls_name: str, tokenizer: Any) -> Any:
    """A vision-language processor (class ``cls_name``) around ``tokenizer``, its image and video
    processors from the ``configs`` folder (a carried folder's ``processor``: configs, no tokenizer)."""
    import transformers

    try:
        processor = getattr(transformers, cls_name)(
            image_processor=transformers.AutoImageProcessor.from_pretrained(str(configs)),
            video_processor=transformers.AutoVideoProcessor.from_pretrained(str(configs)), tokenizer=tokenizer)
    except Exception as exc:  # a damaged carried folder: name it
        raise SingleFileError(f"{configs}: the image / video processor configs could not be read as {cls_name} "
                              f"({type(exc).__name__}: {exc})") from exc
    log.info("%s: %s around the tokenizer (%d tokens)", configs.parent.name, cls_name, len(tokenizer))
    return processor


def _shipped_entries(folder: Path) -> dict[str, dict]:
    return json.loads((folder / SHIPPED).read_text(encoding="utf-8")) if (folder / SHIPPED).is_file() else {}


def shipped_tokenizer(folder: Path, name: str, cls_name: str, comfy_tokenizers: Path | None) -> Any:
    """Config ``folder``'s tokenizer ``name`` (class ``cls_name``) from the folder ComfyUI ships it in,
    as its ``tokenizers.json`` says (the ``comfyui`` subfolder of ``comfy_tokenizers``, ComfyUI's
    ``comfy`` package folder, and the options to load it with)."""
    import transformers

    entry = dict(_shipped_entries(folder)[name])
    source = Path(comfy_tokenizers or "") / entry.pop("comfyui")
    if comfy_tokenizers is None or not source.is_dir():
        raise SingleFileError(f"the config folder {folder} takes its {name} from ComfyUI's {source.name} folder, which "
                              f"{'was not given' if comfy_tokenizers is None else f'is not at {source}'}: use a "
                              "diffusers config folder with a tokenizer")
    vocabulary = set(getattr(getattr(transformers, cls_name, None), "vocab_files_names", {}).values())
    if vocabulary and not any((source / name).is_file() for name in vocabulary):  # transformers would read it as empty
        raise SingleFileError(f"ComfyUI's tokenizer {source} holds none of its vocabulary files "
                              f"({', '.join(sorted(vocabulary))}; it holds {sorted(p.name for p in source.iterdir())}): "
                              "reinstall ComfyUI's tokenizer files or use a diffusers config folder with a tokenizer")
    try:
        tokenizer = getattr(transformers, cls_name).from_pretrained(str(source), **entry)
    except Exception as exc:
        raise SingleFileError(f"ComfyUI's tokenizer {source} could not be read as {cls_name} ({type(exc).__name__}: "
                              f"{exc}): use a diffusers config folder with a tokenizer") from exc
    log.info("%s: %s from ComfyUI's %s", folder.name, name, source)
    return tokenizer
