"""Our nodes beside a native ComfyUI model in one ComfyUI process, under a VRAM cap (issue 3).

One process boots a real ComfyUI (the 2026 tree) the way its ``main.py`` does, so DynamicVRAM
(comfy-aimdo, ``ModelPatcherDynamic``) is on when a GPU is present, and registers this repository
as a custom node pack (as ``tests/comfyhost/harness.py`` does). A second process (the *ballast*)
holds device memory so that the card looks like ``--cap`` GiB. Then, through ComfyUI's executor
(API-format prompts, as ``POST /prompt`` runs them):

  ours     Load diffusers pipeline (offload settings: preload auto) -> Generate video -> capture
  native   UNETLoader -> forward timer -> KSampler (cfg 1, euler/simple) -> capture
  ours     again (new seed): our load must take VRAM back from the native model
  native   again: ComfyUI's load must take VRAM back from us

Both chains sit in one workflow, queued branch by branch, so both loaders stay cached (two
separate workflows would make the 2026 cache drop the other model on every switch). Both runs
use the same latent (480x832, 5 frames -> 1x16x2x60x104) and 1x512x4096 text states, one
denoiser call per step (guidance 1 / cfg 1), bf16 weights on both sides (``--bf16-unet``).

The diffusers pipeline is a Wan 2.1 T2V folder with the 14B transformer geometry but ``--layers``
blocks, a one-layer UMT5 of width 4096 with a code-built tokenizer and a small Wan VAE;
the native model is the same geometry in ComfyUI's key layout (``make_wan_sd.py``). Weights are
random, streamed to disk by a separate build process (``--build-only``; random numbers made on the
GPU), reused when the stamp matches.

Recorded per phase: every denoiser forward (synchronised: ours around the transformer call with
the engine's hooks inside, native around ``apply_model`` with DynamicVRAM's loads inside), each
``free_memory`` ComfyUI ran and each ``LoadedModel.model_unload`` it made (who gave how much back),
the loaded/size of every entry of ``current_loaded_models``, DynamicVRAM's resident bytes, torch
allocator readings, and device memory polled in a background thread (``cudaMemGetInfo`` and, if
present, NVML), less the ballast. JSON lines go to ``--json``.

GPU (driver: bench/comfy_coexist.sh):
    python3 bench/comfy_coexist.py --comfy-dir .gpu/comfyui --cap 24 --layers 20 --json $OUT/coexist.jsonl
CPU smoke (DynamicVRAM off, tiny models, no ballast):
    COMFYUI_PATH=/work/comfyui-2026 .venv/bin/python bench/comfy_coexist.py --cpu --tiny
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

# Nothing here may import torch before ComfyUI's start-up has run (cuda_malloc picks the allocator).
ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
WAN14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
              out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
              cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
WAN_TINY = dict(WAN14B, num_attention_heads=2, attention_head_dim=64, ffn_dim=256, num_layers=2)
NATIVE_14B = dict(dim=5120, ffn_dim=13824)  # make_wan_sd presets; heads = dim // 128
NATIVE_TINY = dict(dim=128, ffn_dim=256)
TEXT_DIM = 4096  # ComfyUI's WanModel does not read text_dim from the file: keep 4096 on both sides
PIPE_NAME = "wan_coexist"
ANCHOR_DIRS = (ROOT / ".gpu" / "native_anchor", ROOT.parent / "shared" / "reference" / "native_anchor")

log = logging.getLogger("coexist")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--comfy-dir", default=os.environ.get("COMFYUI_PATH") or str(ROOT / ".gpu" / "comfyui"),
                    help="ComfyUI tree (default: $COMFYUI_PATH, else .gpu/comfyui)")
    ap.add_argument("--work", default="/tmp/comfy_coexist", help="ComfyUI base dir (models, user, output)")
    ap.add_argument("--cpu", action="store_true", help="ComfyUI --cpu (DynamicVRAM off, no ballast)")
    ap.add_argument("--tiny", action="store_true", help="tiny geometry (CPU smoke test)")
    ap.add_argument("--cap", type=float, default=24.0, help="imitate a card of this many GiB (0: no ballast)")
    ap.add_argument("--layers", type=int, default=20, help="transformer blocks of both models (14B has 40)")
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--frames", type=int, default=5, help="video frames (4n+1); latent frames (n+1)")
    ap.add_argument("--steps", type=int, default=4, help="denoise steps of each run, ours and native")
    ap.add_argument("--sequence", default="ours,native,ours,native", help="phases in order")
    ap.add_argument("--native-dtype", choices=["default", "bf16"], default="bf16",
                    help="bf16 passes --bf16-unet (equal dtype with ours); default: ComfyUI's pick (fp16)")
    ap.add_argument("--preload", default="auto", help="Offload settings 'preload' of our loader")
    ap.add_argument("--comfy-args", default="", help="extra ComfyUI command-line flags")
    ap.add_argument("--cache", choices=["ram", "classic", "lru"], default="ram",
                    help="executor cache: ram = the 2026 server's default (keeps both models' loaders "
                         "cached across prompts); classic drops the other prompt's outputs")
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--json", default=None, help="append JSON lines here")
    ap.add_argument("--anchor-dir", default=None, help="folder of make_wan_sd.py and native_bench.py")
    ap.add_argument("--rebuild", action="store_true", help="write the models again even when stamped")
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.tiny:
        a.layers = min(a.layers, 2)
    return a


# ------------------------------------------------------------------------------------ helpers


def load_by_path(name: str, path: Path) -> ModuleType:
    """Import one file as a module without putting its folder on sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def anchor_dir(a: argparse.Namespace) -> Path:
    dirs = [Path(a.anchor_dir)] if a.anchor_dir else list(ANCHOR_DIRS)
    for d in dirs:
        if (d / "make_wan_sd.py").is_file() and (d / "native_bench.py").is_file():
            return d
    raise SystemExit(f"make_wan_sd.py / native_bench.py not found in {', '.join(map(str, dirs))}: "
                     "run `bash bench/comfy_coexist.sh prep` (copies them into .gpu/native_anchor)")


