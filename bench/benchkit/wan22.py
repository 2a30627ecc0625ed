"""Wan 2.2 A14B, two denoisers, for wan22_node.py: the pipeline folder at 14B width and reduced depth,
the resident step of each denoiser, and a clock that times every denoiser forward inside a ComfyUI run
with the engine's stream figures beside it, then checks each denoiser's step against its bound.

Nothing here imports torch at module level: ComfyUI's start-up must import it first (its
``cuda_malloc`` picks the allocator).
"""

from __future__ import annotations

import logging
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import GB, GiB, fixtures

DENOISERS = ("transformer", "transformer_2")  # above the boundary timestep, below it
BOUNDARY = 0.875  # Wan2.2-T2V-A14B's boundary_ratio
SHIFT = 12.0  # Wan2.2-T2V-A14B's sample shift (its UniPC scheduler's flow_shift)
TEXT_LAYERS = 2  # of UMT5-XXL's 24 encoder layers, at its real width and vocabulary
TOLERANCE = 1.05  # issue 24: a denoiser's step within 1.05 x its bound
log = logging.getLogger("bench")


# -- the folder, written by a process of its own ------------------------------------------------
def write_pipeline(pipe_dir: Path, layers: int, tiny: bool, device: str) -> dict[str, Any]:
    """A Wan 2.2 T2V-A14B diffusers folder: ``transformer`` and ``transformer_2`` at the 14B width
    with ``layers`` blocks each (seeds 0 and 1), ``boundary_ratio`` 0.875, UMT5-XXL with
    ``TEXT_LAYERS`` layers, the Wan 2.1 VAE at its real config, UniPC on flow sigmas, the suite's
    code-built T5 tokenizer (its ids fit UMT5's vocabulary; no tokenizer files needed). Random bf16
    weights made on ``device``. ``tiny``: the suite's tiny T2V-A14B fixture (tests/fixtures)."""
    import torch

    fixtures()
    t0 = time.perf_counter()
    if pipe_dir.exists():
        shutil.rmtree(pipe_dir)
    if tiny:
        from fixtures.tiny_wan_families import A14B_BOUNDARY, build_tiny_wan22_a14b

        build_tiny_wan22_a14b(pipe_dir)
        return {
            "device": "cpu",
            "geometry": "tests/fixtures tiny Wan 2.2 T2V-A14B",
            "boundary_ratio": A14B_BOUNDARY,
            "build_s": round(time.perf_counter() - t0, 2),
        }
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from fixtures.meta_models import UMT5_XXL_ENCODER
    from fixtures.tiny_tok import tiny_t5_tokenizer
    from transformers import UMT5Config, UMT5EncoderModel

    from .models import cast_like_from_pretrained, nbytes, wan_config

    def made(seed: int, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        torch.manual_seed(seed)
        with torch.device(device):
            return cast_like_from_pretrained(make(), torch.bfloat16)

    parts = {
        "transformer": made(0, lambda: WanTransformer3DModel(**wan_config(layers))),
        "transformer_2": made(1, lambda: WanTransformer3DModel(**wan_config(layers))),
        "text_encoder": made(
            2, lambda: UMT5EncoderModel(UMT5Config(**dict(UMT5_XXL_ENCODER, num_layers=TEXT_LAYERS)))
        ),
        "vae": made(3, AutoencoderKLWan),
    }
    sizes = {name: round(nbytes(m) / GiB, 3) for name, m in parts.items()}
    built = time.perf_counter() - t0
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=SHIFT
    )
    WanPipeline(
        tokenizer=tiny_t5_tokenizer(), scheduler=scheduler, boundary_ratio=BOUNDARY, **parts
    ).save_pretrained(pipe_dir)
    return {
        "device": device,
        "geometry": f"Wan 2.2 T2V-A14B, 14B width, {layers} blocks each",
        "gib": sizes,
        "boundary_ratio": BOUNDARY,
        "flow_shift": SHIFT,
        "text_layers": TEXT_LAYERS,
        "build_s": round(built, 2),
        "write_s": round(time.perf_counter() - t0 - built, 2),
    }


# -- the resident step, in a process of its own -------------------------------------------------
def latent_shape(width: int, height: int, frames: int) -> tuple[int, ...]:
    """What WanPipeline feeds a denoiser: 16 channels, x4 in time (4n+1 frames), x8 in space."""
    return (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)


def resident_steps(
    pipe_dir: Path, shape: tuple[int, ...], device: str, warmup: int = 2, repeats: int = 3
) -> dict[str, dict[str, Any]]:
    """Each denoiser loaded whole on ``device`` (bf16 on a GPU, fp32 on the CPU, as the node loads it)
    and timed on the run's shapes: latents ``shape``, 512 text states (the pipeline pads to 512),
    a timestep on its side of the boundary. Median of ``repeats`` after ``warmup``."""
    import torch
    from diffusers import WanTransformer3DModel

    from .measure import timed
    from .models import nbytes, wan_forward

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out: dict[str, dict[str, Any]] = {}
    for name, t in zip(DENOISERS, (950.0, 500.0), strict=True):
        m = (
            WanTransformer3DModel.from_pretrained(str(pipe_dir), subfolder=name, dtype=dtype)
            .to(device)
            .eval()
        )
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(shape, generator=g, device=device, dtype=dtype)
        enc = torch.randn((1, 512, m.config.text_dim), generator=g, device=device, dtype=dtype)
        step = torch.full((1,), t, device=device)
        med, runs, _ = timed(
            lambda m=m, x=x, enc=enc, step=step: wan_forward(m, x, enc, step), warmup, repeats
        )
        out[name] = {
            "median_s": med,
            "runs": [round(r, 5) for r in runs],
            "weights_gib": round(nbytes(m) / GiB, 3),
        }
        del m, x, enc
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


