"""LoRA under offload (issue 6): the Wan-2.1-14B geometry with a rank-64 LoRA on every attention projection.

The model, inputs, timing and ballast come from benchkit. A random LoRA (diffusers' saved format:
``transformer.blocks.N.attnK.<proj>.lora_A/B.weight`` plus adapter metadata, bf16, alpha = rank,
each layer's delta ~10 % of its weight's RMS) is written to a temp dir and made effective through
the engine's own path, ``lora.activate(pipe, [LoraSpec])``. Per row:

  resident  mode none, the whole model on the device (its LoRA output is the parity reference)
  stream    mode auto, preload off: every block streamed from pinned host masters
  preload   mode auto, preload auto at ``--cap`` GiB free (a ballast process holds the rest)

and per workload: step time without and with the LoRA (fused: the ratio should be within 2 %), the
time of the fusing ``activate`` (apply) and of ``activate(pipe, [])`` (remove), parity with the
resident reference (with the LoRA, and with the base after removal), and an exact checksum of every
weight (live tensors and streamed blocks' host masters) against the one taken before any LoRA, once
after removal and once after release.

On the GPU (H200, 40 blocks: about 3.5-4.5 minutes, most of it the build (~45 s), moving the
resident model to host memory (~18 s) and three fusing applies (~20-40 s each, host-bound)):

    python bench/lora_bench.py --video-frames 5 --out $OUT

``--workloads small`` saves ~15 s; ``--rows stream`` (resident always runs) saves about a minute.
CPU smoke run (2 tiny blocks, a fixed one-block preload budget instead of auto + ballast):

    python bench/lora_bench.py --tiny --device cpu --video-frames 1 --rank 8
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import psutil
import torch
from benchkit import GiB, open_output, output_args, pack
from benchkit.lora import write_lora
from benchkit.measure import Ballast, peak_alloc_gib, rel_err, sync, timed, to_host
from benchkit.models import build_wan, nbytes, wan_forward, wan_inputs

pack()
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core.lora import LoraSpec, activate  # noqa: E402


def timed_call(fn, *args) -> float:
    sync()
    t0 = time.perf_counter()
    fn(*args)
    sync()
    return time.perf_counter() - t0


def checksum(t: torch.Tensor, device: torch.device) -> int:
    """Exact fingerprint of a tensor's bytes: the sum of its 32-bit (else 16-, 8-bit) words in int64,
    computed on the bench device (a host-side integer sum of 28 GB takes tens of seconds)."""
    flat = t.detach().to(device).contiguous().reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if flat.numel() % size == 0:
            flat = flat.view(dtype)
            break
    return int(flat.sum(dtype=torch.int64))


def weight_sums(m: torch.nn.Module, device: torch.device, streamer=None) -> dict[str, int]:
    """Every parameter and buffer, plus each streamed block's host master where it is a separate
    copy (a kept block computes from a device buffer; its master is what the next load reads)."""
    sums = {n: checksum(t, device) for n, t in (*m.named_parameters(), *m.named_buffers())}
    names = {id(t): n for n, t in (*m.named_parameters(), *m.named_buffers())}
    for block in getattr(streamer, "blocks", []):
        for slot in block.slots:
            if slot.host.data_ptr() != slot.tensor.data_ptr():
                sums[names[id(slot.tensor)] + "@host"] = checksum(slot.host, device)
    return sums


def mismatches(sums: dict[str, int], original: dict[str, int]) -> list[str]:
    return [n for n, s in sums.items() if s != original[n.removesuffix("@host")]]


def steps(eng: Engine, bag: Components, m, feeds, args) -> tuple[float, torch.Tensor, float]:
    med, _runs, out = timed(lambda: wan_forward(m, *feeds), args.warmup, args.repeats)
    peak = peak_alloc_gib()
    eng.after_run(bag)  # the run ends; a LoRA written after this drops the copies made ahead (before_write)
    return med, out, peak


def lora_row(label: str, m, cfg: OffloadConfig, cap: float | None, lora: LoraSpec, feeds: dict, refs: dict,
             sums0: dict[str, int], args, row) -> None:
    dev = torch.device(args.device)
    ballast = Ballast(cap) if cap and dev.type == "cuda" else None
    eng, bag = Engine(), Components(transformer=m)
    res: dict[str, dict] = {w: {} for w in feeds}
    try:
        eng.place(bag, cfg)
        streamer = eng.states(bag)["transformer"].transport
        for w, r in reversed(res.items()):  # the first workload's plan (small: most blocks kept) at apply
            r["base_s"], out, r["base_peak_gib"] = steps(eng, bag, m, feeds[w], args)
            r["base_err"] = rel_err(out, refs["base"][w])
        kept = len(streamer.resident_indices()) if hasattr(streamer, "resident_indices") else None
        rss0 = psutil.Process().memory_info().rss
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        apply_s = timed_call(activate, bag, [lora])
        apply_peak, backups = peak_alloc_gib(), (psutil.Process().memory_info().rss - rss0) / GiB
        changed = len(mismatches(weight_sums(m, dev, streamer), sums0))  # the fused layers (and kept masters)
        for w, r in res.items():
            r["lora_s"], out, r["lora_peak_gib"] = steps(eng, bag, m, feeds[w], args)
            ref = refs["lora"].setdefault(w, out)  # the first row (resident) is the reference
            r["lora_err"], r["lora_effect"] = rel_err(out, ref), rel_err(out, refs["base"][w])
        remove_s = timed_call(activate, bag, [])
        for w, r in res.items():
            r["removed_err"] = rel_err(wan_forward(m, *feeds[w]), refs["base"][w])
            eng.after_run(bag)
        bad = mismatches(weight_sums(m, dev, streamer), sums0)
    finally:
        eng.release(bag)
        if ballast is not None:
            ballast.close()
    bad_released = mismatches(weight_sums(m, dev), sums0)
    for w, r in res.items():
        row(section=label, workload=w, cap_gib=cap, kept=kept, **r, ratio=r["lora_s"] / r["base_s"],
            apply_s=apply_s, remove_s=remove_s, apply_peak_gib=apply_peak, backup_rss_gib=backups,
            changed_with_lora=changed, sums_ok=not bad, sums_bad=bad[:5], released_ok=not bad_released,
            released_bad=bad_released[:5])


def configs(args, block: torch.nn.Module) -> list[tuple[str, OffloadConfig, float | None]]:
    """The rows asked for; ``resident`` always runs first: its LoRA outputs are the references."""
    cpu = args.device == "cpu"
    base = dict(device="cpu", on_demand_threshold_gb=0, resident_floor_mb=0) if cpu else {}
    # No ballast on the CPU: a fixed budget that keeps one block (slots are 512-byte aligned).
    one_block = sum(t.nbytes + 512 for t in block.parameters()) * 1.5 / GiB
    rows = {"resident": (OffloadConfig(mode="none", **base), None),
            "stream": (OffloadConfig(preload="off", **base), None),
            "preload": (OffloadConfig(preload=one_block if cpu else "auto", **base), None if cpu else args.cap)}
    wanted = ["resident", *(r for r in args.rows.split(",") if r in rows and r != "resident")]
    return [(r, *rows[r]) for r in wanted]


def table(rows: list[dict]) -> None:
    cols = ("section", "workload", "kept", "base_s", "lora_s", "ratio", "apply_s", "remove_s", "lora_err",
            "lora_effect", "removed_err", "changed_with_lora", "sums_ok", "released_ok")
    fmt = {float: "{:.4g}".format}
    cells = [[fmt.get(type(r.get(c)), str)(r.get(c)) for c in cols] for r in rows if "ratio" in r]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    for line in (cols, *cells):
        print("  ".join(x.rjust(n) for x, n in zip(line, widths, strict=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--cap", type=float, default=24.0, help="GiB left free for the preload row (ballast)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--video-frames", type=int, default=21, help="latent frames of the video workload")
    ap.add_argument("--workloads", default="small,video")
    ap.add_argument("--rows", default="resident,stream,preload", help="resident always runs (the reference)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="2 blocks of width 128: a CPU smoke run")
    output_args(ap)
    args = ap.parse_args()
    row = open_output(args, "lora_bench")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.tiny:
        args.blocks = min(args.blocks, 2)
    import diffusers

    row(section="env", device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        torch=torch.__version__, diffusers=diffusers.__version__, blocks=args.blocks, rank=args.rank)
    t0 = time.perf_counter()
    m = build_wan(args.blocks, args.device, tiny=args.tiny)
    build_s = time.perf_counter() - t0
    sums0 = weight_sums(m, torch.device(args.device))
    with tempfile.TemporaryDirectory() as tmp:
        path, layers = write_lora(m, args.rank, Path(tmp))
        lora = LoraSpec(str(path))
        row(section="setup", build_s=build_s, block_gib=nbytes(m.blocks[0]) / GiB, lora_layers=layers,
            lora_mib=path.stat().st_size / 2**20)
        feeds = {w: wan_inputs(w, args.video_frames, args.device) for w in args.workloads.split(",")}
        refs: dict[str, dict] = {"base": {}, "lora": {}}
        for w in feeds:
            med, runs, refs["base"][w] = timed(lambda w=w: wan_forward(m, *feeds[w]), args.warmup, args.repeats)
            row(section="resident(no engine)", workload=w, median_s=med, runs=runs)
        for label, cfg, cap in configs(args, m.blocks[0]):
            lora_row(label, m, cfg, cap, lora, feeds, refs, sums0, args, row)
            to_host(m)
    table(row.rows)
    row.save()


if __name__ == "__main__":
    main()
