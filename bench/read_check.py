"""How fast a safetensors file reaches page-locked host memory, side by side in one process.

Ours' first prompt spent most of its time before the first step pinning the files' weights
(bench/README.md, runs 58-59). On one file whose pages are cached, after safetensors' ``load_file``
(which leaves every tensor on a private mapping of the file), this check times:
- ``in place``: each tensor registered where it lies (`PinSet.pin`, the pack's way until run 59:
  the kernel copies each page of the mapping as it locks it);
- ``touched``: every page read once, nothing pinned (the read alone);
- ``clones``: run 59's way (each tensor cloned by 16 threads into torch's fresh memory, each
  registered as its copy comes);
- ``pin_all``: the pack's way since run 60 (`PinSet.pin_all`: copied by threads into one arena
  backed by huge pages, registered once);
- ``read-only`` (``--read-only``): registered with ``cudaHostRegisterReadOnly``, which need not copy
  a private mapping (it did not finish within 95 s on run 59's machine).

Usage: python3 bench/read_check.py FILE [--read-only] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import safetensors
import torch
from benchkit.single_file import host_rss
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from offload_core.formats.mapped import in_mapping  # noqa: E402
from offload_core.pinning import PinSet  # noqa: E402

READ_ONLY = 8  # cudaHostRegisterReadOnly


def in_place(tensors: list[torch.Tensor]) -> dict:
    pins = PinSet()
    copies = sum(pins.pin(x) is not x for x in tensors)
    return {"pinned_copies": copies, "release": pins.release}


def pin_all(tensors: list[torch.Tensor]) -> dict:
    pins = PinSet()
    out = pins.pin_all(tensors, in_mapping())
    return {"copied": sum(o is not x for o, x in zip(out, tensors, strict=True)), "release": pins.release}


def clones(tensors: list[torch.Tensor]) -> dict:
    pins = PinSet()
    with ThreadPoolExecutor(16) as pool:
        out = [pins.pin(c) for c in pool.map(torch.clone, tensors)]
    return {"copied": len(out), "release": pins.release}


def touched(tensors: list[torch.Tensor]) -> dict:
    for x in tensors:
        x.view(torch.uint8).max()
    return {"release": lambda: None}


def read_only(tensors: list[torch.Tensor]) -> dict:
    cudart, ptrs = torch.cuda.cudart(), []
    for x in tensors:
        st = x.untyped_storage()
        if int(cudart.cudaHostRegister(st.data_ptr(), st.nbytes(), READ_ONLY)) == 0:
            ptrs.append(st.data_ptr())
    return {"refused": len(tensors) - len(ptrs), "release": lambda: [cudart.cudaHostUnregister(p) for p in ptrs]}


def timed(path: Path, way: Callable[[list[torch.Tensor]], dict]) -> dict:
    """``load_file``, then ``way`` on its tensors; seconds of each, the anonymous and file-backed RSS
    while pinned (the file's pages a copy read count there until given back), then undone."""
    t = time.perf_counter()
    tensors = list(load_file(str(path)).values())
    t1 = time.perf_counter()
    note = way(tensors)
    t2 = time.perf_counter()
    held = host_rss()  # the file's tensors still alive: its mapping too, and the pages of it this process maps
    note.pop("release")()
    return {"read_s": round(t1 - t, 3), "pin_s": round(t2 - t1, 3), "anon_gib_pinned": held["rss_anon_gib"],
            "file_gib_pinned": held["rss_file_gib"], "anon_gib_after": host_rss()["rss_anon_gib"], **note}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--read-only", action="store_true", help="also register the mapping read-only (slow)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    path = Path(a.file)
    gb = path.stat().st_size / 1e9
    print(f"{path.name}: {gb:.2f} GB, safetensors {safetensors.__version__}, torch {torch.__version__}, "
          f"cpus {os.cpu_count()}", flush=True)
    ways = {"in place": in_place, "touched": touched, "clones": clones, "pin_all": pin_all}
    if a.read_only:
        ways["read-only"] = read_only
    rows = []
    for how, way in ways.items():
        if how != "touched" and not torch.cuda.is_available():
            continue
        row = {"how": how, **timed(path, way)}
        row["gbps"] = round(gb / (row["read_s"] + row["pin_s"]), 2)
        rows.append(row)
        print(f"{how:>10}: {row}", flush=True)
    if a.out:
        Path(a.out, "read_check.json").write_text(json.dumps({"file": str(path), "gb": gb, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
