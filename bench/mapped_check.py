"""GPU check of memory-mapped weights (issue 21.1, SPEC §12): a Wan-14B-geometry bf16 transformer
(26.7 GiB) written to a safetensors folder, loaded, mapped (`formats/mapped.py`), placed at a
12 GiB VRAM cap while a second process holds anonymous host RAM so that only ``--free-gb`` stay
free (the page cache cannot use it): the step runs without being killed, RSS stays under the free
RAM, and the step time is compared with max(PCIe bound, bytes read from disk per step / measured
disk read bandwidth) (issue's target: <= 1.3x). Also checks that page-locking a private file
mapping works in place (cudaHostRegister), that its values and the file stay as they were, and
the same step with RAM free (page cache warm) for the "no slower than today" row, and there a
rank-64 LoRA on every attention projection (issue 21.3): apply and remove time, anonymous RSS
before, with and after it, and the RAM backup store (empty when every base value comes back from
the files; the bf16 in-memory model of lora_bench.py held 15.6 GiB of backups).

    python3 bench/mapped_check.py --write            # once: writes ~28.6 GB to --folder (~70 s on the H200)
    python3 bench/mapped_check.py --free-gb 16       # the rows (about 3-6 min, most of it disk reads)

Needs ~30 GB of free disk at --folder (default /tmp/wan14b_mapped) and 128 GiB of host RAM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from benchkit import GiB, pack

pack()  # the node pack, as diffusers_offload

import psutil  # noqa: E402
import torch  # noqa: E402
from benchkit.lora import write_lora  # noqa: E402
from benchkit.measure import Ballast  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402
from diffusers_offload.offload_core import Components, Engine, OffloadConfig  # noqa: E402
from diffusers_offload.offload_core.formats.mapped import index_folder, map_from_files  # noqa: E402
from diffusers_offload.offload_core.lora import LoraSpec, activate  # noqa: E402
from diffusers_offload.offload_core.pinning import PinSet  # noqa: E402
from diffusers_offload.offload_core.state import LORA  # noqa: E402

WAN14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
              ffn_dim=13824, num_layers=40, text_dim=4096, freq_dim=256, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads")
HOG = ("import sys, numpy as np; n = int(sys.argv[1]); a = np.ones(n, dtype=np.uint8); "
       "print('held', n, flush=True); sys.stdin.read()")


def write(folder: Path) -> None:
    """Random bf16 weights of the 14B geometry (meta model filled tensor by tensor), saved sharded."""
    with torch.device("meta"):
        model = WanTransformer3DModel(**WAN14B)
    model = model.to_empty(device="cpu")
    keep = model._keep_in_fp32_modules or []  # held in float32 by from_pretrained(torch_dtype=bf16)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # drawing 14B normals on the host takes ~6 min
    gen = torch.Generator(dev).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            dtype = p.dtype if any(k in name.split(".") for k in keep) else torch.bfloat16
            if name.endswith("bias"):
                p.data = torch.zeros(p.shape, dtype=dtype)
            elif p.dim() == 1:
                p.data = torch.ones(p.shape, dtype=dtype)
            else:
                p.data = torch.empty(p.shape, dtype=dtype, device=dev).normal_(0, 0.02, generator=gen).cpu()
    model.save_pretrained(folder, max_shard_size="5GB")
    print(f"wrote {folder}: {sum(f.stat().st_size for f in folder.glob('*.safetensors')) / GiB:.2f} GiB")


def evict(folder: Path) -> None:
    """Drop the files' clean pages from the page cache (no root needed)."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def disk_bandwidth(folder: Path) -> float:
    """Sequential read of the largest shard from disk (evicted first), bytes/s."""
    evict(folder)
    f = max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    start, n = time.perf_counter(), 0
    with open(f, "rb", buffering=0) as fh:
        while chunk := fh.read(64 << 20):
            n += len(chunk)
    return n / (time.perf_counter() - start)


def pcie_bandwidth() -> float:
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(4):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 4 * host.numel() / (time.perf_counter() - start)


def rss() -> tuple[float, float]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return tuple(int(status[k].split()[0]) * 1024 / GiB for k in ("RssAnon", "RssFile"))


def disk_read() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["read_bytes"])


def pin_check(model: torch.nn.Module, folder: Path) -> str:
    """cudaHostRegister on tensors of a private file mapping: registered in place (no copy), values
    unchanged, the file unchanged."""
    block = model.blocks[0]
    ptrs = {n: p.data_ptr() for n, p in block.named_parameters()}
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    shard = index_folder(folder)["blocks.0.attn1.to_q.weight"][0].file
    digest = hashlib.sha256(Path(shard).read_bytes()).hexdigest()
    pins = PinSet()
    pinned = {n: pins.pin(p.data) for n, p in block.named_parameters()}
    in_place = all(t.data_ptr() == ptrs[n] and t.is_pinned() for n, t in pinned.items())
    same = all(torch.equal(t, before[n]) for n, t in pinned.items())
    nbytes = pins.nbytes
    pins.release()
    ok = in_place and same and hashlib.sha256(Path(shard).read_bytes()).hexdigest() == digest
    return f"pin in place of a mapped block: {'OK' if ok else 'FAILED'} (in place {in_place}, values {same}, " \
           f"{nbytes / 2**20:.1f} MiB registered)"