def gib(n: float | None) -> float | None:
    return None if n is None else round(n / GiB, 3)


def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


class _AvStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for PyAV where it is not installed (the GPU image has none; its wheel is 36 MB).

    ComfyUI's ``comfy_api.latest`` imports ``av`` at module level for its video types; nothing
    here encodes or decodes video (our Generate node only wraps frames in ``VideoFromComponents``),
    so names resolve to inert placeholders and any real use fails loudly."""

    def find_spec(self, name, path=None, target=None):
        if name == "av" or name.startswith("av."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []
        cache: dict[str, type] = {}

        def __getattr__(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            if attr not in cache:
                def fail(*_a, **_k):
                    raise RuntimeError(f"{module.__name__}.{attr}: PyAV is stubbed in this bench")
                cache[attr] = type(attr, (Exception,), {"__module__": module.__name__, "open": staticmethod(fail)})
            return cache[attr]

        module.__getattr__ = __getattr__


def stub_av_if_missing() -> bool:
    if importlib.util.find_spec("av") is not None:
        return False
    sys.meta_path.append(_AvStub())
    return True


# ----------------------------------------------------------------------------- model building


def diffusers_config(a: argparse.Namespace) -> dict[str, Any]:
    return dict(WAN_TINY if a.tiny else WAN14B, num_layers=a.layers)


def native_config(a: argparse.Namespace) -> dict[str, Any]:
    return dict(NATIVE_TINY if a.tiny else NATIVE_14B, layers=a.layers)


def paths(a: argparse.Namespace) -> SimpleNamespace:
    base = Path(a.work).resolve()
    tag = f"{'tiny' if a.tiny else '14b'}_L{a.layers}"
    return SimpleNamespace(
        base=base,
        pipe=base / "models" / "diffusers" / PIPE_NAME,
        native_name=f"wan21_t2v_{tag}_random_bf16.safetensors",
        native=base / "models" / "diffusion_models" / f"wan21_t2v_{tag}_random_bf16.safetensors",
        stamp=base / "models" / f"coexist_{tag}.json",
    )


def _init_for(name: str, shape: tuple[int, ...]) -> tuple:
    """Random-weight init in make_wan_sd's terms: fan-in scaled weights, unit norms, small biases."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name and len(shape) == 1:
        return ("ones",) if leaf == "weight" else ("zeros",)
    if leaf == "scale_shift_table" or name.endswith("scale_shift_table"):
        return ("normal", 1.0 / math.sqrt(shape[-1]))
    if leaf == "weight" and len(shape) >= 2:
        return ("normal", 1.0 / math.sqrt(math.prod(shape[1:])))
    return ("normal", 0.02)


def build_models(a: argparse.Namespace) -> dict[str, Any]:
    """Write the diffusers pipeline folder and the native file (a process of its own: its
    allocations and RNG never touch the measured process)."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    mk = load_by_path("make_wan_sd", anchor_dir(a) / "make_wan_sd.py")
    tiny_tok = load_by_path("coexist_tiny_tok", ROOT / "tests" / "fixtures" / "tiny_tok.py")
    p = paths(a)
    device = "cuda" if (not a.cpu and torch.cuda.is_available()) else "cpu"
    out: dict[str, Any] = {"device": device}
    t0 = time.perf_counter()

    # Pipeline folder: small parts built as modules, the transformer streamed to disk.
    if p.pipe.exists():
        shutil.rmtree(p.pipe)
    torch.manual_seed(0)
    tokenizer = tiny_tok.tiny_t5_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=64, d_ff=256, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))
    vae = AutoencoderKLWan(base_dim=8 if a.tiny else 16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    pipe.save_pretrained(p.pipe)
    index_file = p.pipe / "model_index.json"
    index = json.loads(index_file.read_text())
    index["transformer"] = ["diffusers", "WanTransformer3DModel"]
    index_file.write_text(json.dumps(index, indent=2))

    cfg = diffusers_config(a)
    with torch.device("meta"):
        meta = WanTransformer3DModel(**cfg)
    tdir = p.pipe / "transformer"
    tdir.mkdir(parents=True, exist_ok=True)
    meta.save_config(tdir)
    specs = [(n, tuple(t.shape), _init_for(n, tuple(t.shape))) for n, t in meta.state_dict().items()]
    t1 = time.perf_counter()
    size = mk.write_safetensors(str(tdir / "diffusion_pytorch_model.safetensors"), specs, device=device, seed=0)
    out["diffusers_transformer_gb"] = round(size / 1e9, 3)
    out["diffusers_write_s"] = round(time.perf_counter() - t1, 2)
    del meta, pipe, text_encoder, vae

    # Native file in ComfyUI's layout, same geometry.
    ncfg = native_config(a)
    nspecs = mk.wan_tensor_specs(ncfg["dim"], ncfg["ffn_dim"], ncfg["layers"], text_dim=TEXT_DIM)
    p.native.parent.mkdir(parents=True, exist_ok=True)
    t1 = time.perf_counter()
    nsize = mk.write_safetensors(str(p.native), nspecs, device=device, seed=1,
                                 metadata={"random_weights": "1", "wan_config": json.dumps(ncfg)})
    out["native_gb"] = round(nsize / 1e9, 3)
    out["native_write_s"] = round(time.perf_counter() - t1, 2)
    out["build_s"] = round(time.perf_counter() - t0, 2)
    p.stamp.write_text(json.dumps(stamp_of(a)))
    return out


def stamp_of(a: argparse.Namespace) -> dict[str, Any]:
    return {"diffusers": diffusers_config(a), "native": native_config(a), "text_dim": TEXT_DIM, "version": 1}


def ensure_models(a: argparse.Namespace) -> dict[str, Any]:
    p = paths(a)
    built = p.stamp.is_file() and p.native.is_file() and (p.pipe / "model_index.json").is_file()
    if not a.rebuild and built and json.loads(p.stamp.read_text()) == json.loads(json.dumps(stamp_of(a))):
        return {"reused": True}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--build-only", *sys.argv[1:]]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("BUILD ")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"model build failed (rc={res.returncode}):\n{res.stdout[-4000:]}")
    info = json.loads(lines[-1][len("BUILD "):])
    info["build_process_s"] = round(time.perf_counter() - t0, 2)
    return info


# ------------------------------------------------------------------------------- ComfyUI host


def make_host(a: argparse.Namespace, p: SimpleNamespace, comfy_dir: Path):
    """A ``tests/comfyhost`` harness host whose start-up is main.py's (DynamicVRAM included),
    not the harness's forced ``--cpu``; prompts run through the same validate/execute path."""
    harness = load_by_path("coexist_harness", ROOT / "tests" / "comfyhost" / "harness.py")
    native_bench = load_by_path("coexist_native_bench", anchor_dir(a) / "native_bench.py")

    class CoexistHost(harness.ComfyHost):
        """The suite's host, started the way ``main.py`` starts ComfyUI on a GPU (DynamicVRAM)."""

        def _configure(self) -> None:
            flags = ["--base-directory", str(self.base_dir), "--front-end-root", str(self.base_dir / "web_root")]
            if a.native_dtype == "bf16":
                flags.append("--bf16-unet")
            flags += a.comfy_args.split()
            opts = SimpleNamespace(comfy_dir=str(self.comfy_dir), cpu=a.cpu, comfy_args=" ".join(flags),
                                   startup="replicate")
            self.startup_args, self.startup_notes = native_bench.comfy_startup(opts)

        def _start_server(self) -> None:
            super()._start_server()
            if a.cache == "ram":  # the 2026 server's default, with main.py's default sizes
                total = self.model_management.total_ram / 1024.0
                self.set_cache("ram", ram=min(10.0, max(2.0, total * 0.10)), ram_inactive=min(128.0, total))
            else:
                self.set_cache(a.cache, lru=10)

    return CoexistHost(comfy_dir, p.base)


