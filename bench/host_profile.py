"""Where the host's time goes in a placed forward: a Python profile of the same forwards resident
and under the engine (every block kept, then at a ballast cap), and the calls the engine adds.

Why: on the H200 the image-like Wan-14B step is host-launch-bound (bench/README.md, run 24): the
engine's forward took 20-35 ms more host time than resident with every block kept, of which the
streamer's own methods explain 3 ms. This names the rest, function by function, and times
resident again after the engine rows: the engine turns PyTorch's expandable segments on for the
process at its first placement, so a resident row measured first ran under another allocator
setting than every engine row (the last row separates the allocator from the hooks).

    python3 bench/host_profile.py --caps 0,24 --out $OUT        # GPU, Wan-14B geometry, ~2 min
    python3 bench/host_profile.py --storage gguf_q4_k --caps 0,12 --out $OUT   # GGUF layers
    .venv/bin/python bench/host_profile.py --tiny --device cpu   # CPU smoke (flow only)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from benchkit import open_output, output_args, pack
from benchkit.gguf import QTYPES as GGUF_TYPES
from benchkit.gguf import to_gguf
from benchkit.measure import Ballast, launch_and_step, sync
from benchkit.models import blocks_of, build_wan, wan_forward, wan_inputs

pack()
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402

Stats = dict[tuple, tuple[int, float, float]]  # (file, line, function) -> (calls, own s, cumulative s)


def profile(m, feeds, forwards: int) -> tuple[Stats, int]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(forwards):
        wan_forward(m, *feeds)
    sync()
    prof.disable()
    stats = pstats.Stats(prof)
    return {k: (v[1], v[2], v[3]) for k, v in stats.stats.items()}, stats.total_calls


def added(base: Stats, ours: Stats, forwards: int, top: int) -> list[dict]:
    """The functions the engine's forward calls more often than resident, most own time first."""
    rows = []
    for key, (calls, own, cum) in ours.items():
        more = calls - base.get(key, (0, 0.0, 0.0))[0]
        if more > 0:
            rows.append(dict(fn=f"{key[0].split('site-packages/')[-1]}:{key[1]}({key[2]})",
                             calls_per_fwd=more / forwards, own_ms_per_fwd=own / forwards * 1e3,
                             cum_ms_per_fwd=cum / forwards * 1e3))
    return sorted(rows, key=lambda r: -r["own_ms_per_fwd"])[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="0,24", help="0: every block kept (no ballast)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--forwards", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--storage", default="bf16", choices=("bf16", *GGUF_TYPES),
                    help="gguf_*: the blocks' Linear layers as diffusers' GGUF layers (benchkit/gguf.py)")
    output_args(ap)
    args = ap.parse_args()
    row = open_output(args, "host_profile", lines=True)
    m = build_wan(4 if args.tiny else 40, device=args.device, tiny=args.tiny)
    if args.storage != "bf16":
        row(section="gguf", storage=args.storage, layers=to_gguf(m, blocks_of(m), args.storage))
    feeds = wan_inputs("small", 1 if args.tiny else 21, device=args.device)
    launch, step, _loop = launch_and_step(lambda: wan_forward(m, *feeds), args.forwards)
    base, calls = profile(m, feeds, args.forwards)
    row(section="resident", launch_s=launch, step_s=step, calls_per_fwd=calls / args.forwards)
    for cap in [float(c) for c in args.caps.split(",")]:
        ballast = Ballast(cap) if cap and args.device != "cpu" else None
        eng, bag = Engine(), Components(transformer=m)
        cpu = dict(device="cpu", resident_floor_mb=0, on_demand_threshold_gb=0) if args.device == "cpu" else {}
        try:
            eng.place(bag, OffloadConfig(preload="auto" if cap else "100", **cpu))
            launch, step, _loop = launch_and_step(lambda: wan_forward(m, *feeds), args.forwards)
            ours, calls = profile(m, feeds, args.forwards)
            kept = eng.states(bag)["transformer"].transport.details()["kept"]
            row(section="engine", cap_gib=cap or None, kept=kept, launch_s=launch, step_s=step,
                calls_per_fwd=calls / args.forwards, added=added(base, ours, args.forwards, args.top))
        finally:
            eng.release(bag)
            if ballast is not None:
                ballast.close()
    m.to(args.device)  # resident again, under the allocator setting the engine left
    launch, step, _loop = launch_and_step(lambda: wan_forward(m, *feeds), args.forwards)
    after, calls = profile(m, feeds, args.forwards)
    row(section="resident_after", launch_s=launch, step_s=step, calls_per_fwd=calls / args.forwards,
        allocator=allocator_note(), added=added(base, after, args.forwards, args.top))


def allocator_note() -> str:
    """The CUDA allocator's backend and its settings as this process has them now."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return f"{torch.cuda.get_allocator_backend()} {getter() if getter else ''}".strip()


if __name__ == "__main__":
    main()
