"""What the page shows: a read-only state route and websocket events for ``web/``.

Why: a user watching a long run wants to see where every component's weights are and what the
run is doing without reading the server log. Every figure comes from the engine's report, every
stage from the run's progress hooks; ``GET /diffusers_offload/state`` gives the whole picture
(after a page reload), the ``diffusers_offload.*`` events keep it live. Nothing of the host side
is imported: the extension hands in the report source (`connect`) and subscribes `loaded` /
`changed` / `finished` to the host's patcher events. Hooks never raise, and pipelines are held
only through weak references.

A pipeline is tied to the nodes that loaded or ran it *in one workflow*: every binding carries the
workflow id the frontend sent with the prompt (``extra_pnginfo.workflow.id``) and the prompt id, so
a page shows a placement only on the workflow that produced it, never on a node of another tab
that happens to have the same id. Stages carry the same two ids.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..offload_core.components import denoiser
from ..offload_core.report import ComponentReport, PlacementReport

log = logging.getLogger("diffusers_offload.web")

ROUTE = "/diffusers_offload/state"
EVENT_PLACEMENT = "diffusers_offload.placement"
EVENT_STAGE = "diffusers_offload.stage"
EVENT_REMOVED = "diffusers_offload.removed"
SCHEMA = 1
PLAN_CHECK_S = 0.5  # during a run, re-read the placement (plan changes) at most this often


# ------------------------------------------------------------------------------------ snapshot


def segments(c: ComponentReport) -> dict[str, int]:
    """Where a component's bytes are: ``device`` (resident on the run device), ``pinned`` (host,
    page-locked, streamed to the device per step), ``ram`` (pageable host memory) and
    ``on_demand`` (host, moved whole to the device when the component is called)."""
    device = min(c.device_bytes, c.nbytes)
    host = c.nbytes - device
    if c.role == "on-demand":
        return {"device": device, "pinned": 0, "ram": 0, "on_demand": host}
    pinned = min(c.pinned_bytes, host)
    return {"device": device, "pinned": pinned, "ram": host - pinned, "on_demand": 0}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def component_dict(c: ComponentReport) -> dict[str, Any]:
    return {
        "name": c.name, "cls": c.cls, "role": c.role, "reason": c.reason, "nbytes": c.nbytes,
        "dtypes": list(c.dtypes), "quantization": c.quantization, "device_bytes": c.device_bytes,
        "pinned_bytes": c.pinned_bytes, "host_bytes": c.host_bytes, "segments": segments(c),
        "details": _jsonable(c.details),
    }


# ------------------------------------------------------------------------------------ registry


@dataclass
class Entry:
    """One pipeline the pack holds, keyed by the holder every clone of its patcher shares."""

    id: str
    holder: weakref.ref
    path: str
    nodes: set[str] = field(default_factory=set)
    uses: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (workflow, node) -> use
    plan: str = ""
    plan_change: dict[str, Any] | None = None
    snapshot: dict[str, Any] | None = None
    checked: float = 0.0

    def refresh(self, report_of: Callable[[Any], PlacementReport]) -> dict[str, Any] | None:
        """Re-read the engine's report; None once the pipeline is gone."""
        holder = self.holder()
        if holder is None:
            return None
        report = report_of(holder.pipe)
        plan = report.plan
        if plan and plan != self.plan:
            self.plan_change = {"line": plan, "previous": self.plan, "at": time.time()}
        self.plan = plan or self.plan
        self.checked = time.monotonic()
        self.snapshot = {
            "id": self.id, "pipeline": report.pipeline, "path": self.path, "device": report.device,
            "mode": report.mode, "dtype": str(getattr(holder, "dtype", "")).removeprefix("torch."),
            "total_bytes": sum(c.nbytes for c in report.components),
            "device_bytes": report.device_bytes, "pinned_bytes": report.pinned_bytes,
            "plan": self.plan, "plan_change": self.plan_change, "nodes": sorted(self.nodes),
            "uses": sorted(self.uses.values(), key=lambda u: (u["workflow"] or "", u["node"])),
            "components": [component_dict(c) for c in report.components], "updated": time.time(),
        }
        return self.snapshot