# -- every denoiser forward inside the ComfyUI run ----------------------------------------------
class DenoiserClock:
    """Times every call of a Wan denoiser (class-level ``__call__``: outside every hook the engine
    puts on the instance, so a switch's give-back and plan are in the step) and reads, after it, the
    streamer's figures for that denoiser: bytes streamed per step, kept bytes, sync loads and OOMs
    the engine met (both cumulative), and the allocator's OOMs and flush-and-retries during it.
    ``resolve(module)`` names the denoiser and gives its transport (None when unknown)."""

    def __init__(self, torch, cuda: bool, resolve: Callable[[Any], tuple[str, Any]]) -> None:
        self.torch, self.cuda, self.resolve = torch, cuda, resolve
        self.forwards: list[dict[str, Any]] = []
        self.run = 0

    def counts(self) -> tuple[int, int]:
        if not self.cuda:
            return 0, 0
        s = self.torch.cuda.memory_stats()
        return int(s.get("num_ooms", 0)), int(s.get("num_alloc_retries", 0))

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def install(self) -> None:
        from diffusers import WanTransformer3DModel

        base_call, clock = self.torch.nn.Module.__call__, self

        def __call__(module, *args, **kwargs):
            clock.sync()
            before, t0 = clock.counts(), time.perf_counter()
            out = base_call(module, *args, **kwargs)
            clock.sync()
            clock.record(module, time.perf_counter() - t0, before)
            return out

        WanTransformer3DModel.__call__ = __call__

    def record(self, module: Any, seconds: float, before: tuple[int, int]) -> None:
        name, transport = self.resolve(module)
        details = transport.details() if transport is not None and hasattr(transport, "details") else {}
        ooms, retries = self.counts()
        self.forwards.append(
            {
                "section": "forward",
                "run": self.run,
                "denoiser": name,
                "seconds": seconds,
                "streamed_bytes": int(details.get("streamed_per_step", 0) or 0),
                "kept_bytes": int(details.get("kept_bytes", 0) or 0),
                "kept_pieces": details.get("kept_pieces"),
                "pieces": details.get("pieces"),
                "sync_loads_total": details.get("sync_loads"),
                "engine_ooms_total": details.get("ooms"),
                "side_stream": details.get("stream"),
                "alloc_ooms": ooms - before[0],
                "alloc_retries": retries - before[1],
            }
        )

    def of(self, run: int, name: str) -> list[dict[str, Any]]:
        return [f for f in self.forwards if f["run"] == run and f["denoiser"] == name]


def resolver(engine, mm) -> Callable[[Any], tuple[str, Any]]:
    """``module -> (denoiser name, its transport)``, through the pipeline ComfyUI holds loaded
    (``mm.current_loaded_models``) and ``engine``, the one ComfyUI's copy of the pack places with."""
    known: dict[int, tuple[str, Any]] = {}

    def resolve(module) -> tuple[str, Any]:
        if id(module) not in known:
            for pipe in _loaded_pipes(mm):
                for name in DENOISERS:
                    if getattr(pipe, name, None) is module:
                        state = engine.states(pipe).get(name)
                        known[id(module)] = (name, state.transport if state is not None else None)
        return known.get(id(module), ("?", None))

    return resolve


def decode_ooms(engine, mm) -> Callable[[], int]:
    """``() -> out-of-memory errors`` the loaded pipeline's resident VAE met in its encode/decode
    calls so far (each run again by the engine after a give-back: `Workspace`)."""

    def count() -> int:
        for pipe in _loaded_pipes(mm):
            state = engine.states(pipe).get("vae")
            if state is not None:
                return int(state.transport.details().get("ooms", 0))
        return 0

    return count


def _loaded_pipes(mm) -> Iterator[Any]:
    """The pipelines ComfyUI holds loaded (``mm.current_loaded_models``) through the pack's model."""
    for lm in mm.current_loaded_models:
        pipe = getattr(getattr(getattr(lm, "model", None), "model", None), "pipe", None)
        if pipe is not None:
            yield pipe


def _grew(rows: list[dict[str, Any]], key: str, start: int | None) -> int | None:
    """How much a cumulative count grew over ``rows`` (from ``start``, its value before them)."""
    vals = [r[key] for r in rows if r[key] is not None]
    if not vals:
        return None
    return vals[-1] - (start if start is not None else vals[0])


