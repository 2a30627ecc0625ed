"""MiniMax-H3 fl2va at full width and reduced depth (random bf16 weights) through the engine under a VRAM cap.

Issue 4's GPU check: one fl2va generation (first and last keyframe, audio on) on an H3-geometry
``MiniMaxH3ModularPipeline`` placed by the engine with every role offloaded, timed per stage.

Geometry (``--tiny`` swaps in the test suite's tiny configs, for the CPU smoke run):
- transformer: ``MiniMaxH3Transformer3DModel`` at the H3-33B width (diffusers defaults: hidden 5376,
  56 x 128 heads, ffn 14336, 2 refiner blocks) with ``--blocks`` of its 50 blocks (1.20 GiB each);
  the non-block part (1.60 GiB, 1.44 of it the token refiner) is whole. With 10 or more blocks the
  refiner is too small to count as a tower of its own, as in the 50-block model (towers.py: 1/8 rule);
- text encoder: Qwen3-VL at the assumed H3 width (tests/fixtures/meta_models.H3_TEXT_ENCODER: hidden
  5120, 64 x 128 heads, ffn 25600, vocab 151936, full 27-block vision tower) with ``--te-layers``
  decoder layers of 64 (0.91 GiB each). H3 reads ``hidden_states[50]``; with fewer than 51 layers the
  bench reads the last-but-one (the pipeline's ``text_encoder_layer`` is overridden on this object only);
- video VAE and audio VAE: the real configs (diffusers defaults), cast as ``from_pretrained`` casts them;
- tokenizer: the suite's byte-level tiny tokenizer (ids fit the real vocabulary); image processor at
  Qwen3-VL's real patch geometry, so a 768x448 keyframe is 336 vision tokens.

Each model is built on the device with seed 0, cast like ``from_pretrained(dtype=bf16)`` (fp32 islands
kept) and moved to pageable host memory, one at a time. Placement uses ``on_demand_threshold_gb=0`` so
the 0.56 GiB audio VAE is on demand too: text encoder leaf groups, denoiser block streaming with preload
``--preload``, both VAEs on demand. A second process (``Ballast`` of wan_bench) holds the device so only
``--cap`` GiB stay free.

Stages come from the engine's own stage hooks (``offload_core.run.stages.StageHooks``, installed exactly as
``nodes/h3.py`` installs them, with ``run_view`` and ``pad_short_latents``). Three boundaries are added so
that a whole-module move lands in the stage that caused it: the VAEs' ``encode``/``decode`` entries and
the text encoder's inner ``model`` call announce their stage *before* the on-demand transport moves the
module in, and hand back to ``other`` when they return. Every boundary is ``synchronize -> perf_counter``.
Peaks: the allocator's peak is reset at each boundary; the engine's own resets (the preload planner
resets the peak at every forward) go through a ``MemoryReader`` that folds the peak into every open
window first and answers the planner from its own window, so neither reading disturbs the other.
The on-demand transports' ``onload``/``offload`` are wrapped with synchronized timers (move in/out rows).

Runs (``--runs``, default ``plain,room``): ``plain`` is the engine alone; ``room`` is the same call with
the bench acting as a host memory manager: before an on-demand module moves in, if the device lacks its
bytes plus ``--headroom``, it asks ``Engine.give_back`` for the difference (kept denoiser blocks go, as
ComfyUI's ``partially_unload`` would make them). A run that fails (OOM or other) is recorded with the
stage it failed in, the engine's ``after_run`` is called, and the next run goes on.

    python bench/h3_bench.py --json $OUT/h3.jsonl                     # H200, defaults below
    python bench/h3_bench.py --tiny --device cpu --json /tmp/h3.jsonl  # CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("wan_bench", ROOT / "bench" / "wan_bench.py")
wan_bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("wan_bench", wan_bench)
_spec.loader.exec_module(wan_bench)  # imports the pack as ``diffusers_offload`` (no repo root on sys.path)
sys.path.insert(0, str(ROOT / "tests"))  # the suite's configs and tiny tokenizer (plain modules, no pytest)

from diffusers import (  # noqa: E402
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3Transformer3DModel,
)
from diffusers.modular_pipelines import MiniMaxH3Blocks  # noqa: E402
from diffusers.schedulers import MiniMaxH3Scheduler  # noqa: E402
from diffusers_offload.offload_core import Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core.components import module_bytes  # noqa: E402
from diffusers_offload.offload_core.memory import MemoryReader  # noqa: E402
from diffusers_offload.offload_core.models.minimax_h3 import grid as grid_rules  # noqa: E402
from diffusers_offload.offload_core.models.minimax_h3.run_view import pad_short_latents, run_view  # noqa: E402
from diffusers_offload.offload_core.pinning import pinned_bytes  # noqa: E402
from diffusers_offload.offload_core.report import gib  # noqa: E402
from diffusers_offload.offload_core.run.stages import (  # noqa: E402
    AUDIO,
    DENOISE,
    IMAGE,
    TEXT,
    VIDEO,
    StageHooks,
    StageHost,
)
from diffusers_offload.offload_core.transport.moves import bytes_on, move_module  # noqa: E402
from fixtures.meta_models import H3_TEXT_ENCODER, cast_like_from_pretrained  # noqa: E402
from fixtures.tiny_tok import QWEN_VISION_TOKENS, tiny_qwen2_tokenizer  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import (  # noqa: E402
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)

GiB = 2**30
OTHER = "other"  # host work between stages: resize, tokenize, image preprocessing, latent layout, post-processing
STAGE_ORDER = (OTHER, TEXT, IMAGE, DENOISE, VIDEO, AUDIO)
ROLES = {"text_encoder": "leaf", "transformer": "per-step", "vae": "on-demand", "audio_vae": "on-demand"}
log = logging.getLogger("h3_bench")

# The suite's tiny H3 (tests/fixtures/tiny_models.build_tiny_h3), with 4 text layers so the layer
# override below runs in the smoke test too.
TINY_TEXT = dict(
    text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8, max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                      "mrope_interleaved": True}),
    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=16, num_position_embeddings=16,
                       deepstack_visual_indexes=[0]),
)
TINY_TRANSFORMER = dict(num_attention_heads=2, attention_head_dim=12, hidden_size=24, num_refiner_layers=1, ffn_dim=32,
                        in_channels=4, audio_in_channels=4, patch_size=(1, 2, 2), text_dim=16, freq_dim=16,
                        time_embed_hidden_dim=16, time_embed_dim=16, rope_freq_dim=2)
TINY_VAE = dict(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
                decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
                decoder_num_register_tokens=1, decoder_ffn_mult=1, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
TINY_AUDIO_VAE = dict(encoder_dim=4, encoder_rates=(2, 2), latent_dim=8, latent_channels=4, num_attention_heads=2,
                      decoder_dim=8, decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4), resblock_kernel_sizes=(3,),
                      resblock_dilation_sizes=((1,),), sampling_rate=160, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
FULL_AUDIO_VAE = dict(latents_mean=[0.0] * 32, latents_std=[1.0] * 32)  # the real config, plus the stats it needs
# Qwen3-VL's shipped image processor: 16 px patches, 2x2 merge, 256x256 .. 4096x4096 pixels.
FULL_PIXELS = (256 * 256, 4096 * 4096)
TINY_PIXELS = (32 * 32, 64 * 64)


class Out:
    """JSON lines: printed as they come and appended to ``--json`` at once (a killed run keeps its rows)."""

    def __init__(self, path: str) -> None:
        self.rows: list[dict] = []
        self.file = open(path, "w") if path else None  # noqa: SIM115 - open for the whole run

    def row(self, **kw: Any) -> dict:
        self.rows.append(kw)
        line = json.dumps(kw, default=str)
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()
        return kw


# ------------------------------------------------------------------------------------------- peaks
class PeakTracker:
    """Allocator peaks over named windows that survive one another's resets: every real reset first
    folds the allocator's peak into every open window."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.windows: dict[str, list[int]] = {}

    def _fold(self) -> None:
        if not self.cuda:
            return
        a, r = torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
        for w in self.windows.values():
            w[0], w[1] = max(w[0], a), max(w[1], r)

    def mark(self, key: str) -> None:
        """Open (or restart) window ``key`` now."""
        if not self.cuda:
            self.windows[key] = [0, 0]
            return
        self._fold()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.windows[key] = [torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)]

    def peak(self, key: str) -> tuple[int, int]:
        """(allocated, reserved) peaks of window ``key`` since its mark."""
        self._fold()
        return tuple(self.windows.get(key, (0, 0)))


