"""The per-component stats block: logged once per placed pipeline, returned as data for the
nodes and the web view (``to_dict`` is JSON-ready)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

GiB = 1024**3


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 100 or n == 0 else f"{n / 1024**2:.2f} MiB"


@dataclass(frozen=True)
class ComponentReport:
    name: str
    cls: str
    role: str
    reason: str
    nbytes: int
    dtypes: tuple[str, ...]
    quantization: str | None
    device_bytes: int
    pinned_bytes: int
    details: dict[str, object] = field(default_factory=dict)

    @property
    def host_bytes(self) -> int:
        return max(self.nbytes - self.device_bytes, 0)

    @property
    def ram_bytes(self) -> int:
        """Its weights in host memory: a streamer's every block master (kept blocks' too), else
        what is not on the device."""
        return int(self.details.get("host_bytes", self.host_bytes))

    @property
    def pageable_bytes(self) -> int:
        return max(self.ram_bytes - self.pinned_bytes, 0)

    @property
    def mapped_bytes(self) -> int:
        """Pageable weights that are a private mapping of their files (`formats/mapped.py`): the
        page cache holds them, and may give them up and read them again from disk."""
        return min(int(self.details.get("mapped_bytes", 0)), self.pageable_bytes)

    def ram_text(self) -> str:
        """``RAM 5.00 GiB (pinned 2.00 GiB, pageable 3.00 GiB, mapped 2.50 GiB, staging 256.00
        MiB)``: host memory by kind (mapped is the part of pageable read from the files' pages;
        staging buffers are pinned too, beside the weights)."""
        staging = int(self.details.get("staging_bytes", 0))
        return (f"RAM {gib(self.ram_bytes)} (pinned {gib(self.pinned_bytes)}, pageable {gib(self.pageable_bytes)}"
                + (f", mapped {gib(self.mapped_bytes)}" if self.mapped_bytes else "")
                + (f", staging {gib(staging)})" if staging else ")"))

    def line(self) -> str:
        dtype = "/".join(self.dtypes) + (f" [{self.quantization}]" if self.quantization else "")
        extra = ""
        if "blocks" in self.details:
            extra = f", blocks kept {self.details['kept']}/{self.details['blocks']}"
            held = int(self.details.get("kept_bytes", 0))  # whole blocks and blocks' largest parts
            extra += f" ({gib(held)} kept)" if held else ""
            graphs = int(self.details.get("graphs", 0))
            extra += f", {graphs} as CUDA graphs ({gib(int(self.details['graph_bytes']))})" if graphs else ""
            wait = int(self.details.get("graph_wait_bytes", 0))  # a first launch short of free memory
            extra += f", a CUDA graph waits for {gib(wait)} free to launch" if wait else ""
            compiled = int(self.details.get("compiled_blocks", 0))
            extra += f", {compiled} compiled" if compiled else ""
        lora = self.details.get("lora")
        if isinstance(lora, dict):
            extra += _lora_text(lora)
        return (
            f"  {self.name:<16} {self.cls:<34} {self.role:<9} {gib(self.nbytes):>11}  {dtype:<16} "
            f"device {gib(self.device_bytes)}, {self.ram_text()}{extra}  ({self.reason})"
        )


def _lora_text(lora: dict[str, object]) -> str:
    """``LoRA fused+unfused on 56 layers (unfused: 48 fp8, e.g. blocks.0.ffn.net.2; 1.2 MiB of
    factors on the device)``: the layers a quantized weight kept unfused, by reason."""
    text = f", LoRA {lora['path']} on {lora['layers']} layers"
    unfused = lora.get("unfused")
    if isinstance(unfused, dict) and unfused:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(Counter(unfused.values()).items()))
        text += (f" (unfused: {kinds}, e.g. {next(iter(unfused))}; "
                 f"{gib(int(lora.get('factor_bytes', 0)))} of factors on the device)")
    return text


@dataclass(frozen=True)
class PlacementReport:
    pipeline: str
    device: str
    mode: str
    components: tuple[ComponentReport, ...]
    plan: str = ""  # the preload planner's last plan line, when a denoiser is streamed
    prompt_cache: str = ""  # entries, bytes, hits of the prompt-embedding cache (run/prompt_cache.py)

    @property
    def device_bytes(self) -> int:
        return sum(c.device_bytes for c in self.components)

    @property
    def pinned_bytes(self) -> int:
        return sum(c.pinned_bytes for c in self.components)

    @property
    def ram_bytes(self) -> int:
        return sum(c.ram_bytes + int(c.details.get("staging_bytes", 0)) for c in self.components)

    def component(self, name: str) -> ComponentReport:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r} in the placement of {self.pipeline}")

    def text(self) -> str:
        head = f"{self.pipeline} on {self.device}, mode {self.mode}: " \
               f"{gib(self.device_bytes)} on device, {gib(self.ram_bytes)} in RAM ({gib(self.pinned_bytes)} pinned)"
        lines = [head, *(c.line() for c in self.components)]
        if self.plan:
            lines.append(f"  preload: {self.plan}")
        if self.prompt_cache:
            lines.append(f"  prompt cache: {self.prompt_cache}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["device_bytes"] = self.device_bytes
        out["pinned_bytes"] = self.pinned_bytes
        out["ram_bytes"] = self.ram_bytes
        for comp, row in zip(self.components, out["components"], strict=True):
            row.update(ram_bytes=comp.ram_bytes, pageable_bytes=comp.pageable_bytes, mapped_bytes=comp.mapped_bytes)
        return out
