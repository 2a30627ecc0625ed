"""comfy_coexist.py's summary of its phases (who took memory from whom, medians, peaks against
the cap) and the report it prints."""

from __future__ import annotations

from typing import Any

from . import GiB, gib


def summarize(a, rows, poller, ballast, total_s: float) -> dict[str, Any]:
    def took(phase: str, who: str) -> bool:
        return any(e["event"] == "model_unload" and e["who"] == who for r in rows if r["phase"] == phase
                   for e in r["events"])

    errors = [r["phase"] + ": " + r["error"] for r in rows if r["error"]]
    s: dict[str, Any] = {"section": "summary", "total_s": round(total_s, 1), "errors": errors,
                         "comfy_took_vram_from_ours": took("native", "ours"),
                         "ours_took_vram_from_native": took("ours", "native"),
                         "outputs_finite": all(r["output_finite"] is not False for r in rows)}
    for who in ("ours", "native"):
        s[f"{who}_median_rest_s"] = [r["median_rest_s"] for r in rows if r["phase"] == who]
        s[f"{who}_first_forward_s"] = [r["first_forward_s"] for r in rows if r["phase"] == who]
    under = None
    if poller is not None:
        used_peak = poller.run_peak - (ballast.used if ballast else 0)
        s.update(peak_used_less_ballast_gib=gib(used_peak), min_free_gib=gib(poller.run_min_free),
                 peak_nvml_less_ballast_gib=gib(poller.run_peak_nvml - ((ballast.nvml_used or 0) if ballast else 0))
                 if poller.run_peak_nvml else None, poll_samples=poller.samples,
                 cap_gib=a.cap if ballast else None, card_gib=gib(ballast.card) if ballast else None,
                 alloc_retries=sum(r.get("alloc_retries", 0) for r in rows))
        if ballast:
            under = used_peak <= ballast.card
            sums = [(r["after"].get("ours_loaded_gib") or 0) + (r["after"].get("native_loaded_gib") or 0) for r in rows]
            s["resident_sum_after_each_phase_gib"] = [round(x, 3) for x in sums]
            s["resident_sum_under_cap"] = all(x <= ballast.card / GiB for x in sums)
    s["under_cap"], s["ok"] = under, not errors and under is not False
    return s


def print_report(a, env, rows, s, ballast) -> None:
    print(f"\n================ comfy_coexist report ================\nComfyUI {env['comfyui']}, torch {env['torch']}, "
          f"GPU {env['gpu']}, DynamicVRAM {'ON' if env['aimdo_enabled'] else 'off'} (CoreModelPatcher="
          f"{env['core_model_patcher']}), allocator {env['torch_allocator_backend']}, av stubbed: {env['av_stubbed']}")
    if ballast:
        print(f"cap {a.cap} GiB: ballast holds {ballast.hold / GiB:.2f} GiB (+context: {ballast.used / GiB:.2f} GiB "
              f"in all), card = {ballast.card / GiB:.2f} GiB")
    print(f"{'phase':<8}{'wall s':>8}{'fwd1 s':>9}{'fwd med s':>10}{'ours GiB b->a':>16}{'native GiB b->a':>18}"
          f"{'peak-ballast':>14}{'min free':>10}  events")
    for r in rows:
        b, f = r["before"], r["after"]
        ev = "; ".join(f"{e['who']} {fmt(e['loaded_before_gib'])}->{fmt(e['loaded_after_gib'])}"
                       for e in r["events"] if e["event"] == "model_unload")
        print(f"{r['phase']:<8}{r['wall_s']:>8.2f}{fmt(r['first_forward_s'], 3):>9}{fmt(r['median_rest_s'], 3):>10}"
              f"{fmt(b.get('ours_loaded_gib')) + '->' + fmt(f.get('ours_loaded_gib')):>16}"
              f"{fmt(b.get('native_loaded_gib')) + '->' + fmt(f.get('native_loaded_gib')):>18}"
              f"{fmt(r.get('peak_used_less_ballast_gib')):>14}{fmt(r.get('min_free_gib')):>10}  "
              f"{ev or '-'}{'  ERROR ' + r['error'] if r['error'] else ''}")
    if s.get("cap_gib"):
        print(f"peak used less ballast {fmt(s['peak_used_less_ballast_gib'])} GiB (NVML {fmt(s['peak_nvml_less_ballast_gib'])})"
              f" of card {fmt(s['card_gib'])} GiB; min free {fmt(s['min_free_gib'])} GiB; resident ours+native after "
              f"each phase {s['resident_sum_after_each_phase_gib']} GiB; allocator retries+OOMs {s['alloc_retries']}")
    print(f"SUMMARY ok={s['ok']} under_cap={s['under_cap']} comfy_took_from_ours={s['comfy_took_vram_from_ours']} "
          f"ours_took_from_native={s['ours_took_vram_from_native']} ours_med={s['ours_median_rest_s']} "
          f"native_med={s['native_median_rest_s']} peak={s.get('peak_used_less_ballast_gib')} errors={s['errors'] or 'none'} "
          f"total={s['total_s']} s", flush=True)


def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"
