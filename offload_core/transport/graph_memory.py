"""The memory CUDA graphs hold apart from every other allocation: their pools in the allocator's
cache (set apart from the cached memory the plans and room requests count: `memory.set_apart`),
and the driver's graph memory, how much it holds on a device and giving it back.

Under cudaMallocAsync (ComfyUI's default allocator) a graph's allocations are graph memory
nodes: the driver maps their memory at the graph's first launch, outside the allocator's pools
and counts, and keeps it after the graph is gone until it is trimmed; and what a capture makes
must be freed inside it (`record`). Own code because torch
exposes neither the driver's graph-memory attribute, its trim, nor a graph's allocation nodes
(what a first launch will map): all are read through the driver library torch already loaded.
Where the library cannot be read, nothing is measured or trimmed (the native allocator's graphs
never take driver graph memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import traceback
import weakref
from collections.abc import Callable

import torch

from ..log import get_logger
from ..memory import set_apart

log = get_logger("graphs")

USED_MEM_CURRENT, RESERVED_MEM_CURRENT = 0, 2  # CU_GRAPH_MEM_ATTR_{USED,RESERVED}_MEM_CURRENT
LAUNCH_MARGIN = 128 << 20  # room a first launch needs beyond its footprint (bench/README.md, run 63)
_caches: weakref.WeakSet = weakref.WeakSet()  # the live graph caches (`graphs.GraphCache`)


def track(cache: object) -> None:
    """Count ``cache``'s ``pool_bytes`` apart while it lives."""
    _caches.add(cache)


def pool_bytes_on(device: torch.device) -> int:
    """The allocator's memory the live graph caches' pools on ``device`` hold: only their graphs use it."""
    return sum(c.pool_bytes for c in list(_caches) if c.pool_bytes and _same_device(c.device, device))


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type or a.index == b.index:
        return a.type == b.type
    if None not in (a.index, b.index):
        return False
    return (a.index if b.index is None else b.index) == torch.cuda.current_device()


set_apart("CUDA graph pools", pool_bytes_on)


def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.WinDLL("nvcuda.dll") if sys.platform == "win32" else ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


_lib: ctypes.CDLL | None = None
_loaded = False


def _library() -> ctypes.CDLL | None:
    global _lib, _loaded
    if not _loaded:
        _lib, _loaded = _driver(), True
        if _lib is None:
            log.debug("the CUDA driver library could not be loaded: graph memory is neither read nor trimmed")
    return _lib


def _device(device: torch.device) -> ctypes.c_int | None:
    """The driver's handle of ``device``; None where it cannot be read."""
    lib = _library()
    if lib is None or device.type != "cuda":
        return None
    handle = ctypes.c_int()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return handle if lib.cuDeviceGet(ctypes.byref(handle), index) == 0 else None


def reserved(device: torch.device) -> int:
    """Bytes the driver holds on ``device`` for graphs' allocations (0 where unreadable)."""
    return _attribute(device, RESERVED_MEM_CURRENT)


def used(device: torch.device) -> int:
    """Bytes of that memory associated with graphs' allocations now (0 where unreadable)."""
    return _attribute(device, USED_MEM_CURRENT)


def _attribute(device: torch.device, attribute: int) -> int:
    handle = _device(device)
    value = ctypes.c_uint64()
    if handle is None or _lib.cuDeviceGetGraphMemAttribute(handle, attribute, ctypes.byref(value)):
        return 0
    return int(value.value)


def trim(device: torch.device) -> int:
    """Give back to the driver the graph memory no live launch uses (waiting for the device's
    work first, so that the graphs just dropped are done); the bytes given back. Live graphs'
    memory goes too: the caches on ``device`` hear it (``unmapped``), their graphs' next launches
    map it again."""
    before = reserved(device)
    if before == 0:
        return 0
    torch.cuda.synchronize(device)
    handle = _device(device)
    if handle is None or _lib.cuDeviceGraphMemTrim(handle):
        return 0
    given = before - reserved(device)
    log.debug("the driver's graph memory trimmed: %.2f GiB given back", given / (1 << 30))
    if given > 0:
        for cache in [c for c in list(_caches) if _same_device(c.device, device)]:
            cache.unmapped()
    return given


MEM_ALLOC_NODE = 10  # CU_GRAPH_NODE_TYPE_MEM_ALLOC
_BYTESIZE, _DPTR = 104, 112  # in CUDA_MEM_ALLOC_NODE_PARAMS: CUmemPoolProps (88), accessDescs, their count, then these
_PARAMS_ROOM = 256  # bytes for the struct (120), with room should a driver's be longer


def new_graph() -> torch.cuda.CUDAGraph:
    """A graph to capture into; under cudaMallocAsync one that keeps its template after capture,
    so that `footprint` can read its allocations (it is instantiated at its first launch)."""
    if maps_at_launch():
        try:
            return torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:  # a torch without keep_graph: no footprint, no pre-flight
            pass
    return torch.cuda.CUDAGraph()


def record(graph: torch.cuda.CUDAGraph, pool: tuple, call: Callable[[], object]) -> None:
    """Capture ``call()`` into ``graph`` on the current stream. Under cudaMallocAsync a tensor
    made in a capture and freed after it is freed from outside its graph, which aborts the process
    once that graph is gone or unlaunched (FLUX.2's third prompt did: bench/README.md, run 65).
    So the matmul workspaces are made first (`own_workspaces`), and where ``call`` raises, the
    tensors its frames held go while the capture is under way (the error keeps its message)."""
    own_workspaces()
    try:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
    except BaseException:
        _end_routing(pool)
        raise
    try:
        call()
    except BaseException as exc:
        _let_go(exc)
        raise
    finally:
        graph.capture_end()