class TrackingReader(MemoryReader):
    """The engine's memory reader with the planner's peak window kept in the tracker."""

    def __init__(self, tracker: PeakTracker) -> None:
        self.tracker = tracker
        tracker.mark("engine")

    def reset_peak(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.tracker.mark("engine")

    def peak_allocated(self, device: torch.device) -> int | None:
        return self.tracker.peak("engine")[0] if device.type == "cuda" else None


# ------------------------------------------------------------------------------------------- build
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def keep_processor_without_torchvision() -> None:
    """Without torchvision, transformers' Qwen3VLProcessor refuses a missing video processor; H3's
    t2va/fl2va blocks never use it (shared/reference/tiny_models/processor_shim.py does the same)."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() or getattr(Qwen3VLProcessor, "_h3_bench_shim", False):
        return
    original = Qwen3VLProcessor.get_attributes.__func__
    Qwen3VLProcessor.get_attributes = classmethod(lambda cls: [a for a in original(cls) if a != "video_processor"])
    Qwen3VLProcessor.video_processor = None
    Qwen3VLProcessor._h3_bench_shim = True


def make_processor(tokenizer, pixels: tuple[int, int]) -> Qwen3VLProcessor:
    from transformers.utils import is_torchvision_available

    image = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=pixels[0],
                                     max_pixels=pixels[1])
    if is_torchvision_available():
        from transformers import Qwen3VLVideoProcessor

        video = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
        return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video)
    keep_processor_without_torchvision()
    return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer)


def text_config(args, tokenizer) -> Qwen3VLConfig:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS}
    base = TINY_TEXT if args.tiny else H3_TEXT_ENCODER
    text = dict(base["text_config"], num_hidden_layers=args.te_layers)
    if args.tiny:
        text["vocab_size"] = len(tokenizer)
    return Qwen3VLConfig(text_config=text, vision_config=dict(base["vision_config"]),
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def build(args, out: Out, device: torch.device, dtype: torch.dtype) -> Any:
    tokenizer = tiny_qwen2_tokenizer(extra_special=QWEN_VISION_TOKENS)
    makers = {
        "transformer": lambda: MiniMaxH3Transformer3DModel(**(TINY_TRANSFORMER if args.tiny else {}),
                                                           num_layers=args.blocks),
        "text_encoder": lambda: Qwen3VLForConditionalGeneration(text_config(args, tokenizer)),
        "vae": lambda: AutoencoderKLMiniMaxH3(**(TINY_VAE if args.tiny else {})),
        "audio_vae": lambda: AutoencoderKLMiniMaxH3Audio(**(TINY_AUDIO_VAE if args.tiny else FULL_AUDIO_VAE)),
    }
    models: dict[str, torch.nn.Module] = {}
    torch.manual_seed(0)
    for name, make in makers.items():
        t0 = time.perf_counter()
        with torch.device(device):
            model = make()
        cast_like_from_pretrained(model, dtype).requires_grad_(False)
        sync(device)
        built = time.perf_counter() - t0
        host_s = wan_bench.to_host(model) if device.type == "cuda" else 0.0
        models[name] = model
        out.row(section="build", component=name, cls=type(model).__name__, gib=module_bytes(model) / GiB,
                params_b=sum(p.numel() for p in model.parameters()) / 1e9, build_s=built, to_host_s=host_s,
                dtypes=sorted({str(t.dtype).removeprefix("torch.") for t in model.parameters()}),
                **geometry(name, model), rss_gib=psutil.Process().memory_info().rss / GiB)
    pipe = MiniMaxH3Blocks().get_workflow("fl2va").init_pipeline()
    pipe.update_components(**models, tokenizer=tokenizer,
                           processor=make_processor(tokenizer, TINY_PIXELS if args.tiny else FULL_PIXELS),
                           scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    layers = models["text_encoder"].config.text_config.num_hidden_layers
    if layers <= pipe.text_encoder_layer:  # H3 reads hidden_states[50]: read the last-but-one of a short stack
        pipe.__class__ = _reads_layer(type(pipe), layers - 1)
    out.row(section="pipeline", cls=type(pipe).__name__, workflow="fl2va", text_encoder_layer=pipe.text_encoder_layer,
            total_gib=sum(module_bytes(m) for m in models.values()) / GiB)
    return pipe


@functools.cache
def _reads_layer(base: type, layer: int) -> type:
    return type(base.__name__, (base,), {"text_encoder_layer": property(lambda self: layer)})


def geometry(name: str, model: torch.nn.Module) -> dict:
    if name == "transformer":
        blocks = model.transformer_blocks
        return dict(blocks=len(blocks), block_gib=module_bytes(blocks[0]) / GiB,
                    non_block_gib=(module_bytes(model) - sum(module_bytes(b) for b in blocks)) / GiB,
                    refiner_gib=module_bytes(model.token_refiner) / GiB)
    if name == "text_encoder":
        lm = model.model.language_model
        return dict(layers=len(lm.layers), layer_gib=module_bytes(lm.layers[0]) / GiB,
                    embed_gib=module_bytes(lm.embed_tokens) / GiB, vision_gib=module_bytes(model.model.visual) / GiB,
                    lm_head_gib=module_bytes(model.lm_head) / GiB, vision_blocks=len(model.model.visual.blocks))
    if name == "vae":
        return dict(encoder_gib=module_bytes(model.encoder) / GiB, decoder_gib=module_bytes(model.decoder) / GiB)
    return {}


# ------------------------------------------------------------------------------------------- a run
class StageClock:
    """Segments of one call: a new one at every stage change, and one per denoise step."""

    def __init__(self, device: torch.device, tracker: PeakTracker, streamer: Any) -> None:
        self.device, self.tracker, self.streamer = device, tracker, streamer
        self.segments: list[dict] = []
        self.steps: list[dict] = []
        self.moves: list[dict] = []
        self.rooms: list[dict] = []
        self.stage: str | None = None
        self.failed: str | None = None  # the stage an exception left, when an entry wrapper saw it
        self._seg: dict | None = None
        self._step: dict | None = None

    def _alloc(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def enter(self, stage: str) -> None:
        """A stage boundary (announced by the bench or by a stage hook)."""
        if stage == self.stage:
            return
        sync(self.device)
        now = time.perf_counter()
        self._close_step(now)
        self._close(now)
        self.stage = stage
        self.tracker.mark("stage")
        log.info("stage: %s", stage)
        self._seg = dict(stage=stage, t0=now, units=0, alloc_start=self._alloc())

    def on_stage(self, stage: str, i: int, n: int) -> None:
        """The stage hooks' publish: one unit (layer, step, chunk...) of ``stage``."""
        self.enter(stage)
        self._seg["units"] += 1
        self._seg["of"] = n
        if stage == DENOISE:
            sync(self.device)
            now = time.perf_counter()
            self._close_step(now)
            self.tracker.mark("step")
            self._step = dict(step=i, of=n, t0=now)

    def _close_step(self, now: float) -> None:
        if self._step is None:
            return
        step, self._step = self._step, None
        alloc, reserved = self.tracker.peak("step")
        details = self.streamer.details() if self.streamer is not None else {}
        self.steps.append(dict(step=step["step"], of=step["of"], seconds=now - step["t0"], peak_alloc_gib=alloc / GiB,
                               peak_reserved_gib=reserved / GiB, kept=details.get("kept"), blocks=details.get("blocks"),
                               streamed_gib=details.get("streamed_per_step", 0) / GiB, plan=details.get("plan", "")))

    def _close(self, now: float) -> None:
        if self._seg is None:
            return
        seg, self._seg = self._seg, None
        alloc, reserved = self.tracker.peak("stage")
        seg.update(seconds=now - seg.pop("t0"), peak_alloc=alloc, peak_reserved=reserved, alloc_end=self._alloc())
        self.segments.append(seg)

    def finish(self) -> None:
        sync(self.device)
        now = time.perf_counter()
        self._close_step(now)
        self._close(now)
        self.stage = None

    def stages(self) -> list[dict]:
        """Segments summed per stage, in pipeline order."""
        out: dict[str, dict] = {}
        for seg in self.segments:
            s = out.setdefault(seg["stage"], dict(stage=seg["stage"], seconds=0.0, units=0, segments=0, peak_alloc=0,
                                                  peak_reserved=0, alloc_start=seg["alloc_start"]))
            s["seconds"] += seg["seconds"]
            s["units"] += seg["units"]
            s["segments"] += 1
            s["peak_alloc"] = max(s["peak_alloc"], seg["peak_alloc"])
            s["peak_reserved"] = max(s["peak_reserved"], seg["peak_reserved"])
            s["alloc_end"] = seg["alloc_end"]
        return sorted(out.values(), key=lambda s: STAGE_ORDER.index(s["stage"]) if s["stage"] in STAGE_ORDER else 99)


class Instruments:
    """The bench's wrappers around a placed pipeline for one run; ``remove`` restores every attribute."""

    def __init__(self, pipe: Any, engine: Engine, clock: StageClock, room: bool, headroom: int) -> None:
        self.pipe, self.engine, self.clock, self.room, self.headroom = pipe, engine, clock, room, headroom
        self.device = clock.device
        self._undo: list = []

    def install(self) -> None:
        states = self.engine.states(self.pipe)
        for name in ("vae", "audio_vae"):
            state = states.get(name)
            transport = state.transport if state is not None else None
            module = getattr(self.pipe, name)
            if transport is not None and hasattr(transport, "onload"):
                self._time_moves(name, module, transport)
            entries = {"vae": {"encode": IMAGE, "decode": VIDEO}, "audio_vae": {"decode": AUDIO}}[name]
            for entry, stage in entries.items():
                self._announce(module, entry, stage, transport)
        inner = self.pipe.text_encoder.model  # H3 calls text_encoder.model(...) directly
        handles = (inner.register_forward_pre_hook(lambda *_: self.clock.enter(TEXT)),
                   inner.register_forward_hook(lambda *_: self.clock.enter(OTHER)))
        self._undo.append(lambda: [h.remove() for h in handles])

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _announce(self, module: torch.nn.Module, entry: str, stage: str, transport: Any) -> None:
        inner = module.__dict__.get(entry)  # the on-demand transport's wrapper, when it installed one
        call = inner if inner is not None else getattr(module, entry)

        @functools.wraps(call)
        def announced(*args, **kwargs):
            self.clock.enter(stage)
            if self.room and transport is not None:
                self._make_room(stage, module, transport)
            try:
                return call(*args, **kwargs)
            except BaseException:
                self.clock.failed = self.clock.failed or stage  # before the stage hands back to ``other``
                raise
            finally:
                self.clock.enter(OTHER)

        module.__dict__[entry] = announced

        def undo() -> None:
            if inner is None:
                module.__dict__.pop(entry, None)
            else:
                module.__dict__[entry] = inner

        self._undo.append(undo)

    def _make_room(self, stage: str, module: torch.nn.Module, transport: Any) -> None:
        """What a host's memory manager does before a model moves in: free what it needs."""
        if self.device.type != "cuda" or getattr(transport, "loaded", False):
            return
        need = module_bytes(module) + self.headroom
        free, cached = self.engine.memory.device_free(self.device)
        if need <= free + cached:
            return
        t0 = time.perf_counter()
        freed = self.engine.give_back(self.pipe, need - free - cached)
        torch.cuda.empty_cache()
        sync(self.device)
        self.clock.rooms.append(dict(stage=stage, component=type(module).__name__, short_gib=(need - free - cached) / GiB,
                                     freed_gib=freed / GiB, seconds=time.perf_counter() - t0,
                                     free_after_gib=torch.cuda.mem_get_info(self.device)[0] / GiB))

    def _time_moves(self, name: str, module: torch.nn.Module, transport: Any) -> None:
        for method, direction in (("onload", "in"), ("offload", "out")):
            original = getattr(transport, method)

            def timed(original=original, direction=direction) -> None:
                before = transport.loaded
                sync(self.device)
                t0 = time.perf_counter()
                try:
                    original()
                finally:
                    sync(self.device)
                    seconds = time.perf_counter() - t0
                    if transport.loaded != before or direction == "in" and not transport.loaded:
                        nbytes = module_bytes(module)
                        self.clock.moves.append(dict(component=name, direction=direction, stage=self.clock.stage,
                                                     seconds=seconds, gib=nbytes / GiB, ok=transport.loaded != before,
                                                     gbs=nbytes / seconds / 1e9 if seconds > 0 else None))
                        log.info("%s moved %s: %.3f s", name, direction, seconds)

            transport.__dict__[method] = timed
            self._undo.append(lambda method=method: transport.__dict__.pop(method, None))


def keyframes(width: int, height: int) -> dict[str, Image.Image]:
    """Two seeded noise pictures at the canvas size (a flat colour would make the VAE's job trivial)."""
    rng = np.random.default_rng(0)
    pics = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(2)]
    return {"image": pics[0], "last_image": pics[1]}


