"""single_file_node.py's files and readings: a Wan 2.1 T2V single file in ComfyUI's key layout
(fp8-scaled or NVFP4: `denoiser_files`), a configs-only diffusers folder of the family, a
text-encoder and a VAE file; then, in the ComfyUI process, what each side holds, the host's memory,
and the rows and table of the run. Nothing here imports torch at module level.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from . import ROOT, GiB, gib, load_module
from .denoiser_files import write_fp8_scaled, write_nvfp4

TEXT_DIM = 4096  # ComfyUI's WanModel takes text_dim 4096 whatever the file holds
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
UMT5 = dict(d_model=TEXT_DIM, d_kv=64, d_ff=256, num_layers=1, num_heads=4, relative_attention_num_buckets=8)
UMT5_IDS = dict(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
WAN_VAE = dict(z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
WAN_FIXED = dict(patch_size=(1, 2, 2), attention_head_dim=128, in_channels=16, out_channels=16, freq_dim=256)
WAN_NORMS = dict(cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
RSS_FIELDS = {
    "VmRSS": "rss_gib",
    "RssAnon": "rss_anon_gib",
    "RssFile": "rss_file_gib",
    "VmHWM": "rss_peak_gib",
}


def diffusers_config(dim: int, ffn_dim: int, layers: int) -> dict[str, Any]:
    """The diffusers Wan transformer config of the file's geometry; heads as ComfyUI reads them
    (dim // 128), so both sides compute the same attention."""
    geometry = dict(num_attention_heads=dim // 128, text_dim=TEXT_DIM, ffn_dim=ffn_dim, num_layers=layers)
    return {**WAN_FIXED, **geometry, **WAN_NORMS}


def write_parts(config_dir: Path, te_file: Path, vae_file: Path, transformer: dict, tiny: bool) -> dict:
    """A configs-only Wan 2.1 T2V diffusers folder (index, transformer config, code-built
    tokenizer, scheduler, text-encoder and VAE configs) and the text-encoder and VAE weights as
    single files: a one-layer UMT5 of width 4096 (transformers' key names, as ComfyUI's
    text_encoders files are) and a small Wan VAE (diffusers' key names). Random weights."""
    import diffusers
    import torch
    from transformers import UMT5Config, UMT5EncoderModel

    tiny_tok = load_module("single_file_tiny_tok", ROOT / "tests" / "fixtures" / "tiny_tok.py")
    torch.manual_seed(0)
    tokenizer = tiny_tok.tiny_t5_tokenizer()
    parts = {
        "tokenizer": tokenizer,
        "transformer": None,
        "vae": diffusers.AutoencoderKLWan(base_dim=8 if tiny else 16, **WAN_VAE),
        "text_encoder": UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **UMT5, **UMT5_IDS)),
    }
    config_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=config_dir.parent.parent) as tmp:  # not listed as a model
        full = Path(tmp) / "full"
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0)
        diffusers.WanPipeline(**parts, scheduler=scheduler).save_pretrained(full)
        for part, out in (("text_encoder", te_file), ("vae", vae_file)):
            files = sorted((full / part).glob("*.safetensors"))
            if len(files) != 1:
                raise RuntimeError(f"expected one weight file in {full / part}, found {files}")
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(files[0]), out)
        if config_dir.exists():
            shutil.rmtree(config_dir)
        shutil.copytree(full, config_dir, ignore=shutil.ignore_patterns(*(f"*{s}" for s in WEIGHT_SUFFIXES)))
    index_file = config_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    index["transformer"] = ["diffusers", "WanTransformer3DModel"]
    index_file.write_text(json.dumps(index, indent=2))
    with torch.device("meta"):
        diffusers.WanTransformer3DModel(**transformer).save_config(config_dir / "transformer")
    return {"text_encoder_bytes": te_file.stat().st_size, "vae_bytes": vae_file.stat().st_size}


def build(anchor: Path, files: Any, native: dict, device: str, tiny: bool, marker: int = 0,
          nvfp4: bool = False) -> dict[str, Any]:
    """Everything the run needs (``files``: config_dir, denoiser, text_encoder, vae paths), timed."""
    mk = load_module("make_wan_sd", anchor / "make_wan_sd.py")
    t0 = time.perf_counter()
    specs = mk.wan_tensor_specs(native["dim"], native["ffn_dim"], native["layers"], text_dim=TEXT_DIM)
    files.denoiser.parent.mkdir(parents=True, exist_ok=True)
    meta = {"random_weights": "1", "wan_config": json.dumps(native)}
    written = write_nvfp4(files.denoiser, specs, device, 1, meta) if nvfp4 else \
        write_fp8_scaled(files.denoiser, specs, device, 1, meta, marker)
    out = dict(device=device, **written)
    out["denoiser_write_s"], t1 = round(time.perf_counter() - t0, 2), time.perf_counter()
    config = diffusers_config(native["dim"], native["ffn_dim"], native["layers"])
    out.update(write_parts(files.config_dir, files.text_encoder, files.vae, config, tiny))
    return dict(
        out, parts_write_s=round(time.perf_counter() - t1, 2), build_s=round(time.perf_counter() - t0, 2)
    )


