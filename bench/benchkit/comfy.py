"""A ComfyUI process instrumented for comfy_coexist.py: its models written to disk, PyAV stood in
for, the memory calls it makes recorded, and the nodes only this bench registers.

Nothing here imports torch at module level: ComfyUI's start-up must import it first (its
``cuda_malloc`` picks the allocator). The host itself is the test suite's
(``tests/comfyhost/harness.py``), loaded by path, and so is its capture node.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from . import ROOT, gib, load_module

TEXT_DIM = 4096  # ComfyUI's WanModel does not read text_dim from the file: 4096 on both sides
NATIVE_14B, NATIVE_TINY = dict(dim=5120, ffn_dim=13824), dict(dim=128, ffn_dim=256)  # make_wan_sd presets


def harness():
    """The suite's in-process ComfyUI host (a package: its modules import each other relatively)."""
    load_module("comfyhost", ROOT / "tests" / "comfyhost" / "__init__.py", package=True)
    return load_module("comfyhost.harness", ROOT / "tests" / "comfyhost" / "harness.py")


def capture_class() -> type:
    """The suite's capture node keyed by a string (``seen`` holds (key, value) pairs), taking any
    type: a ``*`` input still fails ComfyUI's type check for MODEL and LATENT without this."""
    base = load_module("coexist_capture", ROOT / "tests" / "comfyhost" / "capture.py").capture_class("key", "STRING")

    class CoexistCapture(base):
        @classmethod
        def VALIDATE_INPUTS(cls, input_types=None, **_):
            return True

    return CoexistCapture


def anchor_dir(dirs: list[Path]) -> Path:
    for d in dirs:
        if (d / "make_wan_sd.py").is_file() and (d / "native_bench.py").is_file():
            return d
    raise SystemExit(f"make_wan_sd.py / native_bench.py not found in {', '.join(map(str, dirs))}: "
                     "run `bash bench/comfy_coexist.sh prep` (copies them into .gpu/native_anchor)")


def start_host(comfy_dir: Path, base_dir: Path, flags: list[str], cache: str, anchor: Path | None):
    """The suite's ComfyUI host with ComfyUI's flags ``flags``. With the native anchor's folder, it
    starts as ``main.py`` starts ComfyUI on a GPU (DynamicVRAM included; ``native_bench.comfy_startup``);
    without, it keeps the harness's own ``--cpu`` start-up. ``cache``: the executor cache ("ram" is
    the 2026 server's default with main.py's sizes, "classic", "lru")."""
    h = harness()

    class CoexistHost(h.ComfyHost):
        def _configure(self) -> None:
            if anchor is None:
                super()._configure()
                cli_args = sys.modules["comfy.cli_args"]
                cli_args.parser.parse_args(flags, namespace=cli_args.args)  # sets only the flags given
                self.startup_notes = ["harness --cpu start-up"]
                return
            native_bench = load_module("coexist_native_bench", anchor / "native_bench.py")
            opts = SimpleNamespace(comfy_dir=str(self.comfy_dir), cpu=False, startup="replicate", comfy_args=" ".join(
                ["--base-directory", str(self.base_dir), "--front-end-root", str(self.base_dir / "web_root"), *flags]))
            self.startup_args, self.startup_notes = native_bench.comfy_startup(opts)

        def _start_server(self) -> None:
            super()._start_server()
            if cache == "ram":
                total = getattr(self.model_management, "total_ram", 0) / 1024.0
                self.set_cache("ram", ram=min(10.0, max(2.0, total * 0.10)), ram_inactive=min(128.0, total))
            else:
                self.set_cache(cache, lru=10)

    return CoexistHost(comfy_dir, base_dir)


# -- PyAV ----------------------------------------------------------------------------------------
class _AvStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for PyAV where it is not installed (the GPU image has none; its wheel is 36 MB).
    ComfyUI's ``comfy_api.latest`` imports ``av`` at module level for its video types; nothing here
    encodes video, so names resolve to inert placeholders and any real use fails loudly."""

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


# -- the two models on disk ----------------------------------------------------------------------
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


def write_models(pipe_dir: Path, native_file: Path, wan: dict, native: dict, anchor: Path, device: str,
                 tiny: bool) -> dict[str, Any]:
    """A diffusers Wan 2.1 T2V folder (``wan`` transformer config, a one-layer UMT5 of width 4096
    with a code-built tokenizer, a small Wan VAE) and the same geometry in ComfyUI's key layout
    (``make_wan_sd.py`` of the native anchor). Weights are random, streamed to disk."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    mk = load_module("make_wan_sd", anchor / "make_wan_sd.py")
    tiny_tok = load_module("coexist_tiny_tok", ROOT / "tests" / "fixtures" / "tiny_tok.py")
    out: dict[str, Any] = {"device": device}
    t0 = time.perf_counter()
    if pipe_dir.exists():
        shutil.rmtree(pipe_dir)
    torch.manual_seed(0)
    tokenizer = tiny_tok.tiny_t5_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=64, d_ff=256, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    vae = AutoencoderKLWan(base_dim=8 if tiny else 16, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=None,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0)).save_pretrained(pipe_dir)
    index_file = pipe_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    index["transformer"] = ["diffusers", "WanTransformer3DModel"]
    index_file.write_text(json.dumps(index, indent=2))
    with torch.device("meta"):
        meta = WanTransformer3DModel(**wan)
    tdir = pipe_dir / "transformer"
    tdir.mkdir(parents=True, exist_ok=True)
    meta.save_config(tdir)
    specs = [(n, tuple(t.shape), _init_for(n, tuple(t.shape))) for n, t in meta.state_dict().items()]
    t1 = time.perf_counter()
    size = mk.write_safetensors(str(tdir / "diffusion_pytorch_model.safetensors"), specs, device=device, seed=0)
    out.update(diffusers_transformer_gb=round(size / 1e9, 3), diffusers_write_s=round(time.perf_counter() - t1, 2))
    nspecs = mk.wan_tensor_specs(native["dim"], native["ffn_dim"], native["layers"], text_dim=TEXT_DIM)
    native_file.parent.mkdir(parents=True, exist_ok=True)
    t1 = time.perf_counter()
    nsize = mk.write_safetensors(str(native_file), nspecs, device=device, seed=1,
                                 metadata={"random_weights": "1", "wan_config": json.dumps(native)})
    out.update(native_gb=round(nsize / 1e9, 3), native_write_s=round(time.perf_counter() - t1, 2),
               build_s=round(time.perf_counter() - t0, 2))
    return out


