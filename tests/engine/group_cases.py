"""Toy models, the four placement modes and the device-read simulator used by
test_group_offload_cases.py and test_group_offload_guards.py (issue 20; their release check is
release_check.py); only they import it.

The toy models re-write, in this suite's style, the models of diffusers' group-offloading tests
(tests/hooks/test_group_offloading.py, tests/models/testing_utils/{memory,compile}.py,
tests/pipelines/test_pipelines_common.py); each class says which one it follows.
"""

from __future__ import annotations

import copy
import gc
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from diffusers import AutoencoderKL, DiffusionPipeline
from diffusers.hooks import ModelHook
from diffusers.hooks import group_offloading as diffusers_go
from diffusers.models import ModelMixin
from diffusers_offload.offload_core import OffloadConfig
from diffusers_offload.offload_core.transport import OnDemandTransport
from diffusers_offload.offload_core.transport.leaf import LeafGroupTransport
from diffusers_offload.offload_core.transport.streamer import BlockStreamer
from engine.release_check import named_tensors
from torch.overrides import TorchFunctionMode

F = 16  # features of every toy: a tiny model runs in microseconds

# -- the four modes every case runs in --------------------------------------------------------------
BASE = OffloadConfig(device="cpu", on_demand_threshold_gb=0, resident_floor_mb=0, preload="off")
MODES = {
    "auto-parts": BASE.replace(mode="auto", stream_parts=True),
    "auto-whole": BASE.replace(mode="auto", stream_parts=False),
    "leaf": BASE.replace(mode="leaf"),
    "model": BASE.replace(mode="model"),
}


# -- toy models (each names the diffusers test model it re-writes) --------------------------------------
def _linear() -> torch.nn.Linear:
    return torch.nn.Linear(F, F)


class DummyBlock(torch.nn.Module):
    """diffusers' ``DummyBlock`` (tests/hooks/test_group_offloading.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj_in, self.activation, self.proj_out = _linear(), torch.nn.ReLU(), _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(self.activation(self.proj_in(x)))


class DummyModel(ModelMixin):
    """diffusers' ``DummyModel``: a linear head, a tower of blocks, a linear tail."""

    def __init__(self, num_layers: int = 3) -> None:
        super().__init__()
        self.linear_1, self.activation, self.linear_2 = _linear(), torch.nn.ReLU(), _linear()
        self.blocks = torch.nn.ModuleList(DummyBlock() for _ in range(num_layers))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear_1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        for block in self.blocks:
            x = block(x)
        return self.linear_2(x)


