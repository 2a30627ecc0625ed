"""MiniMax-H3 fl2va at full width and reduced depth (random bf16 weights) through the engine under a VRAM cap.

One fl2va generation (first and last keyframe, audio on) on an H3-geometry ``MiniMaxH3ModularPipeline``
(``benchkit.models.build_h3``: the transformer at the H3-33B width with ``--blocks`` of its 50 blocks
of 1.20 GiB, Qwen3-VL with ``--te-layers`` of 64 layers, both VAEs at their real configs) placed by
the engine with every role offloaded (``on_demand_threshold_gb=0``): text encoder leaf groups,
denoiser block streaming with preload ``--preload``, both VAEs on demand. A ballast process leaves
``--cap`` GiB free. ``--tiny`` swaps in the test suite's tiny configs (CPU smoke run).
``--storage fp8_e4m3fn`` builds the transformer and the text encoder directly in fp8 (per-tensor
scales, marked as the loader marks an fp8_scaled file: ``benchkit.h3_fp8``), so that full depth
(50 blocks, 64 text layers: ~130 GB in bf16) fits the host; the host rows give RSS after build and
after placement and its peak (``ru_maxrss``) over the storage bytes (target: at most 1.1).

Stages come from the engine's own stage hooks (``offload_core.run.stages.StageHooks``, installed as
``nodes/h3.py`` installs them, with ``run_view`` and ``pad_short_latents``), timed and peaked by
``benchkit.stages``. Three boundaries are added so that a whole-module move lands in the stage that
caused it: the VAEs' ``encode``/``decode`` and the text encoder's inner ``model`` call announce
their stage *before* the on-demand transport moves the module in, and hand back to ``other`` when
they return. The on-demand transports' ``onload``/``offload`` are timed (move in/out rows).

Runs (``--runs``, default ``plain,room``): ``plain`` is the engine alone; ``reprompt`` the same with a
prompt of its own (the text encoder runs again, warm; a second ``reprompt`` has a prompt of the
same length, so its kernels are warm for that shape too); ``room`` is the same call with
the bench acting as a host memory manager: before an on-demand module moves in, if the device lacks its
bytes plus ``--headroom``, it asks ``Engine.give_back`` for the difference (kept denoiser blocks go, as
ComfyUI's ``partially_unload`` would make them). A run that fails (OOM or other) is recorded with the
stage it failed in, the engine's ``after_run`` is called, and the next run goes on.

    python bench/h3_bench.py --runs plain --out $OUT                  # H200: 10 blocks, 12 GiB cap
    python bench/h3_bench.py --blocks 50 --te-layers 64 --cap 24 --storage fp8_e4m3fn --runs plain --out $OUT
    python bench/h3_bench.py --tiny --device cpu --json /tmp/h3.jsonl  # CPU smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import resource
import time
import traceback
from typing import Any

import numpy as np
import psutil
import torch
from benchkit import GB, GiB, Rows, open_output, output_args, pack
from benchkit.h3_fp8 import fp8_builder
from benchkit.measure import Ballast, h2d_bandwidth, sync
from benchkit.models import build_h3, h3_geometry, nbytes
from benchkit.stages import OTHER, Instruments, PeakTracker, StageClock, TrackingReader
from PIL import Image

pack()
from diffusers_offload.offload_core import Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core.formats.fp8 import FP8_DTYPES, table_of  # noqa: E402
from diffusers_offload.offload_core.models.minimax_h3 import grid as grid_rules  # noqa: E402
from diffusers_offload.offload_core.models.minimax_h3.conditioner import trim_conditioner  # noqa: E402
from diffusers_offload.offload_core.models.minimax_h3.run_view import pad_short_latents, run_view  # noqa: E402
from diffusers_offload.offload_core.pinning import pinned_bytes  # noqa: E402
from diffusers_offload.offload_core.run.stages import (  # noqa: E402
    DENOISE,
    IMAGE,
    VIDEO,
    StageHooks,
    StageHost,
)

ROLES = {"text_encoder": "leaf", "transformer": "per-step", "vae": "on-demand", "audio_vae": "on-demand"}
log = logging.getLogger("h3_bench")


def keyframes(width: int, height: int) -> dict[str, Image.Image]:
    """Two seeded noise pictures at the canvas size (a flat colour would make the VAE's job trivial)."""
    rng = np.random.default_rng(0)
    pics = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(2)]
    return {"image": pics[0], "last_image": pics[1]}