def run_once(label: str, pipe: Any, engine: Engine, tracker: PeakTracker, args, out: Out) -> bool:
    """One generation; ``label`` is ``<n>-plain`` or ``<n>-room``."""
    device = tracker.device
    grid = grid_rules.grid_of(pipe)
    width, height, notes = grid_rules.snap_canvas(grid, args.width, args.height)
    frames, frame_notes = grid_rules.snap_frames(grid, args.frames)
    vae = pipe.vae
    totals = {  # as nodes/h3.py computes them
        DENOISE: args.steps - 1,
        VIDEO: grid_rules.decode_units(vae, grid.latent_frames(frames), height, width),
        IMAGE: grid_rules.encode_units(vae, 2, height, width),
    }
    streamer = engine.states(pipe)["transformer"].transport if "transformer" in engine.states(pipe) else None
    clock = StageClock(device, tracker, streamer)
    tools = Instruments(pipe, engine, clock, room=label.endswith("-room"), headroom=int(args.headroom * GiB))
    view = run_view(pipe, audio=True)
    kwargs = dict(prompt=args.prompt, height=height, width=width, num_frames=frames, num_inference_steps=args.steps,
                  generator=torch.Generator("cpu").manual_seed(0), output_type="pt", **keyframes(width, height))
    stats0 = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    start = dict(memory_required_gib=engine.memory_required(pipe) / GiB, device_at_start_gib=device_bytes(engine, pipe) / GiB,
                 free_at_start_gib=torch.cuda.mem_get_info(device)[0] / GiB if device.type == "cuda" else None)
    log.info("run %s: %dx%d, %d frames, %d steps", label, width, height, frames, args.steps)
    rss0 = psutil.Process().memory_info().rss
    error, state = None, None
    tools.install()
    t0 = time.perf_counter()
    try:
        clock.enter(OTHER)
        with StageHooks(pipe, StageHost(clock.on_stage, lambda: None), totals), pad_short_latents(vae):
            state = view(**kwargs)
        clock.finish()
        total = time.perf_counter() - t0
    except Exception as exc:  # an OOM or a device mismatch: record where, then recover like a host would
        failed_in = clock.failed or clock.stage
        clock.finish()
        total = time.perf_counter() - t0
        error = dict(stage=failed_in, error=f"{type(exc).__name__}: {str(exc)[:400]}",
                     trace=traceback.format_exc(limit=-6)[-2000:])
    finally:
        tools.remove()
        t1 = time.perf_counter()
        try:
            engine.after_run(pipe)
            sync(device)
        except Exception as exc:  # reported; the next run is still tried
            out.row(section="error", run=label, stage="after_run", error=f"{type(exc).__name__}: {str(exc)[:400]}",
                    trace=traceback.format_exc(limit=-6)[-2000:])
        after_run_s = time.perf_counter() - t1
    if error is not None:
        out.row(section="error", run=label, **error)
        recover(label, pipe, engine, device, out)
    for s in clock.stages():
        out.row(section="stage", run=label, stage=s["stage"], seconds=s["seconds"], units=s["units"],
                segments=s["segments"], peak_alloc_gib=s["peak_alloc"] / GiB, peak_reserved_gib=s["peak_reserved"] / GiB,
                alloc_start_gib=s["alloc_start"] / GiB, alloc_end_gib=s["alloc_end"] / GiB, cap_gib=args.cap)
    for s in clock.steps:
        out.row(section="step", run=label, **s)
    for m in clock.moves:
        out.row(section="move", run=label, **m)
    for r in clock.rooms:
        out.row(section="room", run=label, **r)
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    result: dict[str, Any] = {}
    if state is not None:
        video, audio = state.get("videos"), state.get("audio")
        result = dict(video_shape=list(video.shape), video_finite=bool(torch.isfinite(video).all()),
                      audio_shape=list(audio.shape) if audio is not None else None,
                      sampling_rate=state.get("sampling_rate"))
    out.row(section="run", run=label, ok=error is None, total_s=total, after_run_s=after_run_s, width=width,
            height=height, frames=frames, latent_frames=grid.latent_frames(frames), steps=args.steps,
            forwards=args.steps - 1, notes=notes + frame_notes, cap_gib=args.cap, preload=args.preload,
            ooms=stats.get("num_ooms", 0) - stats0.get("num_ooms", 0),
            alloc_retries=stats.get("num_alloc_retries", 0) - stats0.get("num_alloc_retries", 0),
            rss_gib=psutil.Process().memory_info().rss / GiB, rss_growth_gib=(psutil.Process().memory_info().rss - rss0) / GiB,
            pinned_gib=pinned_bytes() / GiB, device_after_gib=device_bytes(engine, pipe) / GiB,
            plan=streamer.details().get("plan", "") if streamer is not None else "", **start, **result)
    return error is None


