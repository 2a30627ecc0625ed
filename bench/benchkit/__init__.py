"""The shared base of the GPU benchmarks in bench/ (method and results: bench/README.md).

The scripts run as files (``python bench/wan_bench.py``), so bench/ is on sys.path and this
package imports as ``benchkit``; no script imports another. This module imports neither torch
nor the pack: comfy_coexist.py must let ComfyUI's start-up import torch first.

  benchkit          paths, the pack's import name, JSON rows, the output folder (--out / $OUT)
  benchkit.models   random-weight builders (Wan-2.1-14B, MiniMax-H3) and their inputs
  benchkit.image_models  the image transformers of wan_bench --model (FLUX.1-dev, Z-Image Turbo, Qwen-Image)
  benchkit.measure  ballast, timing, allocator peaks, pinned bandwidth, sync loads, device-memory polling
  benchkit.anchors  diffusers' group offloading and mmgp, timed beside the engine (wan_bench.py)
  benchkit.stages   per-stage clock and peaks of one pipeline call (h3_bench.py)
  benchkit.table    the side-by-side markdown table of a wan_bench run, and its CPU self-check
  benchkit.comfy    a ComfyUI process instrumented (comfy_coexist.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository
GB, GiB, MiB = 1e9, 2**30, 2**20


def comfy_on_cpu(*extra_paths: Path) -> argparse.Namespace:
    """The ``--comfy-dir`` of a script that checks the pack against ComfyUI's own modules on the CPU:
    that tree (and ``extra_paths``) put first on sys.path and ComfyUI's arguments set to ``--cpu``
    before its modules are imported."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfy-dir", required=True)
    args = ap.parse_args()
    sys.argv = [sys.argv[0], "--cpu"]
    sys.path[:0] = [args.comfy_dir, *map(str, extra_paths)]
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    return args


def load_module(name: str, path: Path, package: bool = False) -> ModuleType:
    """Import one file (or a package's ``__init__.py``) under ``name`` without touching sys.path."""
    if name in sys.modules:
        return sys.modules[name]
    kw = {"submodule_search_locations": [str(path.parent)]} if package else {}
    spec = importlib.util.spec_from_file_location(name, path, **kw)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def pack() -> ModuleType:
    """The pack as ``diffusers_offload`` (as the tests name it), without putting the repo root on
    sys.path: its ``nodes/`` must never stand in for ComfyUI's ``nodes`` module."""
    return load_module("diffusers_offload", ROOT / "__init__.py", package=True)


def fixtures() -> ModuleType:
    """The test suite's model configs and code-built tokenizers (``tests/fixtures`` as the package
    ``fixtures``). Bench may read tests; tests import nothing from bench."""
    return load_module("fixtures", ROOT / "tests" / "fixtures" / "__init__.py", package=True)


def fixture(name: str) -> ModuleType:
    """One module of the suite's fixtures (``fixtures.<name>``), the pack and the package loaded first."""
    import importlib

    pack()
    fixtures()
    return importlib.import_module(f"fixtures.{name}")


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / GiB, 3)


def version_of(distribution: str) -> str | None:
    """An installed distribution's version, or None where it is not installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


class Rows:
    """The JSON rows of a run: printed as they come, kept for the tables, written to a file (a
    JSON array at the end, or JSON lines as they come with ``lines``: a killed run keeps them)."""

    def __init__(self, path: str = "", lines: bool = False, echo: bool = True) -> None:
        self.rows: list[dict] = []
        self.path, self.lines, self.echo = path, lines, echo
        if path and lines:
            Path(path).write_text("")

    def __call__(self, **kw: Any) -> dict:
        self.rows.append(kw)
        line = json.dumps(kw, default=str)
        if self.echo:
            print(line, flush=True)
        if self.path and self.lines:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        return kw

    def save(self) -> None:
        if self.path and not self.lines:
            Path(self.path).write_text(json.dumps(self.rows, indent=1, default=str))


class _Tee:
    """A text stream that writes to several (the console and the run's log file)."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()

    def isatty(self) -> bool:
        return False


def output_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--out", default=os.environ.get("OUT", ""),
                    help="folder for <script>.json and <script>.log (default: $OUT when set)")
    ap.add_argument("--debug-log", default=os.environ.get("DEBUG_LOG", ""),
                    help="comma list of the pack's loggers to log at DEBUG, e.g. preload,graphs ($DEBUG_LOG)")


def open_output(args: argparse.Namespace, name: str, lines: bool = False) -> Rows:
    """The run's rows; with ``--out DIR`` the rows go to DIR/<name>.json(l) unless ``--json`` says
    otherwise, and everything printed (logging included, once set up after this) to DIR/<name>.log."""
    for part in filter(None, args.debug_log.split(",")):
        logging.getLogger(f"diffusers_offload.{part.strip()}").setLevel(logging.DEBUG)
    path = args.json
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = path or str(out / f"{name}.{'jsonl' if lines else 'json'}")
        log = open(out / f"{name}.log", "a", buffering=1)  # noqa: SIM115 - open for the whole run
        sys.stdout, sys.stderr = _Tee(sys.__stdout__, log), _Tee(sys.__stderr__, log)
    return Rows(path, lines)