# ------------------------------------------------------------------------- helper node classes


def helper_nodes(rec: Recorder) -> dict[str, type]:
    """Nodes registered for this run only: random conditioning, a forward timer, a capture."""
    import torch

    class CoexistCond:
        RETURN_TYPES = ("CONDITIONING",)
        FUNCTION = "run"
        CATEGORY = "testing"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"seed": ("INT", {"default": 0}), "text_len": ("INT", {"default": 512})}}

        def run(self, seed, text_len):
            g = torch.Generator().manual_seed(seed)  # what CLIPTextEncode gives a Wan model: (1, 512, 4096)
            ctx = torch.randn((1, text_len, TEXT_DIM), generator=g) * 0.5
            return ([[ctx, {}]],)

    class CoexistTimer:
        """A clone of the MODEL whose every ``apply_model`` is synchronised and timed."""

        RETURN_TYPES = ("MODEL",)
        FUNCTION = "run"
        CATEGORY = "testing"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"model": ("MODEL",), "tag": ("STRING", {"default": ""})}}

        @classmethod
        def IS_CHANGED(cls, **_):
            return float("nan")

        def run(self, model, tag):
            def timed(apply_model, p):
                rec.sync()
                t = time.perf_counter()
                out = apply_model(p["input"], p["timestep"], **p["c"])
                rec.sync()
                rec.forward("native", time.perf_counter() - t)
                return out

            m = model.clone()
            m.set_model_unet_function_wrapper(timed)
            return (m,)

    class CoexistCapture:
        RETURN_TYPES = ()
        OUTPUT_NODE = True
        FUNCTION = "run"
        CATEGORY = "testing"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"value": ("*",), "key": ("STRING", {"default": ""})}}

        @classmethod
        def VALIDATE_INPUTS(cls, input_types=None, **_):
            return True

        @classmethod
        def IS_CHANGED(cls, **_):
            return float("nan")

        def run(self, value, key):
            rec.captured[key] = value
            return {}

    return {"CoexistCond": CoexistCond, "CoexistTimer": CoexistTimer, "CoexistCapture": CoexistCapture}


# ------------------------------------------------------------------------------------ recording


class Poller(threading.Thread):
    """Device memory used (cudaMemGetInfo; NVML as a cross-check that bypasses the CUDA runtime)."""

    def __init__(self, torch, cuda: bool, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.torch, self.cuda, self.dt = torch, cuda, interval_s
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()
        self.nvml = None
        self.total = 0
        if cuda:
            self.total = torch.cuda.mem_get_info()[1]
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()))
            except Exception:
                self.nvml = None
        self.reset()
        self.run_peak = self.run_peak_nvml = 0
        self.run_min_free = None
        self.samples = 0

    def reset(self) -> None:
        with self.lock:
            self.peak = self.peak_nvml = 0
            self.min_free = None

    def read(self) -> tuple[int, int | None]:
        free, _ = self.torch.cuda.mem_get_info()
        used_nvml = None
        if self.nvml is not None:
            used_nvml = int(self.nvml[0].nvmlDeviceGetMemoryInfo(self.nvml[1]).used)
        return self.total - free, used_nvml

    def sample(self) -> None:
        if not self.cuda:
            return
        used, nv = self.read()
        with self.lock:
            self.samples += 1
            self.peak = max(self.peak, used)
            self.run_peak = max(self.run_peak, used)
            free = self.total - used
            self.min_free = free if self.min_free is None else min(self.min_free, free)
            self.run_min_free = free if self.run_min_free is None else min(self.run_min_free, free)
            if nv is not None:
                self.peak_nvml = max(self.peak_nvml, nv)
                self.run_peak_nvml = max(self.run_peak_nvml, nv)

    def run(self) -> None:
        while not self.stop_ev.is_set():
            self.sample()
            self.stop_ev.wait(self.dt)

    def stop(self) -> None:
        self.stop_ev.set()
        self.join()
        self.sample()