def denoiser_row(
    clock: DenoiserClock, run: int, name: str, resident_s: float | None, h2d: float | None
) -> dict[str, Any]:
    """One denoiser over run ``run``: its step (median forward), first and steady forwards, the
    bound max(resident step, streamed bytes / pinned H2D), the ratios, kept bytes, OOMs, retries."""
    rows, earlier = (
        clock.of(run, name),
        [f for f in clock.forwards if f["run"] < run and f["denoiser"] == name],
    )
    row: dict[str, Any] = {"section": "denoiser", "run": run, "denoiser": name, "forwards": len(rows)}
    if not rows:
        return dict(row, ok=False, verdict="did not run")
    secs = [f["seconds"] for f in rows]
    streamed = statistics.median(f["streamed_bytes"] for f in rows)
    copy_s = streamed / h2d if h2d else None
    bound = max(x for x in (resident_s, copy_s) if x is not None) if (resident_s or copy_s) else None
    step = statistics.median(secs)
    steady = statistics.median(secs[1:]) if len(secs) > 1 else step
    prev = earlier[-1] if earlier else {}
    row.update(
        step_s=step,
        first_s=secs[0],
        steady_s=steady,
        worst_s=max(secs),
        forward_s=[round(s, 5) for s in secs],
        resident_s=resident_s,
        streamed_gib=streamed / GiB,
        copy_bound_s=copy_s,
        bound_s=bound,
        kept_gib=rows[-1]["kept_bytes"] / GiB,
        kept_pieces=rows[-1]["kept_pieces"],
        pieces=rows[-1]["pieces"],
        sync_loads=_grew(rows, "sync_loads_total", prev.get("sync_loads_total")),
        engine_ooms=_grew(rows, "engine_ooms_total", prev.get("engine_ooms_total")),
        alloc_ooms=sum(f["alloc_ooms"] for f in rows),
        alloc_retries=sum(f["alloc_retries"] for f in rows),
    )
    for key in ("step", "first", "steady", "worst"):
        row[f"{key}_ratio"] = row[f"{key}_s"] / bound if bound else None
    row["ok"] = row["step_ratio"] is not None and row["step_ratio"] <= TOLERANCE
    row["verdict"] = "ok" if row["ok"] else (f"EXCEEDS {TOLERANCE} x bound" if bound else "no bound")
    return row


def verdict_lines(rows: list[dict[str, Any]], alloc_ooms: int, engine_ooms: int, cpu: bool) -> list[str]:
    """The plain statements the issue asks for, one per denoiser and one for OOMs (the allocator's
    over both runs, and those the engine met and recovered)."""
    lines = []
    for r in rows:
        if not r["forwards"]:
            lines.append(f"{r['denoiser']}: DID NOT RUN in run {r['run']} (check --steps and the boundary)")
            continue
        state = "within" if r["ok"] else "EXCEEDS"
        lines.append(
            f"{r['denoiser']}: step {r['step_s']:.4f} s = {_x(r['step_ratio'])} x bound {_s(r['bound_s'])} s: "
            f"{state} {TOLERANCE} x (first forward {_x(r['first_ratio'])} x, steady {_x(r['steady_ratio'])} x)"
        )
    zero = alloc_ooms == 0 and engine_ooms == 0
    lines.append(
        f"OOMs: allocator {alloc_ooms}, met by the engine {engine_ooms}: {'zero' if zero else 'NOT ZERO'}"
    )
    if cpu:
        lines.append("CPU run: checks the flow only; no H2D bound, the times say nothing about the GPU")
    return lines


def print_table(rows: list[dict[str, Any]], h2d: float | None) -> None:
    """The per-denoiser table of the timed run."""
    print(
        f"pinned H2D {f'{h2d / GB:.1f} GB/s' if h2d else 'n/a (CPU)'}; bound = max(resident step, streamed / H2D); "
        f"step = median forward of the run"
    )
    head = (
        f"{'denoiser':<14}{'fwd':>4}{'step s':>9}{'first s':>9}{'worst s':>9}{'resid. s':>9}{'strm GiB':>9}"
        f"{'copy s':>8}{'bound s':>9}{'step/b':>7}{'first/b':>8}{'kept GiB':>9}{'sync':>5}{'OOM a/e':>8}"
        f"{'retry':>6}  verdict"
    )
    print(head)
    for r in rows:
        if not r["forwards"]:
            print(f"{r['denoiser']:<14}{0:>4}  -- did not run --")
            continue
        print(
            f"{r['denoiser']:<14}{r['forwards']:>4}{r['step_s']:>9.4f}{r['first_s']:>9.4f}{r['worst_s']:>9.4f}"
            f"{_s(r['resident_s']):>9}{r['streamed_gib']:>9.3f}{_s(r['copy_bound_s']):>8}{_s(r['bound_s']):>9}"
            f"{_x(r['step_ratio']):>7}{_x(r['first_ratio']):>8}{r['kept_gib']:>9.3f}{_n(r['sync_loads']):>5}"
            f"{_n(r['alloc_ooms']) + '/' + _n(r['engine_ooms']):>8}{r['alloc_retries']:>6}  {r['verdict']}"
        )


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _n(x: int | None) -> str:
    return "-" if x is None else str(x)
