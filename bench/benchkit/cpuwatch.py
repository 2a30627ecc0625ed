"""Who uses the CPU while a forward is launched: this process's threads, the main thread's
context switches and cores, the machine's other load (Linux ``/proc``).

Why: on the H200 some processes launch the same forward 30-60 % slower on the host after the
engine's placement, uniformly block by block, and even the driver's own calls (cudaLaunchKernel)
take longer (bench/README.md, run 28): a thread or another process competing for the main
thread's core would show here, a slower core (frequency, cache) would not.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _threads() -> dict[int, tuple[str, float, int]]:
    """tid -> (name, user+system CPU seconds, the core it last ran on)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 onwards
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) * TICK_S, int(fields[36]))
    return out


def _switches(tid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of thread ``tid``."""
    text = Path(f"/proc/self/task/{tid}/status").read_text()
    values = dict(line.split(":", 1) for line in text.splitlines() if "ctxt_switches" in line)
    return int(values["voluntary_ctxt_switches"]), int(values["nonvoluntary_ctxt_switches"])


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat's first line)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v) - idle) * TICK_S, sum(v) * TICK_S


def core_mhz(core: int) -> float | None:
    """The core's current clock where the kernel exposes it (not in every VM)."""
    path = Path(f"/sys/devices/system/cpu/cpu{core}/cpufreq/scaling_cur_freq")
    try:
        return int(path.read_text()) / 1e3
    except (OSError, ValueError):
        return None


class CpuWatch:
    """Context manager: over its span, the CPU seconds of each thread of this process (those that
    used any), the main thread's context switches and the cores it ran on (sampled at entry and
    exit), the machine's busy cores on average, and the process's own share of them."""

    def __enter__(self) -> CpuWatch:
        self.tid = threading.get_native_id()
        self._t0, self._threads0 = time.perf_counter(), _threads()
        self._sw0, self._busy0 = _switches(self.tid), _machine_busy()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        threads, sw, busy = _threads(), _switches(self.tid), _machine_busy()
        used = {}
        for tid, (name, cpu, _core) in threads.items():
            spent = cpu - self._threads0.get(tid, (name, 0.0, 0))[1]
            if spent > 0:
                used[f"{'main' if tid == self.tid else name}:{tid}"] = round(spent, 3)
        machine = (busy[0] - self._busy0[0]) / wall if wall else 0.0
        self.result = dict(wall_s=round(wall, 3), threads_cpu_s=used, main_cores=[self._threads0[self.tid][2],
                           threads[self.tid][2]], main_switches=[sw[0] - self._sw0[0], sw[1] - self._sw0[1]],
                           main_core_mhz=core_mhz(threads[self.tid][2]),
                           machine_busy_cores=round(machine, 2), process_threads=len(threads),
                           cores=os.cpu_count(), affinity=len(os.sched_getaffinity(0)))
