"""Where the caching allocator's reserved-beyond-allocated memory sits at a preloaded video step's
peak (Wan-14B geometry, ballast cap; benchkit).

Why: at 12 GiB the video plan kept 19 pieces where the penalty-free fit kept 24, because the
native allocator reserved about 2.4 GiB beyond what it had allocated at the video peak and each
allocation that needed a new segment flushed the cache and retried (a shortage). This records
PyTorch's allocator history over alternating forwards and replays it: every new segment made
inside a forward (with the cached-but-free bytes and the largest free hole at that moment, and
the code that asked), and the segments at the peak.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False python bench/alloc_trace.py --cap 12 --out $OUT

The variable keeps the fixed segments the engine would otherwise replace with expandable ones;
the replayed peak layout describes fixed segments only. Under the engine's expandable segments,
each flush-and-retry is printed with the mapped address range at that moment; to replay the
history of wan_bench's 12 GiB video row:

    python bench/alloc_trace.py --resident --cap 12 --warm small --sequence video,video,video,video,video --timed 0
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import Counter

import torch
from benchkit import MiB, open_output, output_args, pack
from benchkit.measure import Ballast, loop_time, timed, to_host
from benchkit.models import build_wan, wan_forward, wan_inputs

pack()
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402


class Replay:
    """The allocator's segments and live blocks, rebuilt from a snapshot and its trace events."""

    def __init__(self, snapshot: dict) -> None:
        self.segments: dict[int, int] = {}
        self.blocks: dict[int, tuple[int, str]] = {}  # address -> (size, who asked)
        for seg in snapshot["segments"]:
            self.segments[seg["address"]] = seg["total_size"]
            for b in seg["blocks"]:
                if b["state"] != "inactive":
                    self.blocks[b["address"]] = (b["size"], who(b.get("frames", [])) or "before the trace")

    @property
    def reserved(self) -> int:
        return sum(self.segments.values())

    @property
    def allocated(self) -> int:
        return sum(s for s, _ in self.blocks.values())

    def apply(self, ev: dict) -> None:
        action, addr, size = ev["action"], ev.get("addr", 0), ev.get("size", 0)
        if action == "alloc":
            self.blocks[addr] = (size, who(ev.get("frames", [])))
        elif action == "free_completed":
            self.blocks.pop(addr, None)
        elif action in ("segment_alloc", "segment_map"):
            self.segments[addr] = self.segments.get(addr, 0) + size
        elif action in ("segment_free", "segment_unmap"):
            self.segments.pop(addr, None)

    def layout(self) -> list[dict]:
        """Per segment: its size, the bytes live in it, its largest free hole, who holds it (MiB)."""
        live = sorted(self.blocks.items())
        out = []
        for start, size in sorted(self.segments.items()):
            inside = [(a, s, w) for a, (s, w) in live if start <= a < start + size]
            cursor, hole = start, 0
            for a, s, _ in inside:
                hole, cursor = max(hole, a - cursor), a + s
            hole = max(hole, start + size - cursor)
            out.append(dict(mib=size // MiB, live_mib=sum(s for _, s, _ in inside) // MiB, hole_mib=hole // MiB,
                            held_by=sorted({f"{w} {s // MiB}" for _, s, w in inside})))
        return out


def who(frames: list[dict]) -> str:
    """The innermost frame of the model's or the engine's code that asked for a block."""
    for f in frames:
        name = f.get("filename", "")
        if "diffusers/" in name or "offload_core" in name or "benchkit" in name:
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line')}:{f.get('name')}"
    return ""