# -- the run's readings (in the ComfyUI process, after its start-up) --------------------------------
def unload_all(mm) -> None:
    """ComfyUI's ``unload_all_models``; on trees before 2026 (their ``free_memory`` takes no
    ``for_dynamic``, which benchkit.comfy.Recorder's wrapper passes) the same by hand."""
    try:
        mm.unload_all_models()
    except TypeError:
        for lm in list(mm.current_loaded_models):
            lm.model_unload()
        mm.current_loaded_models.clear()
    mm.soft_empty_cache()


def host_rss() -> dict[str, float | None]:
    """This process's resident memory (GiB): all, anonymous, file-backed (mapped files), peak."""
    out: dict[str, float | None] = dict.fromkeys(RSS_FIELDS.values())
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in RSS_FIELDS:
                out[RSS_FIELDS[key]] = round(int(value.split()[0]) * 1024 / GiB, 3)
    except OSError:
        pass
    return out


def ours_facts(patcher: Any) -> dict[str, Any]:
    """Our transformer: storage bytes, kept and streamed bytes, pins, plan, engine OOMs."""
    rep = patcher.report()
    try:
        t = rep.component("transformer")
    except KeyError:
        return {"plan": rep.plan}
    d, streamed = t.details, t.details.get("streamed_per_step")
    sizes = {"transformer_bytes": t.nbytes, "kept_gib": gib(d.get("kept_bytes")), "streamed_bytes": streamed}
    more = {"streamed_gib": gib(streamed), "pinned_gib": gib(rep.pinned_bytes), "engine_ooms": d.get("ooms")}
    return {**sizes, **more, "sync_loads": d.get("sync_loads"), "dtypes": list(t.dtypes), "plan": rep.plan}


def native_facts(patcher: Any) -> dict[str, Any]:
    """ComfyUI's model: loaded bytes, dtypes, and how it runs a block's Linear layers (the ops
    class, the quant format, and, on 2026 trees, whether its matmuls run in fp8)."""
    model = patcher.model
    out = {
        "native_loaded_gib": gib(patcher.loaded_size()),
        "native_size_gib": gib(patcher.model_size()),
        "native_weight_dtype": str(getattr(model, "get_dtype", lambda: None)()),
        "native_manual_cast": str(getattr(model, "manual_cast_dtype", None)),
    }
    try:
        layer = model.diffusion_model.blocks[0].self_attn.q
    except (AttributeError, IndexError, TypeError):
        return out
    fp8_mm = getattr(layer, "layout_type", None) is not None and not getattr(
        layer, "_full_precision_mm", True
    )
    ops = f"{type(layer).__module__}.{type(layer).__qualname__}"
    storage = str(getattr(getattr(layer, "weight", None), "dtype", None))
    quant = getattr(layer, "quant_format", None)
    return dict(
        out,
        native_ops=ops,
        native_quant_format=quant,
        native_fp8_matmul=fp8_mm,
        native_weight_storage=storage,
    )


# -- the rows and the table -------------------------------------------------------------------------
def _last(phases: list[dict], phase: str, workload: str) -> dict[str, Any] | None:
    return next((r for r in reversed(phases) if r["phase"] == phase and r["workload"] == workload), None)


