"""A container's memory limit bounds what the engine reads as free host memory (cgroup v2 and v1),
and the pin verdict names it; with no limit the host's free memory stands. The cgroup trees are
written as the kernel lays them out (``/proc/self/cgroup`` lines, ``memory.*`` files)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from diffusers_offload.offload_core import host_limit, memory
from diffusers_offload.offload_core.memory import MemoryReader, pin_budget

GiB = 2**30


def _files(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text + "\n")


def _v2_tree(tmp_path: Path, own: str) -> tuple[Path, Path]:
    """A v2 hierarchy: a 64 GiB limit on ``kube`` (60 GiB used, 10 of it inactive file pages), none on
    its ``pod`` below (20 GiB used, 2 inactive)."""
    root = tmp_path / "cgroup"
    _files(root, cgroup_controllers="cpu memory pids")
    _files(root / "kube", memory_max=str(64 * GiB), memory_current=str(60 * GiB),
           memory_stat=f"anon {40 * GiB}\nfile {20 * GiB}\ninactive_file {10 * GiB}\nactive_file {10 * GiB}")
    _files(root / "kube" / "pod", memory_max="max", memory_current=str(20 * GiB),
           memory_stat=f"anon {18 * GiB}\ninactive_file {2 * GiB}")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{own}\n")
    return root, proc


def test_a_v2_limit_on_an_ancestor_leaves_the_limit_less_its_working_set(tmp_path):
    found = host_limit.container_room(*_v2_tree(tmp_path, "/kube/pod"))
    assert found is not None and found.limit == 64 * GiB
    assert found.room == 64 * GiB - (60 * GiB - 10 * GiB)  # inactive file pages are the kernel's to reclaim
    assert found.source.endswith("kube") and "64.00 GiB" in found.describe()


def test_a_v2_cgroup_namespace_reads_the_mount_itself(tmp_path):
    root, proc = _v2_tree(tmp_path, "/not/visible/here")
    _files(root, memory_max=str(32 * GiB), memory_current=str(8 * GiB), memory_stat=f"inactive_file {GiB}")
    found = host_limit.container_room(root, proc)
    assert found is not None and (found.limit, found.room) == (32 * GiB, 32 * GiB - 7 * GiB)


def test_no_v2_limit_anywhere_is_none(tmp_path):
    root, proc = _v2_tree(tmp_path, "/kube/pod")
    (root / "kube" / "memory.max").write_text("max\n")
    assert host_limit.container_room(root, proc) is None


def test_a_v1_limit_is_the_hierarchical_one_less_the_working_set(tmp_path):
    root = tmp_path / "cgroup"
    _files(root / "memory" / "docker" / "abc", memory_usage_in_bytes=str(30 * GiB),
           memory_stat=f"cache {12 * GiB}\nhierarchical_memory_limit {48 * GiB}\ntotal_inactive_file {6 * GiB}")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("9:name=systemd:/\n4:memory:/docker/abc\n3:cpuset:/\n0::/\n")
    found = host_limit.container_room(root, proc)
    assert found is not None and (found.limit, found.room) == (48 * GiB, 48 * GiB - 24 * GiB)
    (root / "memory" / "docker" / "abc" / "memory.stat").write_text(
        "hierarchical_memory_limit 9223372036854771712\ntotal_inactive_file 0\n")  # v1's "no limit"
    assert host_limit.container_room(root, proc) is None


def test_no_cgroups_at_all_is_none(tmp_path):
    assert host_limit.container_room(tmp_path / "none", tmp_path / "no_proc_file") is None


@pytest.mark.parametrize(("free", "bound"), [(100 * GiB, "container memory limit"), (10 * GiB, "host free")])
def test_the_tighter_of_host_free_and_the_container_bounds_the_pin_grant(tmp_path, monkeypatch, free, bound):
    monkeypatch.setattr(memory, "container_room", functools.partial(host_limit.container_room,
                                                                    *_v2_tree(tmp_path, "/kube/pod")))
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: type("VM", (), {"available": free})())
    reader = MemoryReader()
    assert reader.host_available() == min(free, 14 * GiB)
    verdict = pin_budget(20 * GiB, reader, reserve=4 * GiB)
    assert verdict.grant == min(free, 14 * GiB) - 4 * GiB and f"bound by {bound}" in verdict.describe()
