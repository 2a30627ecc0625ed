"""Model folders: list them, resolve a listed name, and check a folder before diffusers reads it.

A folder is checked before diffusers reads it (index, component folders, weight files, every
safetensors header against the file's size, the files a tokenizer or processor reads), so a broken
download fails with the file to fix instead of a deep loader traceback, a crash mid-load or, for a
tokenizer without its vocabulary, prompts silently turned into unknown tokens. Files are only read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from . import host

INDEX = "model_index.json"
MODULAR_INDEX = "modular_model_index.json"
MAX_DEPTH = 4  # deep enough for org/name/snapshot layouts, shallow enough to never crawl a disk
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
TOKENIZER_CONFIG = "tokenizer_config.json"
PROCESSOR_CONFIGS = ("processor_config.json", "preprocessor_config.json")


class PipelineFolderError(ValueError):
    """A model folder diffusers cannot load; the message names the file and what to do."""


# -- listing --------------------------------------------------------------------------------
def list_models() -> list[str]:
    """Folders (relative to each diffusers root) holding a pipeline index, classic or modular."""
    names: set[str] = set()
    for root in host.diffusers_roots():
        names.update(p.relative_to(root).as_posix() for p in _model_folders(Path(root)))
    return sorted(names)


def _model_folders(root: Path) -> Iterator[Path]:
    if not root.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        here = Path(dirpath)
        if here != root and (INDEX in filenames or MODULAR_INDEX in filenames):
            dirnames.clear()  # a model's component folders are not models
            yield here
        elif len(here.relative_to(root).parts) >= MAX_DEPTH:
            dirnames.clear()
        else:
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]


def resolve_model(name: str) -> Path:
    """The folder a listed name stands for, in the first diffusers root that has it."""
    roots = host.diffusers_roots()
    if not Path(name).is_absolute() and ".." not in Path(name).parts:  # v0.3 does not check combo values
        for root in roots:
            folder = Path(root) / name
            if folder.is_dir() and folder != Path(root):
                return folder
    raise PipelineFolderError(
        f"no model folder {name!r} under {', '.join(roots)}: put the pipeline folder (the one holding "
        f"{INDEX}) in models/diffusers and refresh"
    )


# -- checks ------------------------------------------------------------------------------------
def check_pipeline_folder(folder: Path) -> None:
    """Validate a classic pipeline folder before diffusers reads any of it."""
    index_file = folder / INDEX
    if not index_file.is_file():
        if (folder / MODULAR_INDEX).is_file():
            raise PipelineFolderError(
                f"{folder} is a modular diffusers pipeline ({MODULAR_INDEX}): load it with the modular "
                "pipeline loader; this node loads classic pipelines (model_index.json)"
            )
        raise PipelineFolderError(f"{folder} is not a diffusers model folder: it has no {INDEX}")
    for name, library, cls in _components(_read_index(index_file)):
        check_component(folder / name, name, f"{library}.{cls}")


def _read_index(path: Path) -> dict:
    index = read_json(path)
    if not isinstance(index.get("_class_name"), str):
        raise PipelineFolderError(f"{path} is not a diffusers pipeline index (no \"_class_name\"): point "
                                  "the loader at the folder of a pipeline saved with save_pretrained")
    return index


def _components(index: dict) -> Iterator[tuple[str, str, str]]:
    """(name, library, class) of every component the index declares (``[null, null]`` = absent)."""
    for name, spec in index.items():
        if not name.startswith("_") and isinstance(spec, list) and len(spec) == 2 and all(spec):
            yield name, str(spec[0]), str(spec[1])


def check_component(folder: Path, name: str, what: str) -> None:
    if not folder.is_dir():
        raise PipelineFolderError(f"component {name!r} ({what}) is missing: {folder} does not exist; copy "
                                  "that folder from the original model or download the model again")
    files = sorted(p for p in folder.iterdir() if p.is_file())
    if (folder / "config.json").is_file() and not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise PipelineFolderError(f"component {name!r} ({what}) has no weights file in {folder} (*.safetensors "
                                  "or *.bin): the download is incomplete; download the model again")
    for index_file in (p for p in files if p.name.endswith(".index.json")):
        _check_shards(index_file)
    for weights in (p for p in files if p.suffix == ".safetensors"):
        check_safetensors(weights)
    _check_text_files(folder, name, what)


# -- tokenizers and processors ------------------------------------------------------------------
def _check_text_files(folder: Path, name: str, what: str) -> None:
    """A tokenizer needs one of the vocabulary files its class reads (transformers otherwise builds
    an empty one and every prompt becomes unknown tokens); a processor needs its config, and its
    tokenizer's files."""
    import transformers as tf

    cls = _transformers_class(what.rsplit(".", 1)[-1])
    if cls is None:
        return
    if cls is tf.AutoProcessor or issubclass(cls, tf.ProcessorMixin):
        parts = ["tokenizer"] if cls is tf.AutoProcessor else cls.get_attributes()
        if any("tokenizer" not in p for p in parts) and not _has_any(folder, PROCESSOR_CONFIGS):
            raise PipelineFolderError(_missing(name, what, folder, "processor config", PROCESSOR_CONFIGS))
        if "tokenizer" in parts:
            _check_tokenizer(folder, name, what, None)
    elif cls is tf.AutoTokenizer or issubclass(cls, tf.PreTrainedTokenizerBase):
        _check_tokenizer(folder, name, what, cls)
    elif issubclass(cls, (tf.ImageProcessingMixin, tf.FeatureExtractionMixin)) and not _has_any(
            folder, PROCESSOR_CONFIGS):
        raise PipelineFolderError(_missing(name, what, folder, "processor config", PROCESSOR_CONFIGS))