def run_once(label: str, pipe: Any, engine: Engine, tracker: PeakTracker, args, out: Rows) -> bool:
    """One generation; ``label`` is ``<n>-plain``, ``<n>-room`` or ``<n>-reprompt`` (plain with a
    prompt of its own: the text encoder runs again in a warm process)."""
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
    # "take <run number>": two reprompt runs have prompts of one length (the second's kernels warm for it)
    prompt = f"{args.prompt}, take {label.split('-')[0]}" if label.endswith("-reprompt") else args.prompt
    kwargs = dict(prompt=prompt, height=height, width=width, num_frames=frames, num_inference_steps=args.steps,
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
        profile = cProfile.Profile() if label.split("-")[0] in args.profile.split(",") else None
        with StageHooks(pipe, StageHost(clock.on_stage, lambda: None), totals), pad_short_latents(vae):
            state = view(**kwargs) if profile is None else profile.runcall(view, **kwargs)
        if profile is not None:  # where the host's time went (the text encode's wait before its first layer)
            pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
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
            sync()
        except Exception as exc:  # reported; the next run is still tried
            out(section="error", run=label, stage="after_run", error=f"{type(exc).__name__}: {str(exc)[:400]}",
                trace=traceback.format_exc(limit=-6)[-2000:])
        after_run_s = time.perf_counter() - t1
    if error is not None:
        out(section="error", run=label, **error)
        recover(label, pipe, engine, device, out)
    for s in clock.stages():
        out(section="stage", run=label, stage=s["stage"], seconds=s["seconds"], units=s["units"],
            segments=s["segments"], peak_alloc_gib=s["peak_alloc"] / GiB, peak_reserved_gib=s["peak_reserved"] / GiB,
            alloc_start_gib=s["alloc_start"] / GiB, alloc_end_gib=s["alloc_end"] / GiB, cap_gib=args.cap,
            alloc_retries=s["alloc_retries"], **{k: v for k, v in s.items() if k.endswith("_s") or k == "slowest_layers"})
    for s in clock.steps:
        out(section="step", run=label, **s)
    for m in clock.moves:
        out(section="move", run=label, **m)
    for r in clock.rooms:
        out(section="room", run=label, **r)
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    result: dict[str, Any] = {}
    if state is not None:
        video, audio = state.get("videos"), state.get("audio")
        result = dict(video_shape=list(video.shape), video_finite=bool(torch.isfinite(video).all()),
                      audio_shape=list(audio.shape) if audio is not None else None,
                      sampling_rate=state.get("sampling_rate"))
    out(section="run", run=label, ok=error is None, total_s=total, after_run_s=after_run_s, width=width,
        height=height, frames=frames, latent_frames=grid.latent_frames(frames), steps=args.steps,
        forwards=args.steps - 1, notes=notes + frame_notes, cap_gib=args.cap, preload=args.preload,
        ooms=stats.get("num_ooms", 0) - stats0.get("num_ooms", 0),
        alloc_retries=stats.get("num_alloc_retries", 0) - stats0.get("num_alloc_retries", 0),
        rss_growth_gib=(psutil.Process().memory_info().rss - rss0) / GiB, **host(args.storage_bytes),
        pinned_gib=pinned_bytes() / GiB, device_after_gib=device_bytes(engine, pipe) / GiB,
        plan=streamer.details().get("plan", "") if streamer is not None else "", **start, **result)
    return error is None


def host(storage: int) -> dict[str, float]:
    """Host RSS now and its peak so far (``ru_maxrss``: the build included), in GiB and over
    ``storage``, the bytes of the pipeline's weights as stored."""
    rss, peak = psutil.Process().memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(rss_gib=rss / GiB, rss_peak_gib=peak / GiB, storage_gib=storage / GiB,
                rss_over_storage=rss / storage, peak_over_storage=peak / storage)


def device_bytes(engine: Engine, pipe: Any) -> int:
    return engine.report(pipe).device_bytes


def recover(label: str, pipe: Any, engine: Engine, device: torch.device, out: Rows) -> None:
    """After a failed call: the engine's sweep, then say what is still on the device that no transport
    accounts for (a module whose move in failed half way) and move it back by hand."""
    swept = engine.sweep([pipe])
    stray = {}
    if device.type == "cuda":
        for name, state in engine.states(pipe).items():
            t = state.transport
            if hasattr(t, "loaded") and not t.loaded:
                module = getattr(pipe, name)
                left = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers())
                           if t.device == device)
                if left:
                    stray[name] = left / GiB
                    module.to("cpu")
        torch.cuda.empty_cache()
    out(section="recover", run=label, swept=list(swept.moved), sweep_failed=list(swept.failed),
        stray_on_device_gib=stray, moved_back_by_bench=bool(stray),
        free_gib=torch.cuda.mem_get_info(device)[0] / GiB if device.type == "cuda" else None)


