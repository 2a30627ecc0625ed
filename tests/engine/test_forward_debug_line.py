"""The preload driver's DEBUG line per forward says where that forward's host time went besides
launching: its plan at the cycle's start (kept blocks taken or given up, pieces held as compute
values), its CUDA graph captures and its graphs' first launches (instantiated, or their driver
memory mapped again), so a slow first forward of a run can be told apart (tiny Wan on the CPU,
where nothing is captured or launched)."""

import logging
import re
import time

from diffusers_offload.offload_core import Engine, OffloadConfig
from diffusers_offload.offload_core.preload import planner as planner_module
from fixtures.tiny_pipes import run_wan

SLOW_PLAN_S = 0.02


def test_each_forward_logs_the_host_time_of_its_plan_captures_and_first_launches(wan_pipe, monkeypatch, caplog) -> None:
    begin_cycle = planner_module.PreloadPlanner.begin_cycle

    def slow_plan(self, *args, **kwargs):
        time.sleep(SLOW_PLAN_S)
        return begin_cycle(self, *args, **kwargs)

    monkeypatch.setattr(planner_module.PreloadPlanner, "begin_cycle", slow_plan)
    caplog.set_level(logging.DEBUG, logger="diffusers_offload.preload")
    engine = Engine()
    engine.place(wan_pipe, OffloadConfig(on_demand_threshold_gb=0, resident_floor_mb=0, preload="auto"))
    try:
        run_wan(wan_pipe)
    finally:
        engine.release(wan_pipe)
    said = [re.search(r"host s: plan (\d+\.\d+), (\d+) captures (\d+\.\d+), (\d+) first launches (\d+\.\d+)$", r.getMessage())
            for r in caplog.records if " forward: " in r.getMessage()]
    assert said and all(m is not None for m in said)
    assert all(float(m[1]) >= SLOW_PLAN_S and m.groups()[1:] == ("0", "0.000", "0", "0.000") for m in said)
