"""The side-by-side table `wan_bench.py` prints at the end of a run: every timed row of that one
process against the bound, the best diffusers anchor and the resident step, measured together.

Pure over the JSON rows the bench writes, so the ratios are checked without a GPU:
``python bench/wan_bench.py --self-check`` runs ``self_check`` (hand-computed cases).
"""

from __future__ import annotations

from . import GiB

TIMED = ("stream", "preload_auto", "first_", "anchor", "mmgp")


def _timed(row: dict) -> bool:
    """A row of a timed section: with its step time, or the error it met (a first-K that OOMs)."""
    return ("median_s" in row or "error" in row) and str(row.get("section", "")).startswith(TIMED)


def bound_s(row: dict, resident_s: float, weights_gib: float, h2d_bytes_s: float) -> float | None:
    """max(resident step, bytes moved per step / pinned H2D bandwidth): our rows report what they
    copied per timed step (else what their plan streams); the diffusers anchors move every weight
    each step; mmgp reports no byte count."""
    if not h2d_bytes_s:
        return None
    if row.get("moved_gib") is not None:
        moved = row["moved_gib"]
    elif "streamed_gib" in row:
        moved = row["streamed_gib"]
    elif row.get("section") == "anchor":
        moved = weights_gib
    else:
        return None
    return max(resident_s, moved * GiB / h2d_bytes_s)


def _label(row: dict) -> str:
    return row.get("mode") or row["section"]


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.3f}" if b else "–"


def _host(row: dict) -> str:
    if "pinned_gib" in row:
        return f"{row['pinned_gib']:.2f} pinned"
    return f"RSS {row['rss_gib']:.1f}" if "rss_gib" in row else "–"


def _kept(row: dict) -> str:
    if "kept_gib" in row:
        return f"{row['kept_gib']:.2f} GiB"
    return f"{row['kept']} blocks" if "kept" in row else "–"


def _sync(row: dict, key: str) -> str:
    """A sync-load count: "n/a" where the streamer had no side stream (the CPU), "–" for rows
    without the count (resident, the anchors, mmgp)."""
    if row.get(key) is None:
        return "–"
    return str(row[key]) if row.get("sync_side_stream", True) else "n/a"


def sync_verdict(rows: list[dict]) -> str:
    """One line: did every timed forward of every engine row find its streamed units copied ahead?"""
    counted = [r for r in rows if r.get("sync_loads_timed") is not None and r.get("sync_side_stream")]
    if not counted:
        return "sync loads: not counted in this run (no side stream: CPU dry run)"
    bad = [f"{_label(r)} {r.get('cap_gib') or ''} {r['workload']}: {r['sync_loads_timed']}".replace("  ", " ")
           for r in counted if r["sync_loads_timed"]]
    first = sum(r.get("sync_loads_first") or 0 for r in counted)
    if bad:
        return f"sync loads in timed forwards: {len(bad)} of {len(counted)} rows ({'; '.join(bad)})"
    return (f"sync loads in timed forwards: 0 in all {len(counted)} engine rows (every streamed unit was copied "
            f"ahead); first forwards: {first} in all")