# ------------------------------------------------------------------------------------------- output
def summary(rows: list[dict]) -> None:
    """The tables, last in the output (a tail of the log keeps them)."""
    by = lambda section: [r for r in rows if r["section"] == section]  # noqa: E731
    env = by("env")[0]
    cap = env["args"]["cap"]
    print(f"\n== H3 fl2va bench: {env['gpu'] or env['device']}, cap {cap} GiB free, torch {env['torch']}, "
          f"diffusers {env['diffusers']}, transformers {env['transformers']}, storage {env['args']['storage']}")
    roles = {}
    for p in by("placement"):
        roles = p["components"]
        print(f"placed in {p['place_s']:.2f} s: {p['device_gib']:.2f} GiB on device, {p['pinned_gib']:.2f} GiB pinned, "
              f"RSS {p['rss_gib']:.1f} GiB")
    keys = ("blocks", "block_gib", "non_block_gib", "layers", "layer_gib", "vision_blocks", "encoder_gib", "decoder_gib")
    for b in by("build"):
        extra = {k: round(v, 3) if isinstance(v, float) else v for k, v in b.items() if k in keys}
        print(f"  {b['component']:<13}{roles.get(b['component'], {}).get('role', '?'):<10}{b['gib']:>7.2f} GiB "
              f"{b['params_b'] * 1e3:>9.1f} M params  {'/'.join(b['dtypes'])}, {b['fp8_layers']} fp8 layers  {extra}")
    for h in [*by("built"), *by("placement")]:
        print(f"host after {'placement' if 'place_s' in h else 'build'}: RSS {h['rss_gib']:.2f} GiB = "
              f"{h['rss_over_storage']:.3f} x storage {h['storage_gib']:.2f} GiB; peak {h['rss_peak_gib']:.2f} GiB = "
              f"{h['peak_over_storage']:.3f} x (target <= 1.1)")
    for r in by("roles"):
        print(f"roles {'as expected' if r['ok'] else 'NOT as expected: ' + str(r['wrong'])}")
    for run in by("run"):
        label = run["run"]
        print(f"\n-- run {label}: {'ok' if run['ok'] else 'FAILED'}, {run['total_s']:.2f} s, {run['width']}x{run['height']}, {run['frames']} frames "
              f"({run['latent_frames']} latent), {run['forwards']} forwards; OOMs {run['ooms']}, allocator retries "
              f"{run['alloc_retries']}; memory_required {run['memory_required_gib']:.2f} GiB; "
              f"on device at start {run['device_at_start_gib']:.2f} GiB; RSS {run['rss_gib']:.2f} GiB "
              f"({run['rss_over_storage']:.3f} x storage), peak {run['peak_over_storage']:.3f} x")
        for e in [e for e in by("error") if e["run"] == label]:
            print(f"   error in {e['stage']}: {e['error'][:300]}")
        print(f"   {'stage':<14}{'s':>9}{'units':>7}{'peak alloc':>12}{'peak resv':>11}{'alloc start->end GiB':>22}")
        for st in [x for x in by("stage") if x["run"] == label]:
            print(f"   {st['stage']:<14}{st['seconds']:>9.3f}{st['units']:>7}{st['peak_alloc_gib']:>12.2f}"
                  f"{st['peak_reserved_gib']:>11.2f}{st['alloc_start_gib']:>12.2f} -> {st['alloc_end_gib']:.2f}")
            if "before_layers_s" in st:  # GPU time: head and vision, then the layers
                print(f"      before the first layer {st['before_layers_s']:.3f} s, layers {st['layers_s']:.3f} s "
                      f"(median {st['layer_median_s'] * 1e3:.1f} ms, max {st['layer_max_s'] * 1e3:.1f} ms), "
                      f"after the last {st['after_last_layer_s']:.3f} s; slowest layers {st.get('slowest_layers')}, "
                      f"allocator retries {st.get('alloc_retries')}")
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
        print(f"\nreleased in {r['seconds']:.2f} s, pinned left {r['pinned_gib']:.2f} GiB, RSS {r['rss_gib']:.1f} GiB, "
              f"peak {r['peak_over_storage']:.3f} x storage")


