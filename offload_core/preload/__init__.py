"""Automatic VRAM preload: how many of a denoiser's streamed blocks stay resident.

Instead of a fixed block count, the planner keeps resident the longest prefix of a ranked block
order that fits beside the activations measured for the current workload, and learns from
shortages. Pure logic: it never touches the device, so the streamer feeds it readings.

Modules: ``ranking`` (preload order), ``workload`` (cycle key), ``fit`` (arithmetic),
``penalty`` (shortage learning), ``measures`` (process-wide, file-backed store), ``registry``
(planners of all models), ``policy`` (auto / off / fixed budget), ``planner`` (the state),
``plan_line`` (the plan in one line, for the log and the UI).

How the streamer drives a ``PreloadPlanner``:

1. Build it once per model object, with one ``BlockInfo`` per entry of its block table and a
   ``reader`` returning ``MemoryReading(free, cached_unused, resident)``: device free bytes,
   allocator reserved minus allocated, and this model's kept blocks and streaming buffers
   on the device (what a new plan may reuse).
2. ``on_load()`` when placing the weights: returns the block indices to load resident.
3. On entering the first block of the first tower: ``begin_cycle(workload, ended)``, with
   ``workload = workload_of(args, kwargs)`` of that call (or the model's own function) and
   ``ended = CycleUsage(peak, weights_floor)`` of the cycle now ending (``None`` if unknown).
   It returns the resident set for this cycle: load what is new, evict what left, then reset
   the allocator's peak counter. ``end_cycle(usage)`` closes a cycle early (the call returned).
4. When an allocation fails or the allocator's retry counter rises: ``on_shortage(running,
   needed)`` returns a ``Relief``: the blocks to evict, or streaming buffers given up
   (``ring_slots`` fell); retry the allocation and continue the step. An empty answer means
   nothing more can go: a true out-of-memory.
5. ``on_unload()`` when the weights leave the device.

The host calls ``notify_model_load()`` whenever any other model loads, and attaches its measure
file once: ``process_store().attach(path)``. ``planner.last_plan_line`` is the plan for the UI.
"""

from .fit import CycleUsage, MemoryReading
from .measures import MeasureKey, MeasureStore, process_store
from .planner import MemoryReadingFn, PreloadPlanner, Relief
from .policy import AUTO, OFF, Policy, parse_policy
from .ranking import BlockInfo, rank_blocks
from .registry import notify_model_load
from .workload import WorkloadFn, workload_of

__all__ = [
    "AUTO",
    "OFF",
    "BlockInfo",
    "CycleUsage",
    "MeasureKey",
    "MeasureStore",
    "MemoryReadingFn",
    "MemoryReading",
    "Policy",
    "PreloadPlanner",
    "Relief",
    "WorkloadFn",
    "notify_model_load",
    "parse_policy",
    "process_store",
    "rank_blocks",
    "workload_of",
]