def side_by_side(rows: list[dict]) -> str:
    """Markdown table of the timed rows (plus one line per cycles row); empty without them."""
    env = next((r for r in rows if r.get("section") == "env"), {})
    resident = {r["workload"]: r for r in rows if r.get("section") == "resident"}
    timed = [r for r in rows if _timed(r) and r.get("workload") in resident]
    if not env or not timed:
        return ""
    h2d = (env.get("h2d_pinned_gbs") or 0) * 1e9  # none on the CPU dry run: no bound
    weights = next(iter(resident.values())).get("weights_gib", 0.0)
    anchors: dict[str, float] = {}
    for r in rows:
        if r.get("section") == "anchor":
            anchors[r["workload"]] = min(anchors.get(r["workload"], float("inf")), r["median_s"])
    lines = [
        f"bound = max(resident step, bytes moved per step / {h2d / 1e9:.1f} GB/s pinned H2D)" if h2d
        else "no bound: no pinned H2D bandwidth in this run (CPU dry run)",
        "",
        "| row | cap GiB | workload | step s | / bound | / best diffusers | / resident | peak VRAM GiB | host GiB | kept "
        "| sync loads | 1st fwd sync |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for w, r in resident.items():
        lines.append(f"| resident | – | {w} | {r['median_s']:.4f} | – | {_ratio(r['median_s'], anchors.get(w))} | 1.000 "
                     f"| {r['peak_alloc_gib']:.2f} | – | all | – | – |")
    for r in timed:
        if "median_s" not in r:
            lines.append(f"| {_label(r)} | {r.get('cap_gib') or '–'} | {r['workload']} | {r['error'][:40]} |||||||||")
            continue
        res = resident[r["workload"]]["median_s"]
        peak = r.get("peak_reserved_gib", r.get("peak_alloc_gib", 0.0))
        cap = r.get("cap_gib") or "–"
        lines.append(f"| {_label(r)} | {cap} | {r['workload']} | {r['median_s']:.4f} "
                     f"| {_ratio(r['median_s'], bound_s(r, res, weights, h2d))} "
                     f"| {_ratio(r['median_s'], anchors.get(r['workload']))} | {_ratio(r['median_s'], res)} "
                     f"| {peak:.2f} | {_host(r)} | {_kept(r)} | {_sync(r, 'sync_loads_timed')} "
                     f"| {_sync(r, 'sync_loads_first')} |")
    for r in rows:
        if r.get("section") == "cycles":
            lines.append(f"\ncycles at {r['cap_gib']} GiB: {r['cycles']} cycles, {r['ooms']} OOMs, "
                         f"{r.get('ooms_met_by_engine', 0)} met and recovered by the engine, {r['retries']} "
                         f"allocator retries, peak reserved {r['peak_reserved_gib']:.2f} GiB, "
                         f"worst relative error {r['worst_rel_err']:.3g}, sync loads after the first cycle "
                         f"{_sync(r, 'sync_loads_after_first')}")
    lines.append("\n" + sync_verdict(rows))
    return "\n".join(lines)


def self_check() -> None:
    """The table on hand-computed rows: one streamed GiB a second, so a GiB moved costs a second."""
    rows = [
        {"section": "env", "h2d_pinned_gbs": GiB / 1e9},
        {"section": "resident", "workload": "small", "median_s": 0.5, "weights_gib": 4.0, "peak_alloc_gib": 5.0},
        {"section": "preload_auto", "cap_gib": 12.0, "workload": "small", "median_s": 2.2, "streamed_gib": 2.0,
         "peak_reserved_gib": 11.5, "pinned_gib": 4.0, "kept_gib": 2.0, "sync_loads_timed": 0,
         "sync_loads_first": 40, "sync_side_stream": True},
        {"section": "stream", "workload": "small", "median_s": 4.0, "streamed_gib": 4.0, "peak_reserved_gib": 1.0,
         "pinned_gib": 4.0, "kept_gib": 0.0, "sync_loads_timed": 3, "sync_loads_first": 5, "sync_side_stream": True},
        {"section": "anchor", "mode": "diffusers leaf_level+stream", "workload": "small", "median_s": 4.4,
         "peak_alloc_gib": 1.0, "rss_gib": 6.0},
        {"section": "anchor", "mode": "diffusers block_level+stream", "workload": "small", "median_s": 8.8,
         "peak_alloc_gib": 1.0, "rss_gib": 6.0},
        {"section": "first_18", "cap_gib": 12.0, "workload": "small", "error": "OOM: CUDA out of memory"},
        {"section": "cycles", "cap_gib": 12.0, "cycles": 30, "ooms": 0, "ooms_met_by_engine": 4, "retries": 2,
         "peak_reserved_gib": 11.9, "worst_rel_err": 0.0},
    ]
    table = side_by_side(rows)

    def cells(label: str) -> list[str]:
        line = next(x for x in table.splitlines() if x.startswith(f"| {label} "))
        return [c.strip() for c in line.strip("|").split("|")]

    checks = {
        "ours: bound max(0.5, 2 GiB / 1 GiB/s) = 2 s": cells("preload_auto")[3:7] == ["2.2000", "1.100", "0.500", "4.400"],
        "an anchor moves every weight: bound 4 s": cells("diffusers leaf_level+stream")[4:6] == ["1.100", "1.000"],
        "an OOM row is shown": cells("first_18")[3].startswith("OOM"),
        "the sync-load columns": cells("preload_auto")[10:] == ["0", "40"] and cells("resident")[10:] == ["–", "–"],
        "the sync-load verdict": "timed forwards: 1 of 2 rows (stream small: 3)" in table,
        "on the CPU: n/a": _sync({"sync_loads_timed": 0, "sync_side_stream": False}, "sync_loads_timed") == "n/a",
        "the cycles line": "30 cycles, 0 OOMs, 4 met and recovered by the engine, 2 allocator retries" in table,
        "no timed rows, no table": side_by_side(rows[:2]) == "",
    }
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    if not all(checks.values()):
        print(table)
        raise SystemExit("table self-check failed")