class Registry:
    """Every live pipeline and the current stage per node; thread-safe (runs happen on ComfyUI's
    worker thread, the route is served on the event loop)."""

    def __init__(self) -> None:
        self.report_of: Callable[[Any], PlacementReport] | None = None  # set by `connect`
        self._lock = threading.RLock()
        self._entries: dict[int, Entry] = {}
        self._stages: dict[str, dict[str, Any]] = {}
        self._ids = itertools.count(1)

    def entry(self, patcher: Any) -> Entry:
        holder = patcher.model
        with self._lock:
            entry = self._entries.get(id(holder))
            if entry is None or entry.holder() is not holder:
                entry = Entry(f"p{next(self._ids)}", weakref.ref(holder), str(getattr(holder.pipe, "name_or_path", "") or ""))
                self._entries[id(holder)] = entry
                weakref.finalize(holder, self._gone, id(holder), entry.id)
            return entry

    def bind(self, entry: Entry, node_id: str, run: RunContext) -> list[Entry]:
        """Tie ``entry`` to ``node_id`` of the run's workflow. The entries that held that node of
        that workflow before lose it (the newest prompt wins); they are returned, to be republished."""
        key = (run.workflow or "", node_id)
        use = {"node": node_id, "workflow": run.workflow, "prompt": run.prompt}
        with self._lock:
            entry.nodes.add(node_id)
            if entry.uses.get(key) == use:
                return []
            entry.uses[key] = use
            return [e for e in self._entries.values() if e is not entry and e.uses.pop(key, None) is not None]

    def for_pipe(self, pipe: Any) -> Entry | None:
        """The entry whose pipeline is ``pipe`` or shares its denoiser (an image-to-video sibling)."""
        with self._lock:
            for entry in list(self._entries.values()):
                holder = entry.holder()
                if holder is not None and _same_pipeline(holder.pipe, pipe):
                    return entry
        return None

    def refresh(self, entry: Entry) -> dict[str, Any] | None:
        """The entry's snapshot re-read; None when the pipeline is gone or nothing is connected."""
        return None if self.report_of is None else entry.refresh(self.report_of)

    def publish(self, entry: Entry) -> None:
        with self._lock:
            before = _placement_key(entry.snapshot)
            snapshot = self.refresh(entry)
        if snapshot is not None and _placement_key(snapshot) != before:
            _send(EVENT_PLACEMENT, snapshot)

    def set_stage(self, node_id: str, payload: dict[str, Any] | None) -> None:
        """The node's current stage, or its end (None). A stage of a new prompt also ends those an
        earlier prompt left listed: ComfyUI runs one prompt at a time."""
        with self._lock:
            if payload is None:
                old = self._stages.pop(node_id, None)
                ended = [] if old is None else [(node_id, old)]
            else:
                ended = [(n, s) for n, s in self._stages.items()
                         if n != node_id and s.get("prompt") != payload.get("prompt")]
                for n, _ in ended:
                    del self._stages[n]
                self._stages[node_id] = payload
        for n, old_stage in ended:
            _send(EVENT_STAGE, _ended(n, old_stage))
        if payload is not None:
            _send(EVENT_STAGE, payload)

    def end_stages(self, entry: Entry) -> None:
        with self._lock:
            nodes = [n for n, s in self._stages.items() if s.get("pipeline") == entry.id]
        for node_id in nodes:
            self.set_stage(node_id, None)

    def state(self) -> dict[str, Any]:
        with self._lock:
            pipelines = []
            for entry in list(self._entries.values()):
                busy = any(s.get("pipeline") == entry.id for s in self._stages.values())
                # mid-run the last published snapshot is current; idle ones are re-read
                snap = entry.snapshot if busy and entry.snapshot else _safe(lambda e=entry: self.refresh(e))
                if snap is not None:
                    pipelines.append(snap)
            return {"schema": SCHEMA, "pipelines": pipelines, "stages": dict(self._stages),
                    "time": time.time()}

    def _gone(self, key: int, entry_id: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.id == entry_id:
                del self._entries[key]
            stale = [n for n, s in self._stages.items() if s.get("pipeline") == entry_id]
            for node_id in stale:
                del self._stages[node_id]
        _send(EVENT_REMOVED, {"id": entry_id})


REGISTRY = Registry()


# ----------------------------------------------------------------------------------- the hooks


def connect(report_of: Callable[[Any], PlacementReport]) -> None:
    """Where the view reads a pipeline's placement from (the engine's ``report``); until this is
    called the route lists no pipeline and no placement event is sent."""
    REGISTRY.report_of = report_of


def loaded(patcher: Any) -> None:
    """A pipeline was loaded (by the node now executing, in the workflow of the running prompt)."""
    _safe(lambda: _loaded(patcher))


def _loaded(patcher: Any) -> None:
    entry, run = REGISTRY.entry(patcher), current_run()
    others = REGISTRY.bind(entry, run.node, run) if run.node is not None else []
    for each in (entry, *others):
        REGISTRY.publish(each)


def changed(patcher: Any) -> None:
    """The placement may have changed (load, give back, release, end of a call)."""
    _safe(lambda: REGISTRY.publish(REGISTRY.entry(patcher)))


def finished(patcher: Any) -> None:
    """A pipeline call ended (also on error or interrupt): its nodes' stages are over."""
    _safe(lambda: REGISTRY.end_stages(REGISTRY.entry(patcher)))


def stage(node_id: str | None, name: str, step: int | None = None, total: int | None = None,
          pipe: Any = None, text: str | None = None) -> None:
    """Publish the current stage of ``node_id`` ("denoise", 12, 30 -> "denoise 12/30"; ``text``
    replaces that label, e.g. ``offload_core.run.stages.label``'s "video decode chunk 3/8")."""
    _safe(lambda: _stage(node_id, name, step, total, pipe, text))


def _stage(node_id: str | None, name: str, step: int | None, total: int | None, pipe: Any,
           text: str | None) -> None:
    run = current_run()
    node_id = str(node_id) if node_id is not None else run.node
    if node_id is None:
        return
    entry = REGISTRY.for_pipe(pipe) if pipe is not None else None
    if entry is not None:
        others = REGISTRY.bind(entry, node_id, run)
        for each in others:
            REGISTRY.publish(each)
        if others or time.monotonic() - entry.checked >= PLAN_CHECK_S:
            REGISTRY.publish(entry)  # the planner may have changed plan between steps
    text = text or (f"{name} {step}/{total}" if step is not None and total else name)
    REGISTRY.set_stage(node_id, {
        "node": node_id, "stage": name, "step": step, "total": total, "text": text,
        "pipeline": entry.id if entry else None, "prompt": run.prompt, "workflow": run.workflow,
        "at": time.time(),
    })


# --------------------------------------------------------------------------- node search, route


def search_aliases(*words: str) -> dict[str, list[str]]:
    """``**search_aliases("offload", "wan")`` in a node's ``io.Schema(...)``: the words the node
    search also matches, where this ComfyUI's schema takes them (2026 trees; v0.3.75 does not)."""
    from comfy_api.latest import io

    return {"search_aliases": list(words)} if "search_aliases" in io.Schema.__dataclass_fields__ else {}



_registered = False


def register_routes() -> bool:
    """Add ``GET /diffusers_offload/state`` to ComfyUI's routes; False (and nothing breaks) when
    there is no server (in-process tests) or the app can no longer take routes."""
    global _registered
    if _registered:
        return True
    try:
        from aiohttp import web
        from server import PromptServer

        server = getattr(PromptServer, "instance", None)
        routes = getattr(server, "routes", None)
        if routes is None or server.app.router.frozen:
            return False

        async def state(_request: web.Request) -> web.Response:
            return web.json_response(REGISTRY.state(), headers={"Cache-Control": "no-store"})

        routes.get(ROUTE)(state)
        _registered = True
    except Exception as exc:  # an older or unusual server: the page hides the view (404)
        log.debug("state route not registered: %s", exc)
    return _registered


# ------------------------------------------------------------------------------------- helpers


def _send(event: str, data: dict[str, Any]) -> None:
    try:
        from server import PromptServer

        server = getattr(PromptServer, "instance", None)
        if server is not None:
            server.send_sync(event, data)
    except Exception as exc:
        log.debug("could not send %s: %s", event, exc)


def _safe(fn: Any) -> Any:
    """The view must never break a run: ``fn()``, or None (logged at debug) when it raised."""
    try:
        return fn()
    except Exception:
        log.debug("web view update failed", exc_info=True)
        return None


@dataclass(frozen=True)
class RunContext:
    """What is executing: the prompt, the workflow it was queued from (the id the frontend put in
    ``extra_pnginfo.workflow``; None for a prompt queued without one) and the node."""

    prompt: str | None = None
    workflow: str | None = None
    node: str | None = None


def current_run() -> RunContext:
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:
        return RunContext()
    ctx = get_executing_context()
    if ctx is None:
        return RunContext()
    prompt = None if ctx.prompt_id is None else str(ctx.prompt_id)
    node = None if ctx.node_id is None else str(ctx.node_id)
    return RunContext(prompt, _workflow_of(prompt) if prompt else None, node)


@functools.lru_cache(maxsize=32)
def _workflow_of(prompt: str | None) -> str | None:
    """The workflow id of a running prompt, read once from the queue's running item ``(number,
    prompt_id, prompt, extra_data, ...)``, the same shape in v0.3.75 and 2026 trees."""
    workflow = None
    try:
        from server import PromptServer

        queue = getattr(getattr(PromptServer, "instance", None), "prompt_queue", None)
        with queue.mutex:
            items = list(queue.currently_running.values())
        for item in items:
            if len(item) > 3 and item[1] == prompt and isinstance(item[3], dict):
                graph = (item[3].get("extra_pnginfo") or {}).get("workflow") or {}
                workflow = str(graph["id"]) if isinstance(graph, dict) and graph.get("id") else None
    except Exception as exc:  # no server (in-process tests) or another queue shape: no workflow
        log.debug("no workflow id for prompt %s: %s", prompt, exc)
    return workflow


def _ended(node_id: str, stage: dict[str, Any]) -> dict[str, Any]:
    """The event that ends a node's stage, with the prompt and workflow that stage belonged to."""
    return {"node": node_id, "stage": None, "pipeline": stage.get("pipeline"), "prompt": stage.get("prompt"),
            "workflow": stage.get("workflow"), "at": time.time()}


def _same_pipeline(a: Any, b: Any) -> bool:
    if a is b:
        return True
    model = denoiser(a)
    return model is not None and model is denoiser(b)


def _placement_key(snapshot: dict[str, Any] | None) -> Any:
    if snapshot is None:
        return None
    comps = tuple((c["name"], c["role"], c["device_bytes"], c["pinned_bytes"]) for c in snapshot["components"])
    uses = tuple((u["workflow"], u["node"], u["prompt"]) for u in snapshot["uses"])
    return snapshot["device"], snapshot["mode"], snapshot["plan"], uses, comps
