"""The side-by-side table of `bench/wan_bench.py`: ratios to the bound, the best diffusers anchor
and the resident step, from one run's rows (hand-computed cases)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("bench_table", Path(__file__).parents[2] / "bench" / "bench_table.py")
bench_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_table)

H2D_GBS = 2**30 / 1e9  # one GiB a second: a streamed GiB costs one second
ROWS = [
    {"section": "env", "h2d_pinned_gbs": H2D_GBS},
    {"section": "resident", "workload": "small", "median_s": 0.5, "weights_gib": 4.0, "peak_alloc_gib": 5.0},
    {"section": "preload_auto", "cap_gib": 12.0, "workload": "small", "median_s": 2.2, "streamed_gib": 2.0,
     "peak_reserved_gib": 11.5, "pinned_gib": 4.0, "kept_gib": 2.0},
    {"section": "anchor", "mode": "diffusers leaf_level+stream", "workload": "small", "median_s": 4.4,
     "peak_alloc_gib": 1.0, "rss_gib": 6.0},
    {"section": "anchor", "mode": "diffusers block_level+stream", "workload": "small", "median_s": 8.8,
     "peak_alloc_gib": 1.0, "rss_gib": 6.0},
    {"section": "first_18", "cap_gib": 12.0, "workload": "small", "error": "OOM: CUDA out of memory"},
    {"section": "cycles", "cap_gib": 12.0, "cycles": 30, "ooms": 0, "ooms_met_by_engine": 4, "retries": 2, "peak_reserved_gib": 11.9,
     "worst_rel_err": 0.0},
]


def _cells(table: str, label: str) -> list[str]:
    line = next(x for x in table.splitlines() if x.startswith(f"| {label} "))
    return [c.strip() for c in line.strip("|").split("|")]


def test_ratios_to_bound_best_anchor_and_resident():
    table = bench_table.side_by_side(ROWS)
    ours = _cells(table, "preload_auto")
    assert ours[3:7] == ["2.2000", "1.100", "0.500", "4.400"]  # bound max(0.5, 2 GiB / 1 GiB/s) = 2 s
    leaf = _cells(table, "diffusers leaf_level+stream")
    assert leaf[4:6] == ["1.100", "1.000"]  # anchors move every weight: bound 4 s


def test_an_oom_row_and_the_cycles_are_reported():
    table = bench_table.side_by_side(ROWS)
    assert _cells(table, "first_18")[3].startswith("OOM")
    assert "30 cycles, 0 OOMs, 4 met and recovered by the engine, 2 allocator retries" in table


def test_no_timed_rows_no_table():
    assert bench_table.side_by_side(ROWS[:2]) == ""
