"""The pipeline around a ComfyUI single-file denoiser: a diffusers config folder of its family
supplies the pipeline class and the other components, which come from the folder or from the
user's text-encoder and VAE files (fp8 and int8 text encoders keep their storage).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch

from ..log import get_logger
from .carried import missing_tokenizers
from .checkpoint_parts import load_part, parts_in
from .convrot import GROUP_KEY
from .decoded import decoded_weight
from .fp8 import INT8, is_fp8, mark_fp8, popped
from .gguf_text_encoder import load_gguf_text_encoder
from .inspect import SingleFileError, SingleFileInfo, inspect_safetensors
from .quant_entries import check_quant_layers, convrot_groups, stored_kinds
from .single_file import (
    INPUT_KEY,
    SCALE_KEY,
    from_single_file,
    load_denoiser,
    model_class,
    read_checkpoint,
    short_dtype,
)
from .stored_linear import StoredKind, StoredLinear, stored_keys, swap_stored, whole
from .text_encoder_layouts import comfy_layout, drop_absent, fitted, renamer
from .vae_layouts import own_loader

log = get_logger("single_file")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")
FILE_KINDS = {"text_encoder": "text-encoder file", "text_encoder_2": "second text-encoder file", "vae": "VAE file",
              "transformer_2": "second denoiser file (Wan 2.2 A14B's low-noise expert)",
              "image_encoder": "image-encoder file (CLIP vision, e.g. clip_vision_h)"}
ROLES = {"image_encoder": "image_encoder"}  # the role a component's file must have, where not a text encoder's


def load_pipeline_with_denoiser(config_folder: Path, denoiser_file: Path, dtype: torch.dtype,
                                text_encoder_file: Path | None = None, vae_file: Path | None = None,
                                text_encoder_2_file: Path | None = None, denoiser_2_file: Path | None = None,
                                image_encoder_file: Path | None = None, comfy_tokenizers: Path | None = None) -> Any:
    """The pipeline of ``config_folder`` (a diffusers folder of the denoiser's family, or one the
    pack carries; a configs-only one is enough when the text-encoder and VAE files are given: Flux's
    T5 is ``text_encoder_2``) with the denoiser from ``denoiser_file``, computing in ``dtype``; Wan
    2.2 A14B's second denoiser (``transformer_2``, the low-noise expert) from ``denoiser_2_file``;
    Wan 2.1 I2V's CLIP vision encoder from ``image_encoder_file``; the tokenizers the folder lacks
    from ComfyUI's ``comfy_tokenizers`` folder or the text-encoder files (`carried.missing_tokenizers`)."""
    folder = Path(config_folder)
    index = _read_index(folder)
    if "transformer" not in index:
        raise SingleFileError(f"{folder} has no transformer component: single-file denoisers load into "
                              "transformer pipelines (Wan, Flux, LTX-2, ...); pick such a config folder")
    files = {"text_encoder": text_encoder_file, "text_encoder_2": text_encoder_2_file, "vae": vae_file,
             "transformer_2": denoiser_2_file, "image_encoder": image_encoder_file}
    components = dict(_model_components(folder, index))
    extra = [n for n, f in files.items() if f is not None and n not in components]
    if extra:
        raise SingleFileError(f"{index['_class_name']} ({folder}) has no {extra[0]}: leave its "
                              f"{FILE_KINDS[extra[0]]} at 'none'")
    parts: dict[str, Any] = {}
    held = _Held(Path(denoiser_file))
    for name, cls_name in components.items():
        if name == "transformer":
            continue
        chosen = files.get(name)
        if chosen is not None:
            parts[name] = _load_part(name, Path(chosen), folder, cls_name, dtype)
        elif name in held:  # the checkpoint's own, over the folder's
            parts[name] = held.load(name, folder, _component_class(*index[name]), dtype)
        elif not _has_weights(folder / name):
            kind = FILE_KINDS.get(name)
            pick = f"pick {_a(kind)} for it" if kind else "use a diffusers folder that has them"
            raise SingleFileError(f"the config folder {folder} has no weights for {name} ({cls_name}): {pick}")
    parts.update(missing_tokenizers(folder, index, files, comfy_tokenizers))
    _check_vision(index, parts.get("text_encoder"), text_encoder_file)
    parts["transformer"] = load_denoiser(Path(denoiser_file), folder, dtype)
    _check_experts(denoiser_file, denoiser_2_file)
    try:
        pipe = _assemble(folder, index, parts, dtype)
    except Exception as exc:
        raise SingleFileError(f"diffusers could not build the pipeline of {folder} around {denoiser_file}: "
                              f"{type(exc).__name__}: {exc}") from exc
    log.info("%s built from %s with the denoiser %s%s", type(pipe).__name__, folder, Path(denoiser_file).name,
             "".join(f", {n} {Path(f).name}" for n, f in files.items() if f is not None))
    return pipe