def _end_routing(pool: tuple) -> None:
    """A capture refused at its start can leave the device allocator routing to ``pool``: torch
    2.11 begins that before the host allocator's check that raised, and nothing ends it, so under
    cudaMallocAsync the free of every tensor made before it is deferred for good (bench/README.md,
    run 69). End it (torch's `use_mem_pool` ends a routing with this call); where none was begun,
    torch says so."""
    with contextlib.suppress(RuntimeError):
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)


def _let_go(exc: BaseException | None) -> None:
    """Clear the locals of the frames ``exc`` and the errors behind it went through."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def own_workspaces() -> None:
    """Under cudaMallocAsync, have cuBLAS's and cuBLASLt's workspaces for the current stream made
    now, outside any capture. torch makes them at a stream's first matmul and keeps them: made
    inside a capture, one is that graph's allocation, mapped only once that graph launches, and
    every later graph captured on the stream bakes its address in, so a graph launched before the
    first faults (FLUX.2's did: bench/README.md, run 65). Made, a matmul on the stream allocates none."""
    if maps_at_launch():
        a = torch.ones(8, 8, device=torch.cuda.current_stream().device)
        torch.addmm(a[0], a, a)  # cuBLASLt (a bias in its epilogue)
        torch.mm(a, a)  # cuBLAS


def maps_at_launch() -> bool:
    """Whether graphs' allocations are the driver's graph memory, mapped at a first launch
    (cudaMallocAsync), rather than the allocator's pool memory taken at capture."""
    global _async
    if _async is None:
        _async = torch.cuda.is_available() and torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    return _async


_async: bool | None = None


def footprint(graph: torch.cuda.CUDAGraph) -> int:
    """The device bytes the allocations of ``graph`` (captured by `new_graph`, not launched yet)
    span: the union of their address ranges (allocations whose lifetimes do not overlap share
    addresses). What its first launch must map; 0 where it cannot be read."""
    lib = _library()
    try:
        template = graph.raw_cuda_graph() if lib is not None and maps_at_launch() else 0
    except RuntimeError:  # its template was not kept
        return 0
    graph_t, count = ctypes.c_void_p(template), ctypes.c_size_t()
    if not template or lib.cuGraphGetNodes(graph_t, None, ctypes.byref(count)):
        return 0
    nodes = (ctypes.c_void_p * count.value)()
    if count.value and lib.cuGraphGetNodes(graph_t, nodes, ctypes.byref(count)):
        return 0
    ranges = []
    kind, params = ctypes.c_int(), ctypes.create_string_buffer(_PARAMS_ROOM)
    for node in nodes:
        if lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) or kind.value != MEM_ALLOC_NODE:
            continue
        if lib.cuGraphMemAllocNodeGetParams(ctypes.c_void_p(node), params):
            return 0
        size = int.from_bytes(params.raw[_BYTESIZE:_BYTESIZE + 8], "little")
        start = int.from_bytes(params.raw[_DPTR:_DPTR + 8], "little")
        ranges.append((start, start + size))
    return _union(ranges)


def fits(device: torch.device, footprint: int) -> bool:
    """Whether the first launch of a graph spanning ``footprint`` bytes can map them from the
    driver's free memory now, with `LAUNCH_MARGIN` to spare. Only free memory counts: the
    allocator's cached memory goes back to the driver only in wholly unused chunks, and graphs
    may each map their own (FLUX.2's did; bench/README.md, run 63)."""
    return torch.cuda.mem_get_info(device)[0] >= footprint + LAUNCH_MARGIN


def _union(ranges: list[tuple[int, int]]) -> int:
    """Bytes covered by the half-open ranges."""
    total, reach = 0, 0
    for start, end in sorted(ranges):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


_launch_failed: list[str] = []  # why a launch ran out of memory, once in this process: no graph after it


def launch(graph: torch.cuda.CUDAGraph) -> None:
    """Replay ``graph``. Under cudaMallocAsync (ComfyUI's default) a graph's allocations come from
    the driver's graph memory at its first launch, outside the allocator's pools and the plan's
    count, so on a full card the launch fails with a CUDA error rather than the allocator's
    out-of-memory error, and keeps what it had mapped for the rest of the process (bench/README.md,
    run 62): a first launch waits for room instead (`GraphCache._room_for`). Where one fails all
    the same, it is raised as the allocator's error (the hooks relieve a shortage and run the
    call again, eagerly) and no graph is made or replayed in this process after it."""
    try:
        graph.replay()
    except RuntimeError as exc:  # (torch.AcceleratorError where torch has it)
        if "out of memory" not in str(exc) or isinstance(exc, torch.OutOfMemoryError):
            raise
        if not _launch_failed:
            _launch_failed.append(str(exc).splitlines()[0])
            log.warning("a CUDA graph's launch ran out of device memory (%s): CUDA graphs off for the rest of this "
                        "process; launching ComfyUI with --disable-cuda-malloc keeps a graph's memory in the plan",
                        _launch_failed[0])
        raise torch.OutOfMemoryError(f"a CUDA graph's launch ran out of memory: {_launch_failed[0]}") from exc


def launch_failed() -> bool:
    """Whether a graph's launch ran out of memory in this process (no graph after it)."""
    return bool(_launch_failed)