def device_bytes(engine: Engine, pipe: Any) -> int:
    return engine.report(pipe).device_bytes


def recover(label: str, pipe: Any, engine: Engine, device: torch.device, out: Out) -> None:
    """After a failed call: the engine's sweep, then say what is still on the device that no transport
    accounts for (a module whose move in failed half way) and move it back by hand."""
    swept = engine.sweep([pipe])
    stray = {}
    if device.type == "cuda":
        for name, state in engine.states(pipe).items():
            t = state.transport
            if hasattr(t, "loaded") and not t.loaded:
                module = getattr(pipe, name)
                left = bytes_on(module, device)
                if left:
                    stray[name] = left / GiB
                    move_module(module, torch.device("cpu"))
        torch.cuda.empty_cache()
    out.row(section="recover", run=label, swept=list(swept.moved), sweep_failed=list(swept.failed),
            stray_on_device_gib=stray, moved_back_by_bench=bool(stray),
            free_gib=torch.cuda.mem_get_info(device)[0] / GiB if device.type == "cuda" else None)


# ------------------------------------------------------------------------------------------- output
def summary(rows: list[dict]) -> None:
    """The tables, last in the output (a tail of the log keeps them)."""
    by = lambda section: [r for r in rows if r["section"] == section]  # noqa: E731
    env = by("env")[0]
    cap = env["args"]["cap"]
    print(f"\n== H3 fl2va bench: {env['gpu'] or env['device']}, cap {cap} GiB free, torch {env['torch']}, "
          f"diffusers {env['diffusers']}, transformers {env['transformers']}")
    roles = {}
    for p in by("placement"):
        roles = p["components"]
        print(f"placed in {p['place_s']:.2f} s: {p['device_gib']:.2f} GiB on device, {p['pinned_gib']:.2f} GiB pinned, "
              f"RSS {p['rss_gib']:.1f} GiB")
    for b in by("build"):
        extra = {k: round(v, 3) if isinstance(v, float) else v for k, v in b.items()
                 if k in ("blocks", "block_gib", "non_block_gib", "layers", "layer_gib", "vision_blocks", "encoder_gib",
                          "decoder_gib")}
        role = roles.get(b["component"], {}).get("role", "?")
        size = gib(int(b["gib"] * GiB))
        print(f"  {b['component']:<13}{role:<10}{size:>11} {b['params_b'] * 1e3:>9.1f} M params  {extra}")
    for r in by("roles"):
        print(f"roles {'as expected' if r['ok'] else 'NOT as expected: ' + str(r['wrong'])}")
    for run in by("run"):
        label = run["run"]
        status = "ok" if run["ok"] else "FAILED"
        print(f"\n-- run {label}: {status}, {run['total_s']:.2f} s, {run['width']}x{run['height']}, {run['frames']} frames "
              f"({run['latent_frames']} latent), {run['forwards']} forwards; OOMs {run['ooms']}, allocator retries "
              f"{run['alloc_retries']}; memory_required {run['memory_required_gib']:.2f} GiB; "
              f"on device at start {run['device_at_start_gib']:.2f} GiB")
        for e in [e for e in by("error") if e["run"] == label]:
            print(f"   error in {e['stage']}: {e['error'][:300]}")
        print(f"   {'stage':<14}{'s':>9}{'units':>7}{'peak alloc':>12}{'peak resv':>11}{'alloc start->end GiB':>22}")
        for st in [x for x in by("stage") if x["run"] == label]:
            print(f"   {st['stage']:<14}{st['seconds']:>9.3f}{st['units']:>7}{st['peak_alloc_gib']:>12.2f}"
                  f"{st['peak_reserved_gib']:>11.2f}{st['alloc_start_gib']:>12.2f} -> {st['alloc_end_gib']:.2f}")
        for st in [x for x in by("step") if x["run"] == label]:
            print(f"   denoise step {st['step']}/{st['of']}: {st['seconds']:.3f} s, peak {st['peak_alloc_gib']:.2f} GiB, "
                  f"kept {st['kept']}/{st['blocks']}, streamed {st['streamed_gib']:.2f} GiB/step  [{st['plan']}]")
        for m in [x for x in by("move") if x["run"] == label]:
            gbs = f"{m['gbs']:.1f} GB/s" if m["gbs"] else "-"
            print(f"   move {m['component']:<9} {m['direction']:<3} ({m['stage']}) {m['seconds']:.3f} s, {m['gib']:.2f} GiB, "
                  f"{gbs}{'' if m['ok'] else '  FAILED'}")
        for r in [x for x in by("room") if x["run"] == label]:
            print(f"   room before {r['component']} ({r['stage']}): short {r['short_gib']:.2f} GiB, give_back freed "
                  f"{r['freed_gib']:.2f} GiB in {r['seconds']:.3f} s")
        for r in [x for x in by("recover") if x["run"] == label]:
            print(f"   recovered: swept {r['swept']}, stray on device {r['stray_on_device_gib']}")
    for r in by("release"):
        print(f"\nreleased in {r['seconds']:.2f} s, pinned left {r['pinned_gib']:.2f} GiB, RSS {r['rss_gib']:.1f} GiB")


