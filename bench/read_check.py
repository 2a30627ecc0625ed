"""How fast a safetensors file reaches page-locked host memory, by way of reading it.

Ours' first prompt spends most of its time before the first step reading the files and pinning
them (bench/README.md, run 58). This check times, on one file whose pages are cached:
- ``load_file``: safetensors' own read (what the single-file loader does), then registering
  every tensor in place (`offload_core/pinning.py`); ``read-only``: registered as read-only
  (``cudaHostRegisterReadOnly``: a private file mapping need not be copied to be locked);
- ``load_file pin N``: the same tensors registered in place by N threads (`PinSet.pin_all`);
- ``mapped clone N``: the file memory-mapped once and each tensor cloned out of it by N threads;
- ``pread N``: the file's data read with N threads straight into one host buffer, registered once.

Usage: python3 bench/read_check.py FILE [--threads 1,4,8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import safetensors
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload_core.pinning import PinSet  # noqa: E402


def header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n, json.loads(f.read(n))


NOTES: list[dict] = []  # per `pinned` call: pinned copies (not registered in place), anonymous RSS while pinned
READ_ONLY = 8  # cudaHostRegisterReadOnly


def anon_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return round(int(line.split()[1]) / 2**20, 2)
    return 0.0


def pinned(tensors: list[torch.Tensor], flags: int = 0) -> float:
    """Seconds to register every tensor in place (flags 0: as `PinSet`; else cudaHostRegister's
    ``flags`` directly, a failure counted as a copy), then unregister (not timed)."""
    if not torch.cuda.is_available():
        return 0.0
    cudart, pins, ptrs, copies = torch.cuda.cudart(), PinSet(), [], 0
    t = time.perf_counter()
    for x in tensors:
        if not flags:
            copies += pins.pin(x) is not x
            continue
        st = x.untyped_storage()
        if int(cudart.cudaHostRegister(st.data_ptr(), st.nbytes(), flags)) == 0:
            ptrs.append(st.data_ptr())
        else:
            copies += 1
    s = time.perf_counter() - t
    NOTES.append({"pinned_copies": copies, "anon_gib_pinned": anon_gib()})
    pins.release()
    for p in ptrs:
        cudart.cudaHostUnregister(p)
    return s


def pinned_by_threads(tensors: list[torch.Tensor], n: int) -> float:
    """Seconds for `PinSet.pin_all` to register the tensors in place from ``n`` threads, then
    unregister (not timed)."""
    if not torch.cuda.is_available():
        return 0.0
    pins = PinSet()
    t = time.perf_counter()
    done = pins.pin_all(tensors, n)
    s = time.perf_counter() - t
    NOTES.append({"pinned_copies": sum(not x.is_pinned() for x in tensors), "registered_gib": round(done / 2**30, 2),
                  "anon_gib_pinned": anon_gib()})
    pins.release()
    return s


def by_load_file_pin_threads(path: Path, n: int) -> tuple[float, float]:
    t = time.perf_counter()
    state = load_file(str(path))
    return time.perf_counter() - t, pinned_by_threads(list(state.values()), n)


def by_load_file_read_only(path: Path) -> tuple[float, float]:
    t = time.perf_counter()
    state = load_file(str(path))
    return time.perf_counter() - t, pinned(list(state.values()), READ_ONLY)


def by_touch(path: Path) -> tuple[float, float]:
    """``load_file``'s tensors summed (every page read once), not pinned: the read alone."""
    state = load_file(str(path))
    t = time.perf_counter()
    for x in state.values():
        x.view(torch.uint8).max()
    return time.perf_counter() - t, 0.0


def by_load_file(path: Path) -> tuple[float, float]:
    t = time.perf_counter()
    state = load_file(str(path))
    return time.perf_counter() - t, pinned(list(state.values()))


def by_mapped_clone(path: Path, n: int) -> tuple[float, float]:
    start, head = header(path)
    size = path.stat().st_size
    t = time.perf_counter()
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    spans = [(start + v["data_offsets"][0], start + v["data_offsets"][1]) for k, v in head.items() if k != "__metadata__"]
    with ThreadPoolExecutor(n) as pool:
        out = list(pool.map(lambda s: raw[s[0]:s[1]].clone(), spans))
    return time.perf_counter() - t, pinned(out)


def by_pread(path: Path, n: int) -> tuple[float, float]:
    start, _head = header(path)
    size = path.stat().st_size - start
    t = time.perf_counter()
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    chunk = 64 << 20
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(off: int) -> int:
            return os.preadv(fd, [view[off:off + chunk]], start + off)

        with ThreadPoolExecutor(n) as pool:
            got = sum(pool.map(read, range(0, size, chunk)))
    finally:
        os.close(fd)
    s = time.perf_counter() - t
    assert got == size, (got, size)
    return s, pinned([buf])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    path = Path(a.file)
    gb = path.stat().st_size / 1e9
    rows = []

    def row(how: str, times: tuple[float, float]) -> None:
        read_s, pin_s = times
        note = NOTES.pop() if NOTES else {}
        rows.append({"how": how, "read_s": round(read_s, 3), "pin_s": round(pin_s, 3), **note,
                     "read_pin_gbps": round(gb / (read_s + pin_s), 2)})
        print(f"{how:>18}: read {read_s:6.2f} s, pin {pin_s:5.2f} s ({gb / (read_s + pin_s):5.2f} GB/s; {note})",
              flush=True)

    print(f"{path.name}: {gb:.2f} GB, safetensors {safetensors.__version__}, torch {torch.__version__} "
          f"(threads {torch.get_num_threads()}), cpus {os.cpu_count()}", flush=True)
    row("load_file", by_load_file(path))
    row("load_file touched", by_touch(path))
    row("load_file read-only", by_load_file_read_only(path))
    for n in map(int, a.threads.split(",")):
        row(f"load_file pin {n}", by_load_file_pin_threads(path, n))
        row(f"mapped clone {n}", by_mapped_clone(path, n))
        row(f"pread {n}", by_pread(path, n))
    if a.out:
        Path(a.out, "read_check.json").write_text(json.dumps({"file": str(path), "gb": gb, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