def _check_tokenizer(folder: Path, name: str, what: str, cls: type | None) -> None:
    """At least one file that the index's class or the folder's ``tokenizer_class`` loads from."""
    import transformers as tf

    classes = [cls] if cls is not None and cls is not tf.AutoTokenizer else []
    if (folder / TOKENIZER_CONFIG).is_file():
        configured = read_json(folder / TOKENIZER_CONFIG).get("tokenizer_class")
        classes.append(_transformers_class(configured) if isinstance(configured, str) else None)
    files: dict[str, None] = {}
    for c in [c for c in classes if c is not None] or [tf.PreTrainedTokenizerFast]:
        files.update(dict.fromkeys(f for f in getattr(c, "vocab_files_names", {}).values() if f != TOKENIZER_CONFIG))
    if files and not _has_any(folder, tuple(files)):
        raise PipelineFolderError(_missing(name, what, folder, "tokenizer file", tuple(files),
                                           "without one every prompt would become unknown tokens"))


def _transformers_class(name: str) -> type | None:
    """A transformers class by name; None when there is none (or its backend is not installed)."""
    import transformers

    try:
        cls = getattr(transformers, name, None)
    except Exception:  # a class whose backend is missing raises on access
        return None
    return cls if isinstance(cls, type) else None


def _has_any(folder: Path, names: tuple[str, ...]) -> bool:
    return any((folder / n).is_file() and (folder / n).stat().st_size > 0 for n in names)


def _missing(name: str, what: str, folder: Path, kind: str, files: tuple[str, ...], why: str = "") -> str:
    return (f"component {name!r} ({what}) has no {kind} in {folder}: it needs one of {', '.join(files)} "
            f"(non-empty){'; ' + why if why else ''}; copy that folder from the original model or download "
            "the model again")


def _check_shards(index_file: Path) -> None:
    weight_map = read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict):
        raise PipelineFolderError(f"{index_file} has no weight_map: restore it or download the model again")
    for shard in sorted(set(weight_map.values())):
        if not (index_file.parent / shard).is_file():
            raise PipelineFolderError(f"{index_file.parent / shard} is missing (listed in {index_file.name}): "
                                      "the download is incomplete; download that file again")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PipelineFolderError(f"{path} cannot be read as JSON ({exc}): the download is incomplete or "
                                  "the file was edited; restore it or download the model again") from exc
    if not isinstance(data, dict):
        raise PipelineFolderError(f"{path} is not a JSON object: restore it or download the model again")
    return data


def check_safetensors(path: Path) -> None:
    """The header must parse and describe exactly the bytes the file holds (truncated copies and
    interrupted downloads fail here, by name, instead of inside the loader)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or not 0 < length <= min(size - 8, MAX_HEADER):
            raise PipelineFolderError(_damaged(path, f"its {size} bytes cannot hold the header it announces"))
        try:
            header = json.loads(f.read(length))
            ends = (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__")
            end = max(ends, default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise PipelineFolderError(_damaged(path, f"its header is not valid ({exc})")) from exc
    if 8 + length + end != size:
        described = 8 + length + end
        raise PipelineFolderError(_damaged(path, f"its header describes {described} bytes, the file has {size}"))


def _damaged(path: Path, why: str) -> str:
    return f"{path} is truncated or corrupt: {why}; download this file again"


def list_modular_models() -> list[str]:
    """Listed model folders that hold a modular index."""
    return [name for name in list_models() if (resolve_model(name) / MODULAR_INDEX).is_file()]