class Ballast:
    """A second process holds device memory so that ``cap`` GiB (our process's usage included)
    is all the card has: the holder sizes itself after its own CUDA context exists."""

    CODE = ("import sys, torch; leave = int(sys.argv[1]); free, _ = torch.cuda.mem_get_info(); "
            "n = max(free - leave, 0); x = torch.empty(n, dtype=torch.uint8, device='cuda'); "
            "torch.cuda.synchronize(); print('held', n, flush=True); sys.stdin.read()")

    def __init__(self, torch, poller: Poller, cap_gib: float) -> None:
        self.proc = None
        self.used_before, self.nvml_before = poller.read()
        self.hold = 0
        leave = int(cap_gib * GiB) - self.used_before
        if leave <= 0:
            raise SystemExit(f"cap {cap_gib} GiB is below what this process already uses "
                             f"({self.used_before / GiB:.2f} GiB)")
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(leave)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "held":
            raise SystemExit("ballast process failed")
        self.hold = int(line[1])
        used_after, nvml_after = poller.read()
        self.used = used_after - self.used_before  # its allocation and its CUDA context
        self.nvml_used = None if nvml_after is None else nvml_after - self.nvml_before
        self.free_after = poller.total - used_after
        self.card = poller.total - self.used  # what the imitated card holds in all

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            self.proc = None