class DummyModelWithMultipleBlocks(ModelMixin):
    """diffusers' ``DummyModelWithMultipleBlocks``: ``single_blocks`` registered before
    ``double_blocks``, run after them (invocation order differs from registration order)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_1, self.activation, self.linear_2 = _linear(), torch.nn.ReLU(), _linear()
        self.single_blocks = torch.nn.ModuleList(DummyBlock() for _ in range(3))
        self.double_blocks = torch.nn.ModuleList(DummyBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.activation(self.linear_1(x))
        for block in (*self.double_blocks, *self.single_blocks):
            x = block(x)
        return self.linear_2(x)


class DummyModelWithLayerNorm(DummyModel):
    """diffusers' ``DummyModelWithLayerNorm``: a norm after the tower, a group of parameters only."""

    def __init__(self) -> None:
        super().__init__(num_layers=2)
        self.layer_norm = torch.nn.LayerNorm(F, elementwise_affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        for block in self.blocks:
            x = block(x)
        return self.linear_2(self.layer_norm(x))


class DummyModelWithStandaloneLayers(ModelMixin):
    """diffusers' ``DummyModelWithStandaloneLayers``: no ModuleList at all."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1, self.activation, self.layer2, self.layer3 = _linear(), torch.nn.ReLU(), _linear(), _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer3(self.layer2(self.activation(self.layer1(x))))


class NestedContainer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks, self.norm = torch.nn.ModuleList([_linear(), _linear()]), torch.nn.LayerNorm(F)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks[1](self.blocks[0](x)))


class DummyModelWithDeeplyNestedBlocks(ModelMixin):
    """diffusers' ``DummyModelWithDeeplyNestedBlocks``: parameters nested in containers, the only
    ModuleList two levels down."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layer, self.output_layer = _linear(), _linear()
        self.container = torch.nn.Sequential(OrderedDict(proj_in=_linear(), nested_container=NestedContainer(),
                                                         proj_out=_linear()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.container(self.input_layer(x)))


class DummyModelWithConditionalModules(DummyModel):
    """diffusers' ``DummyModelWithConditionalModules``: two projections run only when an optional
    input is given (Helios' patch_short/mid/long)."""

    def __init__(self) -> None:
        super().__init__()
        self.optional_proj_1, self.optional_proj_2 = _linear(), _linear()

    def head(self, x: torch.Tensor, optional_input: torch.Tensor | None = None) -> torch.Tensor:
        x = super().head(x)
        if optional_input is not None:
            x = x + self.optional_proj_1(optional_input) + self.optional_proj_2(optional_input)
        return x

    def forward(self, x: torch.Tensor, optional_input: torch.Tensor | None = None) -> torch.Tensor:
        x = self.head(x, optional_input)
        for block in self.blocks:
            x = block(x)
        return self.linear_2(x)


class DummyModelWithTowerTwice(DummyModel):
    """Not in diffusers: the tower runs twice per forward (a refiner pass over the same blocks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        for block in (*self.blocks, *self.blocks):
            x = block(x)
        return self.linear_2(x)


def tiny_vae() -> AutoencoderKL:
    """diffusers' ``get_autoencoder_kl_config``: standalone convs, entered through encode/decode."""
    torch.manual_seed(0)
    return AutoencoderKL(block_out_channels=[2, 4], in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                         norm_num_groups=2, layers_per_block=1).eval()


class DummyPipeline(DiffusionPipeline):
    """diffusers' ``DummyPipeline`` (two denoising steps), with a VAE decoding the result as in
    test_pipelines_common's pipeline-level group-offloading tests."""

    model_cpu_offload_seq = "transformer->vae"

    def __init__(self, transformer: torch.nn.Module, vae: torch.nn.Module) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae)

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            latents = latents + 0.1 * self.transformer(latents)
        return self.vae.decode(latents).sample


class LayerOutputTrackerHook(ModelHook):
    """diffusers' ``LayerOutputTrackerHook``: records every output of the module it sits on."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def post_forward(self, module, output):
        self.outputs.append(output)
        return output


@pytest.fixture(autouse=True, scope="module")
def quick_release():
    """``release`` collects garbage (0.2-0.3 s with torch and diffusers loaded): what is alive
    before a module's tests is frozen out of the collector's sight, so a release costs
    milliseconds. Autouse in the modules that import it."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def make(cls: type[torch.nn.Module], **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls(**kwargs).eval()


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """An unplaced reference with the same weights (diffusers' ``model_ref.load_state_dict``); call
    it before placing ``model``."""
    return copy.deepcopy(model).eval()


# -- the device-read simulator --------------------------------------------------------------------
# Ops that read no values (metadata, hashing) or that are how an onload reads a host copy.
_NO_READ = frozenset({
    "__get__", "__set__", "__hash__", "to", "copy_", "data_ptr", "untyped_storage", "is_pinned", "numel", "nelement",
    "element_size", "size", "dim", "stride", "storage_offset", "is_contiguous", "is_floating_point", "is_complex",
    "_has_compatible_shallow_copy_type", "requires_grad_",
})


class DeviceReads(TorchFunctionMode):
    """Records every torch call that reads a weight while its transport has it off the device.

    The onload device is the CPU here, so nothing fails where a GPU would raise a device mismatch;
    this mode replays each transport's notion of "on the device". Block streamer: a streamed
    tensor is on while bound into one of its device buffers (a ring slot, a kept piece's buffer),
    off when bound to its host master or any other host tensor (``_HostReads`` of
    test_stream_parts.py, extended to whole blocks); the non-block part and a split block's rest
    are resident. On demand: the module is on while ``loaded``. Leaf groups (diffusers): between
    the ``ModuleGroup``'s ``onload_`` and ``offload_``. Resident: always."""

    def __init__(self, engine, pipe) -> None:
        super().__init__()
        self.reads: list[str] = []
        self._off: dict[int, tuple[str, Callable[[], bool]]] = {}
        self._buffers: list[torch.Tensor] = []  # streamer device buffers seen (kept alive: no reuse)
        self._streamers: list[BlockStreamer] = []
        self._groups_on: set[int] = set()
        for comp, state in engine.states(pipe).items():
            module, transport = getattr(pipe, comp), state.transport
            names = {id(t): f"{comp}.{n}" for n, t in named_tensors(module)}
            if isinstance(transport, BlockStreamer):
                self._streamers.append(transport)
                for block in transport.blocks:
                    for slot in block.slots:
                        self._off[id(slot.tensor)] = (names[id(slot.tensor)], self._off_streamed(slot.tensor))
            elif isinstance(transport, OnDemandTransport):
                for key, name in names.items():
                    self._off[key] = (name, lambda t=transport: not t.loaded)
            elif isinstance(transport, LeafGroupTransport):
                for key, name in names.items():
                    self._off[key] = (name, lambda k=key: k not in self._groups_on)

    def _off_streamed(self, tensor: torch.Tensor) -> Callable[[], bool]:
        def off() -> bool:
            ptr = tensor.data_ptr()
            kept = [p.resident for s in self._streamers for p in s.pieces if p.resident is not None]
            return not any(_within(ptr, buf) for buf in (*self._buffers, *kept))
        return off

    @contextmanager
    def watching(self) -> Iterator[DeviceReads]:
        """Install the mode and the probes that track where transports bind weights."""
        saved = [(s.ring, s.ring.acquire) for s in self._streamers]
        for ring, acquire in saved:
            ring.acquire = lambda home=None, acquire=acquire: self._seen(acquire(home))
        onload, offload = diffusers_go.ModuleGroup.onload_, diffusers_go.ModuleGroup.offload_

        def group_onload(group):
            onload(group)
            self._groups_on.update(id(t) for t in _group_tensors(group))

        def group_offload(group):
            offload(group)
            self._groups_on.difference_update(id(t) for t in _group_tensors(group))

        diffusers_go.ModuleGroup.onload_, diffusers_go.ModuleGroup.offload_ = group_onload, group_offload
        try:
            with self:
                yield self
        finally:
            diffusers_go.ModuleGroup.onload_, diffusers_go.ModuleGroup.offload_ = onload, offload
            for ring, _acquire in saved:
                del ring.acquire

    def _seen(self, slot):
        self._buffers.append(slot.buf)
        return slot

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _NO_READ:
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if torch.is_tensor(t) and id(t) in self._off:
                        name, off = self._off[id(t)]
                        if off():
                            self.reads.append(f"{getattr(func, '__name__', func)}({name})")
        return func(*args, **kwargs)


def _within(ptr: int, buf: torch.Tensor) -> bool:
    start = buf.data_ptr()
    return start <= ptr < start + buf.numel() * buf.element_size()


def _group_tensors(group) -> Iterator[torch.Tensor]:
    for module in group.modules:
        yield from module.parameters()
        yield from module.buffers()
    yield from group.parameters
    yield from group.buffers
