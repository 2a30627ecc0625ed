"""GGUF single files: what one holds, read from its header with the `gguf` package's own reader,
and the quant types of a model loaded from one through diffusers' GGUF quantizer.

Why a check of our own before diffusers loads the file: its reader fails on a damaged file with
numpy's words ("cannot reshape array of size 23 ..."), and an unknown quant type surfaces as one
tensor's name deep in a load; a user needs the file named and told what it looks like. Reading the
header costs milliseconds (the tensor data is memory-mapped, never read).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..log import get_logger

log = get_logger("gguf")

GGUF_MAGIC = b"GGUF"
PLAIN_TYPES = ("F32", "F16")  # diffusers loads these as ordinary tensors


class GgufFileError(ValueError):
    """A GGUF file the pack cannot run; the message names the file and what it looks like."""


@dataclass(frozen=True)
class GgufInfo:
    """A GGUF file as its header describes it; sizes are the stored (packed) bytes."""

    path: Path
    arch: str | None
    tensor_count: int
    quant_types: tuple[str, ...]  # every storage type present, most bytes first (F32/F16 included)
    nbytes: int  # tensor data bytes
    shapes: dict[str, tuple[int, ...]]  # tensor name -> logical shape, in torch's order

    @property
    def quantized_types(self) -> tuple[str, ...]:
        """The block-quantized types present (not F32/F16)."""
        return tuple(t for t in self.quant_types if t not in PLAIN_TYPES)


def supported_quant_types() -> frozenset[str]:
    """Storage types diffusers' GGUF loader reads: F32/F16 as tensors, the rest dequantized at compute."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    return frozenset({*PLAIN_TYPES, *(t.name for t in SUPPORTED_GGUF_QUANT_TYPES)})


def inspect_gguf(path: Path) -> GgufInfo:
    """Read a GGUF file's header: its architecture, tensors and storage types. Raises
    `GgufFileError` (a ValueError) naming the file when it is no GGUF file, is truncated or
    damaged, or holds a quant type diffusers cannot dequantize."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise GgufFileError(f"{path}: no such file")
    size = path.stat().st_size
    if size < len(GGUF_MAGIC) or _head(path, len(GGUF_MAGIC)) != GGUF_MAGIC:
        raise GgufFileError(f"{path} is not a GGUF file: it looks like {_looks_like(path, size)}")
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # numpy / struct errors on a cut or damaged header
        raise GgufFileError(f"{path} is a damaged or truncated GGUF file ({size} bytes): its header "
                            f"could not be read ({type(exc).__name__}: {exc})") from exc
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise GgufFileError(f"{path} is a truncated GGUF file: its tensors need {end} bytes, the file has {size}")
    by_type: dict[str, int] = {}
    for t in reader.tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    _refuse_unknown(path, reader, by_type)
    info = GgufInfo(
        path=path,
        arch=_arch(reader),
        tensor_count=len(reader.tensors),
        quant_types=tuple(sorted(by_type, key=lambda k: -by_type[k])),
        nbytes=sum(by_type.values()),
        shapes={t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors},
    )
    log.info("%s: GGUF, arch %s, %d tensors, %s, %.2f GiB stored", path.name, info.arch, info.tensor_count,
             "/".join(info.quant_types), info.nbytes / 2**30)
    return info


def _refuse_unknown(path: Path, reader, by_type: dict[str, int]) -> None:
    unknown = sorted(set(by_type) - supported_quant_types())
    if unknown:
        names = [t.name for t in reader.tensors if t.tensor_type.name in unknown]
        raise GgufFileError(
            f"{path} holds quant type(s) {', '.join(unknown)} that diffusers cannot dequantize "
            f"({len(names)} tensors, e.g. {names[0]}); supported: {', '.join(sorted(supported_quant_types()))}")


def _arch(reader) -> str | None:
    field = reader.fields.get("general.architecture")
    if field is None:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except Exception:
        return None


def _head(path: Path, n: int) -> bytes:
    with path.open("rb") as f:
        return f.read(n)


def _looks_like(path: Path, size: int) -> str:
    """A few words on what a non-GGUF file is, from its first bytes."""
    if size == 0:
        return "an empty file"
    head = _head(path, 16)
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (a PyTorch .pt/.ckpt checkpoint?)"
    if head[:1] == b"\x80":
        return "a Python pickle (a PyTorch checkpoint?)"
    if len(head) >= 9 and int.from_bytes(head[:8], "little") < size and head[8:9] == b"{":
        return "a safetensors file (load it as one)"
    if head.lstrip()[:1] in (b"{", b"["):
        return "a JSON text file"
    return f"none of the weight formats the pack knows (first bytes {head[:8].hex()})"


def gguf_quant_types(module: torch.nn.Module) -> tuple[str, ...]:
    """The GGUF quant types of ``module``'s weights (diffusers' `GGUFParameter` carries
    ``quant_type``), most bytes first; empty when none is GGUF."""
    by_type: dict[str, int] = {}
    for p in module.parameters():
        qt = getattr(p, "quant_type", None)
        if qt is not None and hasattr(p, "quant_shape"):
            name = getattr(qt, "name", str(qt))
            by_type[name] = by_type.get(name, 0) + p.numel() * p.element_size()
    return tuple(sorted(by_type, key=lambda k: -by_type[k]))
