"""The memory a container lets this process use (its cgroup's limit, v2 or v1), where psutil reads
the whole host's (``/proc/meminfo``).

Why: ComfyUI in Docker or a cloud pod sees the host's free RAM; pinning or caching up to it, past
the container's limit, gets the process OOM-killed. The room left is the limit less the working set
(usage less inactive file pages, which the kernel reclaims first: what Kubernetes evicts by), the
smallest over the cgroup and its ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .log import get_logger

log = get_logger("memory")

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
UNLIMITED = 1 << 62  # v1 writes "no limit" as a number near 2**63
_said: set[tuple[str, int]] = set()


@dataclass(frozen=True)
class ContainerRoom:
    """What the tightest memory limit over this process still allows, and where it is set."""

    room: int
    limit: int
    source: str  # the cgroup directory holding the limit

    def describe(self) -> str:
        return f"container memory limit {self.limit / 2**30:.2f} GiB ({self.source})"


def container_room(root: Path = CGROUP_ROOT, proc: Path = PROC_CGROUP) -> ContainerRoom | None:
    """The room the tightest cgroup memory limit over this process leaves; None with no limit (or
    no cgroups: another OS). Logged once per limit."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    found = _v2(root, lines) if (root / "cgroup.controllers").is_file() else _v1(root / "memory", lines)
    if found is not None and (found.source, found.limit) not in _said:
        _said.add((found.source, found.limit))
        log.info("host memory: %s, %.2f GiB of it free: pins and caches stay within it", found.describe(),
                 found.room / 2**30)
    return found


def _own_dir(mount: Path, lines: list[str], controller: str) -> list[Path]:
    """This process's cgroup directory and its ancestors up to ``mount``, innermost first (only the
    mount itself when the path is not visible there: a container's own cgroup namespace)."""
    path = next((ln.split(":", 2)[2] for ln in lines if ln.count(":") >= 2 and controller in ln.split(":")[1].split(",")),
                "/")
    leaf = mount / path.lstrip("/")
    if not leaf.is_dir():
        return [mount]
    return [leaf, *(p for p in leaf.parents if p.is_relative_to(mount))]


def _stat(directory: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in _read(directory / "memory.stat").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _v2(mount: Path, lines: list[str]) -> ContainerRoom | None:
    """cgroup v2: ``memory.max`` ("max": none) on each level, its ``memory.current`` and ``inactive_file``."""
    rooms = []
    for directory in _own_dir(mount, lines, ""):
        limit = _read(directory / "memory.max")
        if not limit.isdigit():
            continue
        used = int(_read(directory / "memory.current") or 0) - _stat(directory).get("inactive_file", 0)
        rooms.append(ContainerRoom(max(int(limit) - max(used, 0), 0), int(limit), f"cgroup v2 {directory}"))
    return min(rooms, key=lambda r: r.room, default=None)


def _v1(mount: Path, lines: list[str]) -> ContainerRoom | None:
    """cgroup v1: the leaf's ``hierarchical_memory_limit`` (the tightest over its ancestors), its
    ``memory.usage_in_bytes`` and ``total_inactive_file``."""
    directory = _own_dir(mount, lines, "memory")[0]
    stat = _stat(directory)
    limit = stat.get("hierarchical_memory_limit", UNLIMITED)
    usage = _read(directory / "memory.usage_in_bytes")
    if limit >= UNLIMITED or not usage.isdigit():
        return None
    used = int(usage) - stat.get("total_inactive_file", 0)
    return ContainerRoom(max(limit - max(used, 0), 0), limit, f"cgroup v1 {directory}")