class Recorder:
    """Per-phase records: forwards, ComfyUI's free_memory / model_unload calls, memory snapshots."""

    def __init__(self, torch, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda
        self.forwards: list[tuple[str, float]] = []
        self.events: list[dict[str, Any]] = []
        self.captured: dict[str, Any] = {}
        self.t0 = time.perf_counter()
        self.ours = None  # our DiffusersPatcher (from the loader's handle)
        self.native = None  # the native base patcher (UNETLoader's output)
        self.log_lines: list[str] = []

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def forward(self, who: str, seconds: float) -> None:
        self.forwards.append((who, seconds))

    def name(self, patcher: Any) -> str:
        if patcher is None:
            return "?"
        if self.ours is not None and patcher.is_clone(self.ours):
            return "ours"
        if self.native is not None and patcher.is_clone(self.native):
            return "native"
        if type(patcher).__name__ == "DiffusersPatcher":
            return "ours"
        if type(getattr(patcher, "model", None)).__name__.startswith("WAN"):
            return "native"
        return type(patcher).__name__

    def loaded_table(self, mm) -> list[dict[str, Any]]:
        rows = []
        for lm in mm.current_loaded_models:
            m = lm.model
            if m is None:
                rows.append({"who": "dead"})
                continue
            rows.append({"who": self.name(m), "id": f"{id(m):x}"[-6:], "patcher": type(m).__name__,
                         "model": type(m.model).__name__,
                         "dynamic": bool(m.is_dynamic()), "loaded_gib": gib(m.loaded_size()),
                         "size_gib": gib(m.model_size()), "device": str(lm.device)})
        return rows

    def install(self, mm) -> None:
        """Wrap ComfyUI's ``free_memory`` and ``LoadedModel.model_unload`` to log who gave what back."""
        rec = self
        orig_free = mm.free_memory
        orig_unload = mm.LoadedModel.model_unload
        orig_load = mm.load_models_gpu

        def free_memory(memory_required, device, keep_loaded=[], for_dynamic=False, **kw):  # noqa: B006
            t = time.perf_counter() - rec.t0
            free_before = _free(mm, device)
            out = orig_free(memory_required, device, keep_loaded, for_dynamic=for_dynamic, **kw)
            rec.events.append({"t": round(t, 3), "event": "free_memory", "required_gib": gib(memory_required),
                               "for_dynamic": for_dynamic, "device": str(device),
                               "free_before_gib": gib(free_before), "free_after_gib": gib(_free(mm, device)),
                               "unloaded": [rec.name(lm.model) for lm in out]})
            return out

        def model_unload(self, memory_to_free=None, unpatch_weights=True):
            m = self.model
            who, before = rec.name(m), m.loaded_size() if m is not None else 0
            t = time.perf_counter() - rec.t0
            out = orig_unload(self, memory_to_free, unpatch_weights)
            after = m.loaded_size() if m is not None else 0
            rec.events.append({"t": round(t, 3), "event": "model_unload", "who": who,
                               "asked_gib": gib(memory_to_free), "loaded_before_gib": gib(before),
                               "loaded_after_gib": gib(after), "fully_unloaded": bool(out)})
            return out

        def load_models_gpu(models, memory_required=0, *args, **kwargs):
            t = time.perf_counter() - rec.t0
            out = orig_load(models, memory_required, *args, **kwargs)
            rec.events.append({"t": round(t, 3), "event": "load_models_gpu",
                               "models": [rec.name(m) for m in models], "memory_required_gib": gib(memory_required),
                               "loaded_after": {rec.name(m): gib(m.loaded_size()) for m in models}})
            return out

        mm.free_memory = free_memory
        mm.LoadedModel.model_unload = model_unload
        mm.load_models_gpu = load_models_gpu
        # Modules that imported the name directly (``from comfy.model_management import ...``).
        for mod in list(sys.modules.values()):
            for attr, new, old in (("load_models_gpu", load_models_gpu, orig_load), ("free_memory", free_memory, orig_free)):
                try:
                    if getattr(mod, attr, None) is old and mod is not mm:
                        setattr(mod, attr, new)
                except Exception:
                    pass

    def snapshot(self, mm, ballast_used: int) -> dict[str, Any]:
        torch = self.torch
        s: dict[str, Any] = {"loaded_models": self.loaded_table(mm)}
        if self.ours is not None:
            rep = self.ours.report()
            s.update(ours_loaded_gib=gib(self.ours.loaded_size()), ours_size_gib=gib(self.ours.model_size()),
                     ours_registered=any(lm.model is not None and lm.model.is_clone(self.ours)
                                         for lm in mm.current_loaded_models),
                     ours_pinned_gib=gib(rep.pinned_bytes), ours_plan=rep.plan)
        if self.native is not None:
            s.update(native_loaded_gib=gib(self.native.loaded_size()), native_size_gib=gib(self.native.model_size()),
                     native_registered=any(lm.model is not None and lm.model.is_clone(self.native)
                                           for lm in mm.current_loaded_models))
        s["aimdo_vram_gib"] = gib(aimdo_usage())
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            s.update(torch_alloc_gib=gib(torch.cuda.memory_allocated()),
                     torch_reserved_gib=gib(torch.cuda.memory_reserved()),
                     used_less_ballast_gib=gib(total - free - ballast_used), free_gib=gib(free))
        return s


def _free(mm, device) -> int | None:
    try:
        return int(mm.get_free_memory(device)) if device is not None else None
    except Exception:
        return None


def aimdo_usage() -> int:
    try:
        import comfy_aimdo.control

        return int(comfy_aimdo.control.get_total_vram_usage())
    except Exception:
        return 0


def timed_transformer(rec: Recorder) -> None:
    """Time every call of the diffusers Wan transformer, engine hooks included (class-level
    ``__call__``: outside every hook the engine puts on the instance)."""
    import torch
    from diffusers import WanTransformer3DModel

    base_call = torch.nn.Module.__call__

    def __call__(self, *args, **kwargs):
        rec.sync()
        t = time.perf_counter()
        out = base_call(self, *args, **kwargs)
        rec.sync()
        rec.forward("ours", time.perf_counter() - t)
        return out

    WanTransformer3DModel.__call__ = __call__


class PhaseLog(logging.Handler):
    """Keeps the log lines that tell the memory story (loads, give-backs, DynamicVRAM)."""

    KEYS = ("gave back", "Requested to load", "loaded completely", "loaded partially", "models unloaded",
            "prepared for dynamic", "AIMDO", "blocks kept", "placement", "released", "Unloading", "pin ",
            "shortage", "OOM", "out of memory", "Model loaded:", "memory free called", "evictions")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:
            return
        if any(k in msg for k in self.KEYS):
            self.lines.append(f"{record.name}: {msg.splitlines()[0][:300]}")


# -------------------------------------------------------------------------------------- prompts


def settings_inputs(a: argparse.Namespace) -> dict[str, Any]:
    from_defaults = {"mode": "auto", "use_stream": True, "record_stream": False, "pin_memory": True,
                     "pin_reserve_gb": 4.0, "on_demand_threshold_gb": 1.0, "resident_floor_mb": 64.0,
                     "always": "", "never": "", "preload": a.preload, "prefetch_window": 1, "device": "",
                     "measures_path": ""}
    if a.tiny:  # tiny parts get the roles full-size ones would (tools/offload_examples.TINY_OVERRIDES)
        from_defaults.update(resident_floor_mb=0.0, on_demand_threshold_gb=0.0)
    return from_defaults


def ours_prompt(a: argparse.Namespace, seed: int) -> dict[str, Any]:
    return {
        "s": {"class_type": "DiffusersOffloadSettings", "inputs": settings_inputs(a)},
        "l": {"class_type": "DiffusersOffloadLoadPipeline",
              "inputs": {"model": PIPE_NAME, "dtype": "fp32" if a.cpu else "bf16", "offload": ["s", 0]}},
        "g": {"class_type": "DiffusersOffloadGenerateVideo",
              "inputs": {"pipe": ["l", 0], "prompt": "a red fox running through snow", "negative_prompt": "",
                         "seed": seed, "steps": a.steps, "guidance": 1.0, "width": a.width, "height": a.height,
                         "frames": a.frames, "fps": 0.0}},
        "ch": {"class_type": "CoexistCapture", "inputs": {"value": ["l", 0], "key": "ours_handle"}},
        "cf": {"class_type": "CoexistCapture", "inputs": {"value": ["g", 1], "key": "ours_frames"}},
    }


def native_prompt(a: argparse.Namespace, p: SimpleNamespace, seed: int) -> dict[str, Any]:
    return {
        "n1": {"class_type": "UNETLoader", "inputs": {"unet_name": p.native_name, "weight_dtype": "default"}},
        "n2": {"class_type": "CoexistTimer", "inputs": {"model": ["n1", 0], "tag": "native"}},
        "n3": {"class_type": "CoexistCond", "inputs": {"seed": seed, "text_len": 512}},
        "n4": {"class_type": "EmptyHunyuanLatentVideo",
               "inputs": {"width": a.width, "height": a.height, "length": a.frames, "batch_size": 1}},
        "n5": {"class_type": "KSampler",
               "inputs": {"model": ["n2", 0], "seed": seed, "steps": a.steps, "cfg": 1.0, "sampler_name": "euler",
                          "scheduler": "simple", "positive": ["n3", 0], "negative": ["n3", 0],
                          "latent_image": ["n4", 0], "denoise": 1.0}},
        "cm": {"class_type": "CoexistCapture", "inputs": {"value": ["n1", 0], "key": "native_model"}},
        "cl": {"class_type": "CoexistCapture", "inputs": {"value": ["n5", 0], "key": "native_latent"}},
    }


# ----------------------------------------------------------------------------------------- main


def main() -> int:
    a = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    if a.build_only:
        info = build_models(a)
        print("BUILD " + json.dumps(info), flush=True)
        return 0

    p = paths(a)
    comfy_dir = Path(a.comfy_dir).resolve()
    if not (comfy_dir / "main.py").is_file():
        raise SystemExit(f"no ComfyUI tree at {comfy_dir} (set --comfy-dir or COMFYUI_PATH)")
    t_start = time.perf_counter()

    def stamp(what: str) -> None:
        print(f"== [{time.perf_counter() - t_start:6.1f}s] {what}", flush=True)

    build = ensure_models(a)
    stamp(f"models ready: {json.dumps(build)}")
    av_stubbed = stub_av_if_missing()

    t0 = time.perf_counter()
    host = make_host(a, p, comfy_dir)
    t_boot = time.perf_counter() - t0
    stamp(f"ComfyUI {host.version} up in {t_boot:.1f}s")

    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher
    import torch

    cuda = (not a.cpu) and torch.cuda.is_available()
    rec = Recorder(torch, cuda)
    status = host.pack_status()
    if "DiffusersOffloadGenerateVideo" not in status.node_ids:
        print("\n".join(host.init_log[-40:]))
        raise SystemExit(f"our pack did not load: {status}")
    for name, cls in helper_nodes(rec).items():
        host.nodes.NODE_CLASS_MAPPINGS[name] = cls
    host.comfy_utils.PROGRESS_THROTTLE_MIN_INTERVAL = 0.0
    rec.install(mm)
    timed_transformer(rec)
    phase_log = PhaseLog()
    root = logging.getLogger()
    root.addHandler(phase_log)
    # ComfyUI's DETAIL level (15: "AIMDO free", "Model loaded", "Non dynamic memory free called")
    # reaches our handler; the console handlers keep their own INFO level.
    root.setLevel(min(root.level or logging.INFO, 15))

    env = {
        "section": "env", "comfyui": host.version, "torch": torch.__version__, "python": sys.version.split()[0],
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "cpu": a.cpu, "tiny": a.tiny,
        "aimdo_enabled": bool(getattr(comfy.memory_management, "aimdo_enabled", False)),
        "core_model_patcher": comfy.model_patcher.CoreModelPatcher.__name__,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "torch_allocator_backend": torch.cuda.get_allocator_backend() if cuda else None,
        "vram_state": str(mm.vram_state), "av_stubbed": av_stubbed, "boot_s": round(t_boot, 2),
        "startup_notes": host.startup_notes,
        "pack_nodes": len(status.node_ids), "build": build, "args": vars(a),
        "diffusers": _version("diffusers"), "comfy_aimdo": _version("comfy-aimdo"),
        "comfy_kitchen": _version("comfy-kitchen"), "transformers": _version("transformers"),
    }
    emit(a, env)
    print(f"DynamicVRAM {'ON' if env['aimdo_enabled'] else 'off'}, CoreModelPatcher {env['core_model_patcher']}, "
          f"allocator {env['torch_allocator_backend']}, vram_state {env['vram_state']}, av stubbed {av_stubbed}",
          flush=True)

    poller = Poller(torch, cuda, a.poll_ms / 1000.0)
    ballast = None
    ballast_used = 0
    if cuda and a.cap > 0:
        ballast = Ballast(torch, poller, a.cap)
        ballast_used = ballast.used
        emit(a, {"section": "ballast", "cap_gib": a.cap, "hold_gib": gib(ballast.hold),
                 "ballast_used_gib": gib(ballast.used), "card_gib": gib(ballast.card),
                 "used_before_gib": gib(ballast.used_before), "free_after_gib": gib(ballast.free_after),
                 "total_gib": gib(poller.total)}, echo=True)
        stamp(f"ballast holds {ballast.hold / GiB:.2f} GiB: the card has {ballast.card / GiB:.2f} GiB")
    poller.start()

    rows: list[dict[str, Any]] = []
    seeds = {"ours": 0, "native": 0}
    try:
        for phase in [s.strip() for s in a.sequence.split(",") if s.strip()]:
            if phase not in seeds:
                raise SystemExit(f"unknown phase {phase!r} in --sequence (ours, native)")
            seeds[phase] += 1
            stamp(f"phase {phase} #{seeds[phase]}")
            row = run_phase(a, p, host, mm, rec, poller, phase, seeds, ballast_used, phase_log,
                            nvml_ballast=(ballast.nvml_used or 0) if ballast else 0)
            rows.append(row)
            emit(a, row)
    finally:
        poller.stop()
        if ballast is not None:
            ballast.close()

    summary = summarize(a, rows, poller, ballast, cuda, time.perf_counter() - t_start)
    emit(a, summary, echo=True)
    print_report(a, env, rows, summary, ballast)
    return 0 if summary["ok"] else 1


def _version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except Exception:
        return None


def emit(a: argparse.Namespace, row: dict[str, Any], echo: bool = False) -> None:
    """One JSON line to --json (echoed to stdout only without --json, or when asked)."""
    line = json.dumps(row, default=str)
    if echo or not a.json:
        print("JSON " + line, flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(line + "\n")


def run_phase(a, p, host, mm, rec: Recorder, poller: Poller, phase: str, seeds: dict[str, int],
              ballast_used: int, phase_log: PhaseLog, nvml_ballast: int = 0) -> dict[str, Any]:
    torch = rec.torch
    # One workflow holding both chains, run branch by branch ("queue selected output"): both
    # loaders stay in the executor cache, as in a workflow a user switches between branches of.
    # (Two separate workflows would reload both models on every switch: the 2026 RAM-pressure
    # cache drops a ModelPatcher output of an inactive workflow first.)
    prompt = {**ours_prompt(a, seeds["ours"]), **native_prompt(a, p, seeds["native"])}
    outputs = ["ch", "cf"] if phase == "ours" else ["cm", "cl"]
    seed = seeds[phase]
    rec.forwards.clear()
    rec.events.clear()
    phase_log.lines.clear()
    rec.t0 = time.perf_counter()
    before = rec.snapshot(mm, ballast_used)
    retries0 = _alloc_retries(torch) if rec.cuda else 0
    poller.reset()
    if rec.cuda:
        try:
            torch.cuda.reset_peak_memory_stats()
        except Exception as exc:  # not every allocator backend keeps peaks
            print("reset_peak_memory_stats:", exc, flush=True)
    err = None
    t0 = time.perf_counter()
    try:
        result = host.run_prompt(prompt, outputs)
        if not result.success:
            e = result.error or {}
            err = f"{e.get('node_type')}: {e.get('exception_type')}: {str(e.get('exception_message'))[:400]}"
            tb = "".join(e.get("traceback", []))
            print(f"[{phase}] FAILED {err}\n{tb[-3000:]}", flush=True)
    except Exception as exc:  # report, do not hide
        traceback.print_exc()
        err = f"{type(exc).__name__}: {str(exc)[:400]}"
    wall = time.perf_counter() - t0
    poller.sample()
    reloaded = False
    handle = rec.captured.pop("ours_handle", None)
    if handle is not None:
        reloaded = rec.ours is not None and handle.patcher is not rec.ours
        rec.ours = handle.patcher
    native = rec.captured.pop("native_model", None)
    if native is not None:
        reloaded = rec.native is not None and native is not rec.native
        rec.native = native
    del handle, native
    after = rec.snapshot(mm, ballast_used)
    times = [s for who, s in rec.forwards if who == phase]
    finite = None
    out = rec.captured.get("ours_frames" if phase == "ours" else "native_latent")
    if out is not None:
        t = out["samples"] if isinstance(out, dict) else out
        finite = bool(torch.isfinite(t).all())
    row = {
        "section": "phase", "phase": phase, "seed": seed, "error": err, "wall_s": round(wall, 3),
        "forwards": len(times), "forward_s": [round(x, 4) for x in times],
        "first_forward_s": round(times[0], 4) if times else None,
        "median_rest_s": round(statistics.median(times[1:]), 4) if len(times) > 1 else None,
        "output_finite": finite, "model_reloaded": reloaded,
        "before": before, "after": after, "events": list(rec.events), "log": list(phase_log.lines[-60:]),
    }
    if rec.cuda:
        row.update(peak_used_less_ballast_gib=gib(poller.peak - ballast_used) if poller.peak else None,
                   peak_nvml_less_ballast_gib=gib(poller.peak_nvml - nvml_ballast) if poller.peak_nvml else None,
                   min_free_gib=gib(poller.min_free), torch_max_alloc_gib=gib(torch.cuda.max_memory_allocated()),
                   torch_max_reserved_gib=gib(torch.cuda.max_memory_reserved()),
                   alloc_retries=_alloc_retries(torch) - retries0)
    for k in ("ours_frames", "native_latent"):
        rec.captured.pop(k, None)
    print_phase(row)
    return row


def _alloc_retries(torch) -> int:
    try:
        s = torch.cuda.memory_stats()
        return int(s.get("num_alloc_retries", 0)) + int(s.get("num_ooms", 0))
    except Exception:
        return 0


def print_phase(row: dict[str, Any]) -> None:
    b, f = row["before"], row["after"]
    print(f"\n== phase {row['phase']} (seed {row['seed']}): wall {row['wall_s']:.2f} s, {row['forwards']} forwards "
          f"{row['forward_s']}, error={row['error']}", flush=True)
    print(f"   ours   loaded {fmt(b.get('ours_loaded_gib'))} -> {fmt(f.get('ours_loaded_gib'))} GiB "
          f"of {fmt(f.get('ours_size_gib'))} (registered {f.get('ours_registered')}); plan: {f.get('ours_plan', '')}")
    print(f"   native loaded {fmt(b.get('native_loaded_gib'))} -> {fmt(f.get('native_loaded_gib'))} GiB "
          f"of {fmt(f.get('native_size_gib'))} (registered {f.get('native_registered')}); "
          f"aimdo vram {fmt(b.get('aimdo_vram_gib'))} -> {fmt(f.get('aimdo_vram_gib'))} GiB")
    if "peak_used_less_ballast_gib" in row:
        print(f"   device: peak used-less-ballast {fmt(row['peak_used_less_ballast_gib'])} GiB, min free "
              f"{fmt(row['min_free_gib'])} GiB, torch max alloc/reserved {fmt(row['torch_max_alloc_gib'])}/"
              f"{fmt(row['torch_max_reserved_gib'])} GiB, allocator retries+OOMs {row['alloc_retries']}")
    for e in row["events"]:
        if e["event"] == "free_memory":
            print(f"   t={e['t']:.2f}s free_memory(required {fmt(e['required_gib'])} GiB, for_dynamic={e['for_dynamic']}) "
                  f"free {fmt(e['free_before_gib'])} -> {fmt(e['free_after_gib'])} GiB, unloaded {e['unloaded']}")
        elif e["event"] == "model_unload":
            print(f"   t={e['t']:.2f}s   model_unload {e['who']}: asked {fmt(e['asked_gib'])} GiB, loaded "
                  f"{fmt(e['loaded_before_gib'])} -> {fmt(e['loaded_after_gib'])} GiB, fully={e['fully_unloaded']}")
        elif e["event"] == "load_models_gpu":
            print(f"   t={e['t']:.2f}s load_models_gpu({e['models']}, memory_required "
                  f"{fmt(e['memory_required_gib'])} GiB) -> loaded {e['loaded_after']}")
    for line in row["log"][-12:]:
        print(f"   log | {line}")
    sys.stdout.flush()


def summarize(a, rows, poller: Poller, ballast: Ballast | None, cuda: bool, total_s: float) -> dict[str, Any]:
    errors = [r["phase"] + ": " + r["error"] for r in rows if r["error"]]
    took_from_ours = any(e["event"] == "model_unload" and e["who"] == "ours"
                         for r in rows if r["phase"] == "native" for e in r["events"])
    took_from_native = any(e["event"] == "model_unload" and e["who"] == "native"
                           for r in rows if r["phase"] == "ours" for e in r["events"])
    s: dict[str, Any] = {
        "section": "summary", "total_s": round(total_s, 1), "errors": errors,
        "comfy_took_vram_from_ours": took_from_ours, "ours_took_vram_from_native": took_from_native,
        "outputs_finite": all(r["output_finite"] is not False for r in rows),
    }
    for who in ("ours", "native"):
        ts = [r for r in rows if r["phase"] == who]
        s[f"{who}_median_rest_s"] = [r["median_rest_s"] for r in ts]
        s[f"{who}_first_forward_s"] = [r["first_forward_s"] for r in ts]
    under = None
    if cuda:
        used_peak = poller.run_peak - (ballast.used if ballast else 0)
        nvml_peak = poller.run_peak_nvml - ((ballast.nvml_used or 0) if ballast else 0)
        s.update(peak_used_less_ballast_gib=gib(used_peak), min_free_gib=gib(poller.run_min_free),
                 peak_nvml_less_ballast_gib=gib(nvml_peak) if poller.run_peak_nvml else None,
                 poll_samples=poller.samples, cap_gib=a.cap if ballast else None,
                 card_gib=gib(ballast.card) if ballast else None,
                 alloc_retries=sum(r.get("alloc_retries", 0) for r in rows))
        if ballast:
            under = used_peak <= ballast.card
            resident_sums = [(r["after"].get("ours_loaded_gib") or 0) + (r["after"].get("native_loaded_gib") or 0)
                             for r in rows]
            s["resident_sum_after_each_phase_gib"] = [round(x, 3) for x in resident_sums]
            s["resident_sum_under_cap"] = all(x <= ballast.card / GiB for x in resident_sums)
    s["under_cap"] = under
    s["ok"] = not errors and under is not False
    return s


def print_report(a, env, rows, s, ballast) -> None:
    print("\n================ comfy_coexist report ================")
    print(f"ComfyUI {env['comfyui']}, torch {env['torch']}, GPU {env['gpu']}, DynamicVRAM "
          f"{'ON' if env['aimdo_enabled'] else 'off'} (CoreModelPatcher={env['core_model_patcher']}), "
          f"allocator {env['torch_allocator_backend']}, av stubbed: {env['av_stubbed']}")
    if ballast:
        print(f"cap {a.cap} GiB: ballast holds {ballast.hold / GiB:.2f} GiB (+context: {ballast.used / GiB:.2f} GiB "
              f"in all), card = {ballast.card / GiB:.2f} GiB")
    hdr = (f"{'phase':<8}{'wall s':>8}{'fwd1 s':>9}{'fwd med s':>10}{'ours GiB b->a':>16}{'native GiB b->a':>18}"
           f"{'peak-ballast':>14}{'min free':>10}  events")
    print(hdr)
    for r in rows:
        b, f = r["before"], r["after"]
        ev = "; ".join(
            f"{e['who']} {fmt(e['loaded_before_gib'])}->{fmt(e['loaded_after_gib'])}"
            for e in r["events"] if e["event"] == "model_unload")
        print(f"{r['phase']:<8}{r['wall_s']:>8.2f}{fmt(r['first_forward_s'], 3):>9}{fmt(r['median_rest_s'], 3):>10}"
              f"{fmt(b.get('ours_loaded_gib')) + '->' + fmt(f.get('ours_loaded_gib')):>16}"
              f"{fmt(b.get('native_loaded_gib')) + '->' + fmt(f.get('native_loaded_gib')):>18}"
              f"{fmt(r.get('peak_used_less_ballast_gib')):>14}{fmt(r.get('min_free_gib')):>10}  "
              f"{ev or '-'}{'  ERROR ' + r['error'] if r['error'] else ''}")
    print(f"ComfyUI took VRAM back from ours: {s['comfy_took_vram_from_ours']}; "
          f"ours took VRAM back from native: {s['ours_took_vram_from_native']}")
    if s.get("cap_gib"):
        print(f"peak used less ballast {fmt(s['peak_used_less_ballast_gib'])} GiB (NVML "
              f"{fmt(s['peak_nvml_less_ballast_gib'])}) of card {fmt(s['card_gib'])} GiB; "
              f"min free {fmt(s['min_free_gib'])} GiB; resident ours+native after each phase "
              f"{s['resident_sum_after_each_phase_gib']} GiB; allocator retries+OOMs {s['alloc_retries']}")
    print(f"under cap: {s['under_cap']}; outputs finite: {s['outputs_finite']}; errors: {s['errors'] or 'none'}; "
          f"total {s['total_s']} s")
    print(f"SUMMARY ok={s['ok']} under_cap={s['under_cap']} comfy_took_from_ours={s['comfy_took_vram_from_ours']} "
          f"ours_took_from_native={s['ours_took_vram_from_native']} ours_med={s['ours_median_rest_s']} "
          f"native_med={s['native_median_rest_s']} peak={s.get('peak_used_less_ballast_gib')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