def lora_check(model, pipe) -> str:
    """Apply and remove a rank-64 attention LoRA on the placed, file-backed model: times, anonymous
    RSS, the RAM backup store, and the sampled weights bit-equal after removal."""
    import tempfile

    sample = {n: p.detach().to("cpu", copy=True) for n, p in model.blocks[0].attn1.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp:
        path, layers = write_lora(model, 64, Path(tmp))
        anon0, start = rss()[0], time.perf_counter()
        activate(pipe, [LoraSpec(str(path))])
        apply_s, anon1 = time.perf_counter() - start, rss()[0]
        state = LORA.get(model)
        backups = sum(t.numel() * t.element_size() for t in state.backups.values()) if state else 0
        sources = len(state.sources) if state else 0
        start = time.perf_counter()
        activate(pipe, [])
        remove_s, anon2 = time.perf_counter() - start, rss()[0]
    exact = all(torch.equal(p.detach().cpu(), sample[n]) for n, p in model.blocks[0].attn1.named_parameters())
    return json.dumps(dict(row="lora rank 64", layers=layers, apply_s=round(apply_s, 2), remove_s=round(remove_s, 2),
                           rss_anon_gib=[round(anon0, 2), round(anon1, 2), round(anon2, 2)],
                           backups_gib=round(backups / GiB, 3), restored_from_files=sources,
                           exact_after_remove=exact))


def step(model, feeds, steps: int) -> tuple[float, float]:
    """(seconds per step, bytes read from disk per step) after two warm-up steps (the preload
    plan is made after the first, which measures the activations)."""
    with torch.inference_mode():
        for _ in range(2):
            model(**feeds)
        torch.cuda.synchronize()
        read0, start = disk_read(), time.perf_counter()
        for _ in range(steps):
            model(**feeds)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, (disk_read() - read0) / steps


def to_anonymous(model: torch.nn.Module) -> str:
    """Every weight copied into anonymous host memory: the model as the pack held it before
    mapping (the "today" reference of the RAM-free row)."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.data = t.data.clone()
    return f"copied {sum(t.numel() * t.element_size() for t in model.parameters()) / GiB:.2f} GiB into anonymous RAM"


def row(label: str, folder: Path, args, free_gb: float | None, feeds, anonymous: bool = False) -> None:
    hog = None
    if free_gb is not None:
        hold = int(psutil.virtual_memory().available - free_gb * GiB)
        hog = subprocess.Popen([sys.executable, "-c", HOG, str(max(hold, 0))], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        print(hog.stdout.readline().strip(), "bytes of anonymous RAM held by a second process")
    try:
        evict(folder)
        model = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
        print(label, to_anonymous(model) if anonymous else map_from_files(model, folder).line())
        if label == "mapped, RAM free":
            print(pin_check(model, folder))
        engine, pipe = Engine(), Components(transformer=model)
        ballast = Ballast(args.vram_gb)  # a second process holds the card down to the cap
        try:
            report = engine.place(pipe, OffloadConfig(mode="auto", device="cuda"))
            print(report.text())
            per_step, disk = step(model, feeds, args.steps)
            streamed = int(engine.report(pipe).component("transformer").details.get("streamed_per_step", 0))
            anon, file = rss()  # while placed, after the steps
            if free_gb is None and not anonymous:
                print(lora_check(model, pipe), flush=True)
            engine.release(pipe)
        finally:
            ballast.close()
        bound = max(streamed / args.pcie, disk / args.disk)
        print(json.dumps(dict(row=label, step_s=round(per_step, 3), disk_gib_per_step=round(disk / GiB, 2),
                              streamed_gib=round(streamed / GiB, 2), bound_s=round(bound, 3),
                              ratio=round(per_step / bound, 2) if bound else None, rss_anon_gib=round(anon, 2),
                              rss_file_gib=round(file, 2), free_gb=free_gb)), flush=True)
    finally:
        if hog is not None:
            hog.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", type=Path, default=Path("/tmp/wan14b_mapped"))
    ap.add_argument("--write", action="store_true", help="write the folder, then exit")
    ap.add_argument("--free-gb", type=float, default=16.0)
    ap.add_argument("--vram-gb", type=float, default=12.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", default="free,today,tight",
                    help="free: mapped with RAM free (and the LoRA row); today: the same with every weight in "
                         "anonymous RAM (as before mapping); tight: mapped with --free-gb free")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the placement's disk note
    if args.write:
        write(args.folder)
        return
    if not (args.folder / "config.json").is_file():
        raise SystemExit(f"{args.folder} has no model: run with --write first")
    args.disk, args.pcie = disk_bandwidth(args.folder), pcie_bandwidth()
    print(f"disk read {args.disk / 1e9:.2f} GB/s, host to device {args.pcie / 1e9:.2f} GB/s")
    feeds = {"hidden_states": torch.randn(1, 16, 5, 60, 104, dtype=torch.bfloat16, device="cuda"),
             "encoder_hidden_states": torch.randn(1, 512, 4096, dtype=torch.bfloat16, device="cuda"),
             "timestep": torch.full((1,), 500.0, device="cuda"), "return_dict": False}
    rows = args.rows.split(",")
    if "free" in rows:
        row("mapped, RAM free", args.folder, args, None, feeds)
    if "today" in rows:
        row("in anonymous RAM (today), RAM free", args.folder, args, None, feeds, anonymous=True)
    if "free" in rows:  # again after the reference: the two side by side, neither first
        row("mapped, RAM free (again)", args.folder, args, None, feeds)
    if "tight" in rows:
        row(f"mapped, {args.free_gb:g} GiB free", args.folder, args, args.free_gb, feeds)


if __name__ == "__main__":
    main()