def steady(times: list[float]) -> dict[str, float | None]:
    """The steady step (median of the second half of the steps after the first) and the warm-up
    (what the steps after the first took beyond it): plan changes and CUDA graph captures settle
    in the first steps after the first, which the median of all of them mixes in."""
    rest = times[1:]
    if len(rest) < 2:
        return {"steady_s": None, "warmup_s": None}
    settled = statistics.median(rest[len(rest) // 2:])
    return {"steady_s": round(settled, 4), "warmup_s": round(sum(max(0.0, t - settled) for t in rest), 4)}


def summarize(c: Any, h2d: float | None, rows: Any) -> list[dict[str, Any]]:
    """Per workload: ours / native, and ours against its bound, max(fp8-resident step, streamed
    storage bytes / pinned H2D); then the host's memory against the file's storage bytes."""
    out = []
    for w in c.a.workload_list:
        ours, native, res, again = (_last(c.phases, phase, w) for phase in ("ours", "native", "resident", "again"))
        o, n, r_s = (r["median_rest_s"] if r else None for r in (ours, native, res))
        streamed = ours.get("streamed_bytes") if ours else None
        pcie = streamed / h2d if streamed is not None and h2d else None
        bound = max((x for x in (r_s, pcie) if x is not None), default=None)
        times = {"ours_s": o, "native_s": n, "ours_over_native": _ratio(o, n), "resident_s": r_s}
        o_st, n_st = (r.get("steady_s") if r else None for r in (ours, native))
        settled = {"ours_steady_s": o_st, "native_steady_s": n_st, "steady_ours_over_native": _ratio(o_st, n_st),
                   "steady_ours_over_bound": _ratio(o_st, bound), "ours_warmup_s": ours.get("warmup_s") if ours else None,
                   "again_s": again and again["median_rest_s"], "again_warmup_s": again and again.get("warmup_s")}
        kept_all = res is not None and res.get("streamed_bytes") == 0
        errors = [r["error"] for r in (ours, native, res, again) if r and r["error"]]
        out.append(
            rows(
                section="row",
                workload=w,
                cap_gib=c.a.cap if c.ballast_used else None,
                **times,
                resident_kept_all=kept_all,
                streamed_gib=gib(streamed),
                pcie_s=_round(pcie),
                bound_s=_round(bound),
                ours_over_bound=_ratio(o, bound),
                **settled,
                errors=errors,
            )
        )
    storage, now = c.p.denoiser.stat().st_size, host_rss()
    first_ours = next((r["rss_gib"] for r in c.phases if r["phase"] != "native"), None)
    first_native = next((r["rss_gib"] for r in c.phases if r["phase"] == "native"), None)
    host = rows(
        section="host",
        storage_gib=gib(storage),
        rss_end_gib=now["rss_gib"],
        rss_peak_gib=now["rss_peak_gib"],
        ours_rss_after_load_gib=first_ours,
        native_rss_after_load_gib=first_native,
        peak_over_storage=_ratio(now["rss_peak_gib"], gib(storage)),
    )
    return [*out, host]


def print_table(c: Any, results: list[dict], h2d: float | None, total_s: float) -> None:
    a, cap = c.a, c.a.cap if c.ballast_used else "none"
    print(
        f"\n================ single_file_node: {c.p.names.denoiser} ({a.layers} blocks), ComfyUI "
        f"{c.host.version}, cap {cap} GiB, native weight_dtype {a.native_weight_dtype} ================"
    )
    print(
        f"{'workload':<9}{'row':<10}{'fwd1 s':>9}{'median s':>10}{'steady s':>10}{'warm-up s':>11}{'kept GiB':>10}{'strm GiB':>10}"
        f"{'peak GiB':>10}{'OOM/retry':>11}{'RSS GiB':>9}  error"
    )
    for r in c.phases:
        kept = r.get("kept_gib") if r["phase"] != "native" else r.get("native_loaded_gib")
        oom = f"{r['torch_ooms']}/{r['alloc_retries']}"
        print(
            f"{r['workload']:<9}{r['phase']:<10}{_fmt(r['first_forward_s'], 4):>9}{_fmt(r['median_rest_s'], 4):>10}"
            f"{_fmt(r.get('steady_s'), 4):>10}{_fmt(r.get('warmup_s'), 3):>11}"
            f"{_fmt(kept):>10}{_fmt(r.get('streamed_gib')):>10}{_fmt(r.get('peak_used_less_ballast_gib')):>10}"
            f"{oom:>11}{_fmt(r['rss_gib']):>9}  {r['error'] or ''}"
        )
    print(
        f"\n{'workload':<9}{'ours s':>9}{'native s':>10}{'ours/native':>13}{'resident s':>12}{'H2D s':>9}"
        f"{'bound s':>9}{'ours/bound':>12}{'steady: ours':>14}{'/native':>9}{'/bound':>8}{'warm-up s':>11}"
    )
    for r in results[:-1]:
        print(
            f"{r['workload']:<9}{_fmt(r['ours_s'], 4):>9}{_fmt(r['native_s'], 4):>10}"
            f"{_fmt(r['ours_over_native'], 3):>13}{_fmt(r['resident_s'], 4):>12}{_fmt(r['pcie_s'], 4):>9}"
            f"{_fmt(r['bound_s'], 4):>9}{_fmt(r['ours_over_bound'], 3):>12}{_fmt(r['ours_steady_s'], 4):>14}"
            f"{_fmt(r['steady_ours_over_native'], 3):>9}{_fmt(r['steady_ours_over_bound'], 3):>8}"
            f"{_fmt(r['ours_warmup_s'], 3):>11}"
        )
    h = results[-1]
    print(
        f"host: storage {h['storage_gib']} GiB; RSS after ours' first load {h['ours_rss_after_load_gib']} GiB, "
        f"after native's {h['native_rss_after_load_gib']} GiB, peak {h['rss_peak_gib']} GiB "
        f"({_fmt(h['peak_over_storage'])} x storage, both models in one process); pinned H2D {gbs(h2d)}; "
        f"total {total_s:.1f} s",
        flush=True,
    )


def _ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 4) if x is not None and y else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def gbs(h2d: float | None) -> str:
    return f"{h2d / 1e9:.1f} GB/s" if h2d else "n/a"


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"