def check_roles(report, out: Out) -> bool:
    roles = {c.name: c.role for c in report.components}
    wrong = {n: roles.get(n) for n, want in ROLES.items() if roles.get(n) != want}
    out.row(section="roles", roles=roles, expected=ROLES, ok=not wrong, wrong=wrong)
    return not wrong


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the suite's tiny configs (CPU smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--blocks", type=int, default=None, help="transformer blocks (of 50); default 10, tiny 2")
    ap.add_argument("--te-layers", type=int, default=4, help="text-encoder decoder layers (of 64)")
    ap.add_argument("--cap", type=float, default=None, help="GiB left free by the ballast; default 12 (cuda)")
    ap.add_argument("--width", type=int, default=None, help="default 768 (tiny 32)")
    ap.add_argument("--height", type=int, default=None, help="default 448 (tiny 32)")
    ap.add_argument("--frames", type=int, default=124, help="17n+5 within 5-15 s at 24 fps: 124 is the shortest")
    ap.add_argument("--steps", type=int, default=None, help="H3 grid points: steps-1 forwards; default 4 (tiny 3)")
    ap.add_argument("--preload", default="auto")
    ap.add_argument("--whole-blocks", action="store_true", help="the transformer's blocks stream whole")
    ap.add_argument("--runs", default="plain,room", help="plain: engine alone; room: bench frees room first")
    ap.add_argument("--headroom", type=float, default=1.0, help="GiB asked beside an on-demand module (room runs)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", default="a red robot walks through a rainy neon street at night, rain sounds")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.blocks = args.blocks or (2 if tiny else 10)
    args.width = args.width or (32 if tiny else 768)
    args.height = args.height or (32 if tiny else 448)
    args.steps = args.steps or (3 if tiny else 4)
    if args.cap is None and args.device.startswith("cuda"):
        args.cap = 12.0
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Out(args.json)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    import diffusers
    import transformers

    out.row(section="env", device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            torch=torch.__version__, diffusers=diffusers.__version__, transformers=transformers.__version__,
            host_total_gib=psutil.virtual_memory().total / GiB, tiny=args.tiny, args=vars(args),
            h2d_pinned_gbs=wan_bench.h2d_bandwidth() / 1e9 if device.type == "cuda" else None)
    t0 = time.perf_counter()
    pipe = build(args, out, device, dtype)
    out.row(section="built", seconds=time.perf_counter() - t0, rss_gib=psutil.Process().memory_info().rss / GiB)

    ballast = wan_bench.Ballast(args.cap) if device.type == "cuda" else None
    tracker = PeakTracker(device)
    engine = Engine(memory=TrackingReader(tracker))
    config = OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, preload=args.preload,
                           stream_parts=not args.whole_blocks,
                           device=None if device.type == "cuda" else str(device))
    try:
        free0 = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        t0 = time.perf_counter()
        report = engine.place(pipe, config)
        place_s = time.perf_counter() - t0
        out.row(section="placement", place_s=place_s, cap_gib=args.cap, free_before_gib=free0 / GiB,
                free_after_gib=torch.cuda.mem_get_info(device)[0] / GiB if device.type == "cuda" else None,
                device_gib=report.device_bytes / GiB, pinned_gib=report.pinned_bytes / GiB,
                rss_gib=psutil.Process().memory_info().rss / GiB,
                components={c.name: dict(role=c.role, gib=c.nbytes / GiB, device_gib=c.device_bytes / GiB,
                                         pinned_gib=c.pinned_bytes / GiB, reason=c.reason,
                                         details={k: v for k, v in c.details.items() if k != "lora"})
                            for c in report.components})
        check_roles(report, out)
        for n, kind in enumerate([r.strip() for r in args.runs.split(",") if r.strip()], start=1):
            if kind not in ("plain", "room"):
                raise SystemExit(f"--runs takes plain and room, got {kind!r}")
            run_once(f"{n}-{kind}", pipe, engine, tracker, args, out)
        print(engine.report(pipe).text())  # after the runs: kept blocks, moves per on-demand module
    finally:
        t0 = time.perf_counter()
        engine.release(pipe)
        release_s = time.perf_counter() - t0
        if ballast is not None:
            ballast.close()
    out.row(section="release", seconds=release_s, pinned_gib=pinned_bytes() / GiB,
            rss_gib=psutil.Process().memory_info().rss / GiB)
    summary(out.rows)


if __name__ == "__main__":
    main()