class _Held:
    """The other components an all-in-one checkpoint holds beside its denoiser (`checkpoint_parts`),
    its tensors read once, when the first of them loads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.info = inspect_safetensors(path) if path.suffix.lower() == ".safetensors" and path.is_file() else None
        self.names = parts_in(self.info) if self.info is not None else []
        self._tensors: dict[str, torch.Tensor] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def load(self, name: str, folder: Path, cls: type, dtype: torch.dtype) -> Any:
        if self._tensors is None:
            self._tensors = read_checkpoint(self.path, self.info)
        return load_part(name, self._tensors, self.info, folder, cls, dtype)


def _check_experts(denoiser_file: Path, denoiser_2_file: Path | None) -> None:
    """Wan 2.2 A14B's files name their expert (``high_noise`` / ``HighNoise``): the high-noise one
    runs the first steps as ``transformer``. Picked the other way round, the video is wrong with
    no error, so say it (names are only a hint: warned, not refused)."""
    if denoiser_2_file is None:
        return
    noise = [_noise_in_name(Path(f)) for f in (denoiser_file, denoiser_2_file)]
    if noise == ["low", "high"]:
        log.warning("the denoiser %s looks like Wan 2.2 A14B's low-noise expert and the second denoiser %s like "
                    "its high-noise one: the high-noise file goes in denoiser (it runs the first steps)",
                    Path(denoiser_file).name, Path(denoiser_2_file).name)


def _noise_in_name(path: Path) -> str | None:
    name = path.stem.lower().replace("-", "_")
    found = [kind for kind in ("high", "low") if f"{kind}_noise" in name or f"{kind}noise" in name]
    return found[0] if len(found) == 1 else None


def _assemble(folder: Path, index: dict, parts: dict[str, Any], dtype: torch.dtype) -> Any:
    """The index's pipeline class built from ``parts`` and the folder's other components, each
    loaded as `DiffusionPipeline.from_pretrained` would. Why not that call itself: diffusers 0.42.1
    reloads a passed component the pipeline declares optional (Wan's ``transformer``) from the
    folder and drops the passed one."""
    pipeline_class = getattr(diffusers, index["_class_name"], None)
    if not isinstance(pipeline_class, type):
        raise SingleFileError(f"{folder}: pipeline class {index['_class_name']!r} is not in this diffusers version")
    expected, optional = diffusers.DiffusionPipeline._get_signature_keys(pipeline_class)
    kwargs: dict[str, Any] = {}
    for name, spec in index.items():
        if name.startswith("_") or name not in (*expected, *optional):
            continue
        if name in parts:
            kwargs[name] = parts[name]
        elif isinstance(spec, list) and len(spec) == 2:
            if not all(spec):
                kwargs[name] = None
                continue
            cls = _component_class(str(spec[0]), str(spec[1]))
            weights = issubclass(cls, torch.nn.Module)
            dtype_kw = {} if not weights else {"torch_dtype" if issubclass(cls, diffusers.ModelMixin) else "dtype": dtype}
            kwargs[name] = cls.from_pretrained(str(folder / name), local_files_only=True, **dtype_kw)
        else:
            kwargs[name] = spec
    pipe = pipeline_class(**kwargs)
    pipe.register_to_config(_name_or_path=str(folder))
    return pipe


def _component_class(library: str, name: str) -> type:
    """An index entry's class as diffusers resolves it: a library named like a diffusers pipeline
    module (LTX-2's ``ltx2`` connectors and vocoder) is that module."""
    import importlib

    from diffusers import pipelines

    module = getattr(pipelines, library) if hasattr(pipelines, library) else importlib.import_module(library)
    return getattr(module, name)


def _check_vision(index: dict, text_encoder: Any, path: Path | None) -> None:
    """A pipeline with a processor (Qwen-Image-Edit) reads its reference images through the text
    encoder's vision tower: a text-encoder file without one (a text-only or GGUF Qwen2.5-VL) is
    refused by name here, not at the first run."""
    model = getattr(text_encoder, "model", None)
    if "processor" not in index or not hasattr(model, "visual") or model.visual is not None:
        return
    raise SingleFileError(f"{path} holds no vision tower (visual.*), through which {index['_class_name']} reads "
                          "its reference images: pick a text-encoder file with it (ComfyUI's qwen_2.5_vl_7b "
                          "safetensors files hold it; a GGUF one keeps it in a separate mmproj file)")


def _read_index(folder: Path) -> dict:
    path = folder / "model_index.json"
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SingleFileError(f"{folder} is not a diffusers config folder: {path} cannot be read ({exc})") from exc
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise SingleFileError(f"{path} is not a diffusers pipeline index (no _class_name)")
    return index


def _model_components(folder: Path, index: dict) -> list[tuple[str, str]]:
    """(name, class) of the index's components that hold weights (a folder with a config.json)."""
    return [(name, str(spec[1])) for name, spec in index.items()
            if not name.startswith("_") and isinstance(spec, list) and len(spec) == 2 and all(spec)
            and (folder / name / "config.json").is_file()]


def _has_weights(folder: Path) -> bool:
    return folder.is_dir() and any(p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir())


@dataclass(frozen=True)
class Fit:
    """How a text-encoder file meets a config it does not match as stored (MiniMax-H3's, in ComfyUI's
    layout and fewer layers): its keys renamed, the config changed, and the modules it may lack
    (``absent`` key prefixes, left empty for the caller to fill)."""

    keys: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    config: Callable[[Any], Any]
    absent: tuple[str, ...] = ()


def _load_part(name: str, path: Path, folder: Path, cls_name: str, dtype: torch.dtype) -> Any:
    """A text encoder, VAE or second denoiser from its single file, into the class and config of ``folder/name``."""
    if name == "transformer_2":
        return load_denoiser(path, folder, dtype, subfolder=name)
    if name != "vae":
        return load_text_encoder(path, folder / name, cls_name, dtype, kind=FILE_KINDS.get(name, name),
                                 role=ROLES.get(name, "text_encoder"))
    return load_vae(path, folder, dtype)


def load_vae(path: Path, folder: Path, dtype: torch.dtype) -> Any:
    """A VAE from its single file into the class and config of ``folder/vae``: through diffusers'
    single-file conversion, or from a Wan 2.2 VAE's original layout, and as Qwen-Image's or FLUX.2's VAE
    (`vae_layouts`: diffusers' cannot)."""
    cls = model_class(folder / "vae", "vae")
    info = _inspected(Path(path), "vae", FILE_KINDS["vae"], cls.__name__)
    own = own_loader(cls, info.shapes)
    if own is not None:
        return own(Path(path), cls, folder / "vae", dtype)
    return from_single_file(path, folder, "vae", cls, torch_dtype=dtype)


def load_text_encoder(path: Path, config: Path, cls_name: str, dtype: torch.dtype, fit: Fit | None = None,
                      kind: str = "text-encoder file", role: str = "text_encoder") -> Any:
    """A transformers text encoder (or, ``role`` "image_encoder", a CLIP vision encoder) of class
    ``cls_name`` from its single file, into the config in ``config`` (see `_load_text_encoder`; a
    T5 GGUF file: `gguf_text_encoder`), the file first checked to have that role."""
    if path.suffix.lower() == ".gguf" and fit is None and role == "text_encoder":
        return load_gguf_text_encoder(path, config, cls_name, dtype)
    info = _inspected(path, role, kind, cls_name)
    layout = comfy_layout(cls_name, list(info.shapes)) if fit is None else None
    if layout is None:
        return _load_text_encoder(path, info, config, cls_name, dtype, fit)
    fit = Fit(keys=renamer(layout), config=fitted(layout, list(info.shapes)),
              absent=(*layout.optional, *(("norm.",) if layout.trimmed else ())))
    model = _load_text_encoder(path, info, config, cls_name, dtype, fit)
    dropped = drop_absent(model, layout)
    log.info("%s: %s in ComfyUI's layout%s", path.name, cls_name,
             f" without {', '.join(dropped)}" if dropped else "")
    return model


def _inspected(path: Path, role: str, kind: str, cls_name: str) -> SingleFileInfo:
    if not path.is_file():
        raise SingleFileError(f"{path} does not exist: pick {_a(kind)} from ComfyUI's folders")
    info = inspect_safetensors(path)
    if info.role != role and not (role == "vae" and info.role == "unknown"):
        raise SingleFileError(f"{path} looks like {info.looks_like}, not {_a(kind)} ({cls_name})")
    return info


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _load_text_encoder(path: Path, info: SingleFileInfo, config: Path, cls_name: str, dtype: torch.dtype,
                       fit: Fit | None = None) -> Any:
    """A transformers text encoder from a single file in its own key names. Its fp8 Linear weights
    (scaled or not) keep their storage (`fp8.mark_fp8`: dequantised at compute as ComfyUI does,
    half the RAM and pinned bytes of a decoded copy), and so do ComfyUI int8_tensorwise layers,
    convrot ones included, in a file without fp8 weights outside its stored layers (in one with,
    they are decoded to ``dtype`` here, as comfy-kitchen decodes them); W4A8, ConvRot W4A4, NVFP4
    and MXFP8 layers stay as stored (`stored_linear`: decoded, a 62 GB Qwen3-VL would not fit the
    RAM its W4A8 file was chosen for); other quant formats are refused by name."""
    import transformers

    cls = getattr(transformers, cls_name, None)
    if not isinstance(cls, type):
        raise SingleFileError(f"{config}: text encoder class {cls_name!r} is not in this transformers version")
    check_quant_layers(info)
    state = read_checkpoint(path, info)
    kinds = stored_kinds(info)
    for kind in kinds:  # (under the names the layers hold; a text encoder splits nothing)
        extras = kind.pop(path, state)
        kind.attach(state, extras, whole(extras))
    state |= {layer + GROUP_KEY: torch.tensor(g) for layer, g in convrot_groups(info).items()}
    if fit is not None:
        state = fit.keys(state)  # (renames the convrot marks and stored layers' scales with their layers)
    groups = {layer: int(g) for layer, g in popped(state, GROUP_KEY).items()}
    held = set().union(*(stored_keys(kind.layers(state), kind.TENSORS) for kind in kinds))  # stored layers' keys
    popped(state, INPUT_KEY)  # (no fp8 matmuls in text encoders)
    scales = {}  # stored weights' scales, by layer
    keep_int8 = not any(is_fp8(t) for k, t in state.items() if k not in held)  # (one storage dtype per model)
    for layer, scale in popped(state, SCALE_KEY).items():
        weight = state[layer + ".weight"]
        if is_fp8(weight) or (weight.dtype == INT8 and keep_int8):
            scales[layer] = scale
        else:
            state[layer + ".weight"] = decoded_weight(path, layer, weight, scale, dtype, groups.pop(layer, 0))
    if held or fit is not None or any(is_fp8(t) or t.dtype == INT8 for t in state.values()):
        return _built_empty(path, info, cls, config, state, kinds, dtype, fit, scales, groups)
    try:
        model, report = cls.from_pretrained(None, config=cls.config_class.from_pretrained(str(config)),
                                            state_dict=state, dtype=dtype, output_loading_info=True)
    except Exception as exc:
        raise SingleFileError(f"transformers could not load {path} as {cls_name}: {type(exc).__name__}: {exc}") from exc
    missing = [k for k in report.get("missing_keys", ()) if k not in _tied(model)]
    if missing or report.get("mismatched_keys"):
        raise SingleFileError(f"{path} does not match the {cls_name} config in {config}: missing {sorted(missing)[:3]},"
                              f" other shapes {list(report.get('mismatched_keys') or [])[:3]}: pick the text encoder "
                              "this model uses")
    log.info("%s: %s text encoder (%s) loaded as %s", path.name, cls_name, info.format, short_dtype(dtype))
    return model


def _built_empty(path: Path, info: SingleFileInfo, cls: type, config: Path, state: dict[str, torch.Tensor],
                 kinds: list[StoredKind], dtype: torch.dtype, fit: Fit | None, scales: dict[str, torch.Tensor],
                 groups: dict[str, int]) -> Any:
    """The text encoder built empty (no weight allocated), its stored layers (of ``kinds``)
    swapped in, the file's tensors assigned (fp8 and int8 ones as stored, then marked with their
    ``scales`` and convrot ``groups``): transformers' own loader would allocate every layer in
    ``dtype`` (and fill what a fitted file lacks with weights no one reads)."""
    from accelerate import init_empty_weights

    settings = cls.config_class.from_pretrained(str(config))
    with init_empty_weights():  # buffers (rotary tables) are made for real
        model = cls(fit.config(settings) if fit is not None else settings)
    try:
        stored, counts = swap_stored(model, state, kinds, dtype)
    except ValueError as exc:
        raise SingleFileError(f"{path}: {exc}") from exc
    # transformers' rule: the strict list stays float32 always, the other one under fp16 only
    keep32 = [*(getattr(cls, "_keep_in_fp32_modules_strict", None) or []),
              *((getattr(cls, "_keep_in_fp32_modules", None) or []) if dtype == torch.float16 else [])]
    state = {k: v.to(dtype) if v.is_floating_point() and not is_fp8(v) and k not in stored
             and not any(m in k.split(".") for m in keep32) else v for k, v in state.items()}
    params = dict(model.named_parameters())
    for key in [k for k, v in state.items() if v.dtype == INT8 and k in params]:  # no gradient on integers
        params[key].requires_grad_(False)
    result = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    absent = fit.absent if fit is not None else ()
    empty = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta and not n.startswith(absent)]
    if empty or result.unexpected_keys:
        raise SingleFileError(f"{path} does not match the {cls.__name__} config in {config}: missing {empty[:3]}, "
                              f"unexpected {result.unexpected_keys[:3]}: pick the text encoder this model uses")
    fp8 = _marked(path, model, dtype, scales, groups)
    log.info("%s: %s text encoder (%s) loaded %s%s", path.name, cls.__name__, info.format,
             f"with {', '.join(f'{n} {name}' for name, (n, _d) in counts.items())} layers kept, the rest in " if counts else
             f"with {fp8} fp8 / int8 Linear weights kept, the rest in " if fp8 else "as ", short_dtype(dtype))
    return model.eval()


def _marked(path: Path, model: torch.nn.Module, dtype: torch.dtype, scales: dict[str, torch.Tensor],
            groups: dict[str, int]) -> int:
    """How many fp8 or int8 Linear weights the model keeps (`fp8.mark_fp8`; its other stored tensors are
    decoded: an embedding table, and a layer the model keeps in float32, such as T5's ``wo``, whose
    caller casts its input to the weight's dtype); 0 for a model without fp8 tensors outside its
    stored layers (whose scales are fp8)."""
    plain = [m for m in model.modules() if not isinstance(m, StoredLinear)]
    if not scales and not any(t is not None and (is_fp8(t) or t.dtype == INT8) for m in plain
                              for t in (*m._parameters.values(), *m._buffers.values())):
        return 0
    try:
        return len(mark_fp8(model, dtype, scales, source=str(path), convrot=groups).weights)
    except ValueError as exc:
        raise SingleFileError(str(exc)) from exc


def _tied(model: Any) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if isinstance(tied, (dict, list, tuple, set)) else set()