def check_roles(report, out: Rows) -> bool:
    roles = {c.name: c.role for c in report.components}
    wrong = {n: roles.get(n) for n, want in ROLES.items() if roles.get(n) != want}
    out(section="roles", roles=roles, expected=ROLES, ok=not wrong, wrong=wrong)
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
    ap.add_argument("--whole-conditioner", action="store_true",
                    help="keep the text encoder's layers after the one H3 reads (the loader drops them)")
    ap.add_argument("--runs", default="plain,room", help="plain: engine alone; room: bench frees room first")
    ap.add_argument("--profile", default="", help="run numbers to profile with cProfile (e.g. 1,2)")
    ap.add_argument("--headroom", type=float, default=1.0, help="GiB asked beside an on-demand module (room runs)")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype")
    ap.add_argument("--storage", choices=("bf16", *FP8_DTYPES), default="bf16",
                    help="fp8_*: the transformer's and text encoder's Linear weights built directly in fp8 (scaled)")
    ap.add_argument("--prompt", default="a red robot walks through a rainy neon street at night, rain sounds")
    output_args(ap)
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
    out = open_output(args, "h3_bench" if args.storage == "bf16" else f"h3_bench_{args.storage}", lines=True)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, args.dtype)
    import diffusers
    import transformers

    out(section="env", device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__, diffusers=diffusers.__version__, transformers=transformers.__version__,
        host_total_gib=psutil.virtual_memory().total / GiB, tiny=args.tiny, args=vars(args),
        h2d_pinned_gbs=h2d_bandwidth() / GB if device.type == "cuda" else None)
    t0 = time.perf_counter()

    def built(name: str, model: torch.nn.Module, build_s: float, host_s: float) -> None:
        out(section="build", component=name, cls=type(model).__name__, gib=nbytes(model) / GiB,
            params_b=sum(p.numel() for p in model.parameters()) / 1e9, build_s=build_s, to_host_s=host_s,
            dtypes=sorted({str(t.dtype).removeprefix("torch.") for t in model.parameters()}),
            fp8_layers=len(table.weights) if (table := table_of(model)) is not None else 0,
            **h3_geometry(name, model), rss_gib=psutil.Process().memory_info().rss / GiB)

    storage = FP8_DTYPES.get(args.storage)
    other = fp8_builder(device, dtype, storage) if storage is not None else None
    pipe = build_h3(args.tiny, args.blocks, args.te_layers, device, dtype, built, other)
    dropped = 0 if args.whole_conditioner else trim_conditioner(pipe)  # as Load modular pipeline does
    args.storage_bytes = sum(nbytes(getattr(pipe, name)) for name in ROLES)
    out(section="pipeline", cls=type(pipe).__name__, workflow="fl2va", text_encoder_layer=pipe.text_encoder_layer,
        text_layers_dropped=dropped, total_gib=args.storage_bytes / GiB, storage=args.storage)
    out(section="built", seconds=time.perf_counter() - t0, **host(args.storage_bytes))

    ballast = Ballast(args.cap) if device.type == "cuda" else None
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
        out(section="placement", place_s=place_s, cap_gib=args.cap, free_before_gib=free0 / GiB,
            free_after_gib=torch.cuda.mem_get_info(device)[0] / GiB if device.type == "cuda" else None,
            device_gib=report.device_bytes / GiB, pinned_gib=report.pinned_bytes / GiB,
            **host(args.storage_bytes),
            components={c.name: dict(role=c.role, gib=c.nbytes / GiB, device_gib=c.device_bytes / GiB,
                                     pinned_gib=c.pinned_bytes / GiB, reason=c.reason,
                                     details={k: v for k, v in c.details.items() if k != "lora"})
                        for c in report.components})
        check_roles(report, out)
        for n, kind in enumerate([r.strip() for r in args.runs.split(",") if r.strip()], start=1):
            if kind not in ("plain", "room", "reprompt"):
                raise SystemExit(f"--runs takes plain, room and reprompt, got {kind!r}")
            run_once(f"{n}-{kind}", pipe, engine, tracker, args, out)
        print(engine.report(pipe).text())  # after the runs: kept blocks, moves per on-demand module
    finally:
        t0 = time.perf_counter()
        engine.release(pipe)
        release_s = time.perf_counter() - t0
        if ballast is not None:
            ballast.close()
    out(section="release", seconds=release_s, pinned_gib=pinned_bytes() / GiB, **host(args.storage_bytes))
    summary(out.rows)


if __name__ == "__main__":
    main()