def replay_forward(start: dict, events: list[dict]) -> dict:
    """New segments inside one forward, and the layout at its allocated peak and at the last
    event of its reserved peak."""
    r = Replay(start)
    grown, frees, peaks = [], 0, {"allocated": (0, 0), "reserved": (0, 0)}
    running = False
    run = 0  # segments freed just before: a flush-and-retry, or our own emptying of the cache
    for i, ev in enumerate(events):
        run = run + 1 if ev["action"] == "segment_free" else (run if ev["action"] == "segment_alloc" else 0)
        if ev["action"] == "segment_alloc":
            grown.append(dict(mib=ev["size"] // MiB, after_frees=run, cached_free_mib=(r.reserved - r.allocated) // MiB,
                              largest_hole_mib=max((s["hole_mib"] for s in r.layout()), default=0),
                              reserved_mib=r.reserved // MiB))
        frees += ev["action"] == "segment_free"
        r.apply(ev)
        if ev["action"] == "alloc" and grown:
            grown[-1].setdefault("for", who(ev.get("frames", [])))
        running = running or (ev["action"] == "alloc" and "transformer_wan" in who(ev.get("frames", [])))
        if not running:  # the plan's change at the forward's start is not the step's peak
            continue
        peaks["allocated"] = max(peaks["allocated"], (r.allocated, i))
        if r.reserved >= peaks["reserved"][0]:
            peaks["reserved"] = (r.reserved, i)
    return dict(segments_made=grown, segments_freed=frees,
                **{f"at_{k}_peak": layout_after(start, events, i) for k, (_, i) in peaks.items()})


def retry_sites(start: dict, events: list[dict]) -> list[dict]:
    """Expandable segments: each flush-and-retry inside a forward (pages unmapped on behalf of a
    model or engine line, not by our own ``empty_cache``), with the request that caused it, the
    mapped-but-free holes at that moment, and the live blocks in address order (``W`` weights the
    engine placed, ``A`` activations, ``.`` a free hole; MiB)."""
    mapped: dict[int, int] = {}
    for seg in start["segments"]:
        mapped[seg["address"]] = seg["total_size"]
    blocks = Replay(start).blocks
    live = {addr: size for addr, (size, _) in blocks.items()}
    kinds = {addr: "W" if _is_weight(w) else "A" for addr, (_, w) in blocks.items()}
    sites, unmapping = [], None
    for ev in events:
        action, addr, size = ev["action"], ev.get("addr", 0), ev.get("size", 0)
        asker = who(ev.get("frames", []))
        if action == "segment_unmap" and unmapping is None and "empty_cache" not in asker:
            unmapping = dict(for_=asker, layout=_address_map(mapped, live, kinds), unmapped_mib=0)
        if action == "segment_unmap" and unmapping is not None:
            unmapping["unmapped_mib"] += size // MiB
        if action == "alloc" and unmapping is not None:
            unmapping.update(request_mib=size // MiB)
            sites.append(unmapping)
            unmapping = None
        if action in ("segment_alloc", "segment_map"):
            mapped[addr] = size
        elif action in ("segment_free", "segment_unmap"):
            _unmap(mapped, addr, size)
        elif action == "alloc":
            live[addr], kinds[addr] = size, "W" if _is_weight(asker) else "A"
        elif action == "free_completed":
            live.pop(addr, None)
    return sites


def _is_weight(asker: str) -> bool:
    return "ring.py" in asker or "streamer.py" in asker


def _unmap(mapped: dict[int, int], addr: int, size: int) -> None:
    """Remove [addr, addr + size) from the mapped ranges, splitting the range that holds it."""
    for start, length in list(mapped.items()):
        if start <= addr < start + length:
            del mapped[start]
            if addr > start:
                mapped[start] = addr - start
            if addr + size < start + length:
                mapped[addr + size] = start + length - addr - size
            return


def _address_map(mapped: dict[int, int], live: dict[int, int], kinds: dict[int, str]) -> dict:
    """The mapped ranges in address order as ``W272 A320 .640`` tokens, and the hole totals."""
    tokens, holes = [], []
    for start, length in sorted(mapped.items()):
        cursor = start
        for addr in sorted(a for a in live if start <= a < start + length):
            if addr > cursor:
                holes.append(addr - cursor)
                tokens.append(f".{(addr - cursor) // MiB}")
            tokens.append(f"{kinds.get(addr, '?')}{live[addr] // MiB}")
            cursor = addr + live[addr]
        if start + length > cursor:
            holes.append(start + length - cursor)
            tokens.append(f".{(start + length - cursor) // MiB}")
        tokens.append("|")
    small = [t for t in tokens if t[1:].isdigit() and int(t[1:]) < 16]
    return dict(mapped_mib=sum(mapped.values()) // MiB, free_mib=sum(holes) // MiB,
                largest_hole_mib=max(holes, default=0) // MiB,
                tokens=" ".join(t for t in tokens if t not in small), under_16_mib=len(small))


def layout_after(start: dict, events: list[dict], last: int) -> dict:
    r = Replay(start)
    for ev in events[: last + 1]:
        r.apply(ev)
    return dict(reserved_mib=r.reserved // MiB, allocated_mib=r.allocated // MiB, segments=r.layout())


def summary(found: dict) -> str:
    """A few lines a person can read: the segments made, and at each peak the holes of 32 MiB or
    more and who holds the rest."""
    lines = [f"{found['workload']}: {found['plan']}; {found['retries']} retries, {found['segments_freed']} segments "
             f"freed, {found['trims']} trims so far",
             "  segments made (MiB, after frees, cached free, largest hole, for): "
             + "; ".join(f"{g['mib']} {g['after_frees']} {g['cached_free_mib']} {g['largest_hole_mib']} {g.get('for', '')}"
                         for g in found["segments_made"])]
    for site in found["retry_sites"]:
        lines.append(f"  retry for {site['for_']} ({site.get('request_mib')} MiB), {site['unmapped_mib']} MiB unmapped; "
                     f"mapped {site['layout']['mapped_mib']}, free in holes {site['layout']['free_mib']}, largest "
                     f"{site['layout']['largest_hole_mib']}: {site['layout']['tokens']}")
    for k in ("at_allocated_peak", "at_reserved_peak"):
        peak = found[k]
        held: Counter = Counter()
        for seg in peak["segments"]:
            for h in seg["held_by"]:
                name, mib = h.rsplit(" ", 1)
                held[name] += int(mib)
        holes = sorted((s["hole_mib"] for s in peak["segments"] if s["hole_mib"] >= 32), reverse=True)
        lines.append(f"  {k}: reserved {peak['reserved_mib']} allocated {peak['allocated_mib']} MiB in "
                     f"{len(peak['segments'])} segments; holes >= 32 MiB: {holes}; held: {held.most_common(10)}")
    return "\n".join(lines)


def trim_at_blocks(streamer, limit: int) -> list[int]:
    """Experiment: give fully free cached segments back at each block's entry when the cache
    holds more than ``limit`` bytes unused; returns a one-element counter of trims."""
    enter, trims = streamer.enter_block, [0]

    def enter_block(block, args, kwargs):
        stats = torch.cuda.memory_stats_as_nested_dict()
        unused = stats["reserved_bytes"]["all"]["current"] - stats["allocated_bytes"]["all"]["current"]
        if unused > limit:
            torch.cuda.empty_cache()
            trims[0] += 1
        return enter(block, args, kwargs)

    streamer.enter_block = enter_block  # an instance attribute shadows the method in this process
    return trims


def timed_video(m, feeds, streamer, repeats: int, trims: list[int]) -> dict:
    stats = torch.cuda.memory_stats
    wan_forward(m, *feeds)
    retries, trimmed, runs = stats().get("num_alloc_retries", 0), trims[0], []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        wan_forward(m, *feeds)
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    return dict(timed="video", median_s=statistics.median(runs), runs=runs, plan=streamer.details()["plan"],
                retries=stats().get("num_alloc_retries", 0) - retries, trims=trims[0] - trimmed,
                peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap", type=float, default=12)
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--frames", type=int, default=21)
    ap.add_argument("--warm", default="small,video",
                    help="the untraced workloads first, each timed as a wan_bench row (2 + 3 + 3 forwards)")
    ap.add_argument("--resident", action="store_true", help="first one resident forward of each workload, as wan_bench")
    ap.add_argument("--sequence", default="small,video,video,small,video",
                    help="the forwards traced one by one, after the --warm ones")
    ap.add_argument("--trim", type=float, default=0, help="experiment: trim the cache at block entries beyond MiB")
    ap.add_argument("--timed", type=int, default=3, help="untraced video forwards timed at the end")
    output_args(ap)
    args = ap.parse_args()
    rows = open_output(args, "alloc_trace")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("diffusers_offload.preload").setLevel(logging.DEBUG)
    m = build_wan(args.blocks)
    feeds = {w: wan_inputs(w, args.frames) for w in ("small", "video")}
    if args.resident:
        for w in ("small", "video"):
            wan_forward(m, *feeds[w])
    to_host(m)
    ballast = Ballast(args.cap)
    # From before the placement on, so that the weights' blocks carry the engine's frames.
    torch.cuda.memory._record_memory_history(max_entries=5_000_000, stacks="python")
    eng, bag = Engine(), Components(transformer=m)
    eng.place(bag, OffloadConfig(preload="auto"))
    streamer = eng.states(bag)["transformer"].transport
    trims = trim_at_blocks(streamer, int(args.trim * MiB)) if args.trim else [0]
    for w in args.warm.split(","):
        timed(lambda w=w: wan_forward(m, *feeds[w]), 2, 3)
        loop_time(lambda w=w: wan_forward(m, *feeds[w]), 3)
    torch.cuda.reset_peak_memory_stats()  # as the next row's timing does
    for w in args.sequence.split(","):
        torch.cuda.synchronize()
        start = torch.cuda.memory._snapshot()
        seen = len(start["device_traces"][torch.cuda.current_device()])
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        wan_forward(m, *feeds[w])
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()][seen:]
        found = replay_forward(start, events)
        found.update(workload=w, plan=streamer.details()["plan"], events=len(events), trims=trims[0],
                     retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries,
                     retry_sites=retry_sites(start, events),
                     asked_by=Counter(who(e.get("frames", [])) for e in events if e["action"] == "alloc").most_common(12))
        print(summary(found), flush=True)
        rows.rows.append(found)
    torch.cuda.memory._record_memory_history(enabled=None)
    if args.timed:
        rows(**timed_video(m, feeds["video"], streamer, args.timed, trims))
    eng.release(bag)
    ballast.close()
    rows.save()


if __name__ == "__main__":
    main()