# -- the nodes only this bench registers ---------------------------------------------------------
def helper_nodes(rec: Recorder) -> dict[str, type]:
    """Random conditioning (what CLIPTextEncode gives a Wan model: 1x512x4096), a MODEL clone whose
    every ``apply_model`` is synchronised and timed, and a capture (the suite's)."""
    import torch

    class CoexistCond:
        RETURN_TYPES = ("CONDITIONING",)
        FUNCTION = "run"
        CATEGORY = "testing"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"seed": ("INT", {"default": 0}), "text_len": ("INT", {"default": 512})}}

        def run(self, seed, text_len):
            g = torch.Generator().manual_seed(seed)
            return ([[torch.randn((1, text_len, TEXT_DIM), generator=g) * 0.5, {}]],)

    class CoexistTimer:
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
                rec.forwards.append(("native", time.perf_counter() - t))
                return out

            m = model.clone()
            m.set_model_unet_function_wrapper(timed)
            return (m,)

    return {"CoexistCond": CoexistCond, "CoexistTimer": CoexistTimer, "CoexistCapture": rec.capture}


# -- recording -----------------------------------------------------------------------------------
class Recorder:
    """Per phase: denoiser forwards, ComfyUI's free_memory / model_unload / load_models_gpu calls,
    memory snapshots, and the log lines that tell the memory story."""

    LOG_KEYS = ("gave back", "Requested to load", "loaded completely", "loaded partially", "models unloaded",
                "prepared for dynamic", "AIMDO", "blocks kept", "placement", "released", "Unloading", "pin ",
                "shortage", "OOM", "out of memory", "Model loaded:", "memory free called", "evictions")

    def __init__(self, torch, cuda: bool) -> None:
        self.torch, self.cuda = torch, cuda
        self.forwards: list[tuple[str, float]] = []
        self.events: list[dict[str, Any]] = []
        self.log: list[str] = []
        self.capture = capture_class()
        self.t0 = time.perf_counter()
        self.ours = None  # our DiffusersPatcher (from the loader's handle)
        self.native = None  # the native base patcher (UNETLoader's output)
        recorder = self

        class PhaseLog(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                try:
                    msg = record.getMessage()
                except Exception:
                    return
                if any(k in msg for k in Recorder.LOG_KEYS):
                    recorder.log.append(f"{record.name}: {msg.splitlines()[0][:300]}")

        root = logging.getLogger()
        root.addHandler(PhaseLog(logging.DEBUG))
        # ComfyUI's DETAIL level (15: "AIMDO free", "Model loaded") reaches the handler above.
        root.setLevel(min(root.level or logging.INFO, 15))

    def begin_phase(self) -> None:
        self.forwards.clear()
        self.events.clear()
        self.log.clear()
        self.capture.seen.clear()
        self.t0 = time.perf_counter()

    def captured(self, key: str) -> Any:
        return next((v for k, v in reversed(self.capture.seen) if k == key), None)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def name(self, patcher: Any) -> str:
        if patcher is None:
            return "?"
        if self.ours is not None and patcher.is_clone(self.ours):
            return "ours"
        if self.native is not None and patcher.is_clone(self.native):
            return "native"
        if type(patcher).__name__ == "DiffusersPatcher":
            return "ours"
        return "native" if type(getattr(patcher, "model", None)).__name__.startswith("WAN") else type(patcher).__name__

    def install(self, mm) -> None:
        """Wrap ComfyUI's ``free_memory``, ``load_models_gpu`` and ``LoadedModel.model_unload`` to log
        who gave what back; also in modules that imported the names directly."""
        rec, orig_free, orig_unload, orig_load = self, mm.free_memory, mm.LoadedModel.model_unload, mm.load_models_gpu

        def free_memory(memory_required, device, keep_loaded=[], for_dynamic=False, **kw):  # noqa: B006
            t, before = time.perf_counter() - rec.t0, _free(mm, device)
            out = orig_free(memory_required, device, keep_loaded, for_dynamic=for_dynamic, **kw)
            rec.events.append({"t": round(t, 3), "event": "free_memory", "required_gib": gib(memory_required),
                               "for_dynamic": for_dynamic, "device": str(device), "free_before_gib": gib(before),
                               "free_after_gib": gib(_free(mm, device)), "unloaded": [rec.name(lm.model) for lm in out]})
            return out

        def model_unload(self, memory_to_free=None, unpatch_weights=True):
            m = self.model
            who, before, t = rec.name(m), m.loaded_size() if m is not None else 0, time.perf_counter() - rec.t0
            out = orig_unload(self, memory_to_free, unpatch_weights)
            rec.events.append({"t": round(t, 3), "event": "model_unload", "who": who, "asked_gib": gib(memory_to_free),
                               "loaded_before_gib": gib(before),
                               "loaded_after_gib": gib(m.loaded_size() if m is not None else 0),
                               "fully_unloaded": bool(out)})
            return out

        def load_models_gpu(models, memory_required=0, *args, **kwargs):
            t = time.perf_counter() - rec.t0
            out = orig_load(models, memory_required, *args, **kwargs)
            rec.events.append({"t": round(t, 3), "event": "load_models_gpu", "models": [rec.name(m) for m in models],
                               "memory_required_gib": gib(memory_required),
                               "loaded_after": {rec.name(m): gib(m.loaded_size()) for m in models}})
            return out

        mm.free_memory, mm.LoadedModel.model_unload, mm.load_models_gpu = free_memory, model_unload, load_models_gpu
        for mod in list(sys.modules.values()):
            for attr, new, old in (("load_models_gpu", load_models_gpu, orig_load), ("free_memory", free_memory, orig_free)):
                try:
                    if mod is not mm and getattr(mod, attr, None) is old:
                        setattr(mod, attr, new)
                except Exception:
                    pass

    def time_transformer(self) -> None:
        """Time every call of the diffusers Wan transformer, the engine's hooks inside."""
        from diffusers import WanTransformer3DModel

        self.time_calls(WanTransformer3DModel, "ours")

    def time_calls(self, owner: Any, who: str, method: str = "__call__") -> None:
        """Record (``who``, seconds) for every call of ``owner.method`` (a class's method or a module's
        function), synchronised on both sides; ``__call__`` is wrapped at the class level: outside
        every hook the engine puts on the instance."""
        import torch

        base, rec = getattr(owner, method) if method != "__call__" else torch.nn.Module.__call__, self

        @functools.wraps(base)  # names what it wraps: the engine finds diffusers' decode bridge under it
        def timed(*args, **kwargs):
            rec.sync()
            t = time.perf_counter()
            out = base(*args, **kwargs)
            rec.sync()
            rec.forwards.append((who, time.perf_counter() - t))
            return out

        setattr(owner, method, timed)

    def snapshot(self, mm, ballast_used: int) -> dict[str, Any]:
        """Loaded/size of both models and of every entry ComfyUI holds, DynamicVRAM's bytes, torch's."""
        s: dict[str, Any] = {"loaded_models": [
            {"who": "dead"} if lm.model is None else
            {"who": self.name(lm.model), "id": f"{id(lm.model):x}"[-6:], "patcher": type(lm.model).__name__,
             "model": type(lm.model.model).__name__,
             "dynamic": bool(getattr(lm.model, "is_dynamic", bool)()), "loaded_gib": gib(lm.model.loaded_size()),
             "size_gib": gib(lm.model.model_size()), "device": str(lm.device)}
            for lm in mm.current_loaded_models]}
        for who, patcher in (("ours", self.ours), ("native", self.native)):
            if patcher is not None:
                s.update({f"{who}_loaded_gib": gib(patcher.loaded_size()), f"{who}_size_gib": gib(patcher.model_size()),
                          f"{who}_registered": any(lm.model is not None and lm.model.is_clone(patcher)
                                                   for lm in mm.current_loaded_models)})
        if self.ours is not None:
            rep = self.ours.report()
            s.update(ours_pinned_gib=gib(rep.pinned_bytes), ours_plan=rep.plan)
        try:
            import comfy_aimdo.control

            s["aimdo_vram_gib"] = gib(int(comfy_aimdo.control.get_total_vram_usage()))
        except Exception:
            s["aimdo_vram_gib"] = 0.0
        if self.cuda:
            free, total = self.torch.cuda.mem_get_info()
            s.update(torch_alloc_gib=gib(self.torch.cuda.memory_allocated()),
                     torch_reserved_gib=gib(self.torch.cuda.memory_reserved()),
                     used_less_ballast_gib=gib(total - free - ballast_used), free_gib=gib(free))
        return s


def _free(mm, device) -> int | None:
    try:
        return int(mm.get_free_memory(device)) if device is not None else None
    except Exception:
        return None
