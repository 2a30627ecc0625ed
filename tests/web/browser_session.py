"""One browser session against a real ComfyUI server: what ``test_browser.py`` checks, and what
``tools/screenshots.py`` takes the README's pictures from.

``drive.mjs`` loads the page, queues the Wan example's API twin on the tiny Wan model twice (a
short run, then a long one reloaded mid-run and interrupted), opens other workflow tabs (the same
node ids in another workflow; every node's help page; the node search), opens a second page on
which the state route answers 404, and writes what it saw (and screenshots, where it is told) to
files. Every request to a host other than the loopback server is aborted. Everything it writes
goes under ``work`` unless the caller names other screenshot paths.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _path in (ROOT / "tools", ROOT / "tests", HERE):  # never the repo root: its nodes/ is not ComfyUI's
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
import offload_examples as ex  # noqa: E402

EXAMPLE = "wan_text_to_video"
ROLES = {"loader": ex.LOADER, "generate": "DiffusersOffloadGenerateVideo", "report": "DiffusersOffloadReport",
         "settings": ex.SETTINGS}  # the example's nodes the session reads, by type
# A mixed placement on the tiny model: the text encoder resident (under the floor), the VAE on
# demand, the transformer streamed per step (the preload planner's plan line).
SETTINGS = {"resident_floor_mb": 0.1, "on_demand_threshold_gb": 0.0}
SNAPPED_WIDTH = 40  # not on the tiny model's grid: the short run's notes say what it became
SHORT_STEPS, LONG_STEPS = 12, 1000  # short: the view draws once per frame, a loaded box may merge a
# few updates; long: it must outlast a page reload on a slow box (it is interrupted after it)
DRIVE_TIMEOUT_S = 420
SHOT_NAMES = {"node": "node_view.png", "panel": "panel.png", "preview": "preview.png"}


class SessionUnavailable(RuntimeError):
    """This machine lacks what a browser session needs; the message says what and how to fix it."""


def chromium() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def missing() -> str | None:
    """Why a browser session cannot run here, or None."""
    if not chromium():
        return "no Chromium (set CHROMIUM or run tests/web/setup.sh)"
    if not shutil.which("node"):
        return "no node on PATH (run tests/web/setup.sh)"
    if not (HERE / "node_modules" / "playwright-core").is_dir():
        return "no playwright-core in tests/web/node_modules (run tests/web/setup.sh)"
    if importlib.util.find_spec("comfyui_frontend_package") is None:
        return "comfyui-frontend-package is not installed (run tests/web/setup.sh)"
    return None


def prompt(steps: int, **inputs: Any) -> dict[str, Any]:
    """The example's API twin on the tiny model; a fresh seed so ComfyUI's cache never answers."""
    overrides = ex.example(EXAMPLE).tiny_overrides(steps=steps, seed=random.randrange(2**32), **inputs)
    return ex.api_prompt(EXAMPLE, "tiny-wan", {**overrides, ex.SETTINGS: SETTINGS})


def node_ids() -> dict[str, str]:
    """The id of each node of `ROLES` in the example's UI workflow."""
    by_type = {node["type"]: str(node["id"]) for node in workflow()["nodes"]}
    return {role: by_type[node_type] for role, node_type in ROLES.items()}


def workflow() -> dict[str, Any]:
    """The UI workflow the page shows (same node ids as the twin), with the tiny model picked."""
    ui = json.loads((ex.EXAMPLES_DIR / f"{EXAMPLE}.json").read_text(encoding="utf-8"))
    for node in ui["nodes"]:
        if node["type"] == ex.LOADER:
            node["widgets_values"][0] = "tiny-wan"
    return ui


OLDER = ("measures_path", "stream_parts")  # the last widget of the settings node in older releases
SAVED_CHANGES = {"mode": "leaf", "pin_reserve_gb": 2.5, "prefetch_window": 3, "measures_path": "/tmp/m.json",
                 "stream_parts": False}  # values unlike the defaults, so that a shifted or dropped one shows


def saved_before(last: str) -> dict[str, Any]:
    """`workflow()` as a frontend saved it when ``last`` was the settings node's last widget, with
    `SAVED_CHANGES` made: the later inputs and their values cut off (values are stored by position)."""
    ui = workflow()
    for node in ui["nodes"]:
        if node["type"] == ex.SETTINGS:
            names = [i["name"] for i in node["inputs"] if "widget" in i]
            keep = names.index(last) + 1
            node["inputs"] = [i for i in node["inputs"] if "widget" not in i or names.index(i["name"]) < keep]
            node["widgets_values"] = [SAVED_CHANGES.get(name, value)
                                      for name, value in zip(names[:keep], node["widgets_values"], strict=False)]
    return ui


def run_session(work: Path, shots: dict[str, Path] | None = None, previews: bool = False) -> dict[str, Any]:
    """Run the whole session with ``work`` as its scratch folder; the record of what the page
    showed, with ``returncode``. Screenshots go to ``shots`` (default: ``work/shots``). With
    ``previews`` the server sends a preview image per denoise step (``--preview-method latent2rgb``)
    and the generate node's picture is taken; the tests run without (the frontend grows the node
    for the image, over the report node the example puts under it)."""
    reason = missing()
    if reason:
        raise SessionUnavailable(reason)
    from comfy_server import comfy_server, copy_comfyui, make_base
    from comfyhost.harness import ComfyUnavailable, find_comfyui
    from fixtures.tiny_models import build_tiny_wan

    try:
        comfy_source = find_comfyui()
    except ComfyUnavailable as exc:
        raise SessionUnavailable(str(exc)) from exc
    shots = shots or {key: work / "shots" / name for key, name in SHOT_NAMES.items()}
    shots = {"canvas": work / "shots" / "canvas.png", **shots}  # the whole canvas after the short run
    if not previews:
        shots.pop("preview", None)  # no preview on the generate node to take
    for path in shots.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    wan = build_tiny_wan(work / "models" / "tiny-wan")
    base = make_base(work / "base", {"tiny-wan": wan})
    comfy_dir = copy_comfyui(comfy_source, work / "comfyui")
    started = time.monotonic()
    with comfy_server(comfy_dir, base, work, previews=previews) as server:
        server_start = time.monotonic() - started
        config = {
            "url": server.url, "result": str(work / "result.json"), "chromium": chromium(),
            "profile": str(work / "profile"), "workflow": workflow(), "short": prompt(SHORT_STEPS, width=SNAPPED_WIDTH),
            "olderWorkflows": {last: saved_before(last) for last in OLDER},
            "long": prompt(LONG_STEPS), "nodes": node_ids(),
            "shots": {k: str(v) for k, v in shots.items()}, "previews": previews,
        }
        (work / "config.json").write_text(json.dumps(config))
        proc = subprocess.run(["node", str(HERE / "drive.mjs"), str(work / "config.json")], cwd=HERE,
                              capture_output=True, text=True, timeout=DRIVE_TIMEOUT_S)
        log = server.log()
    record = json.loads((work / "result.json").read_text()) if (work / "result.json").is_file() else {}
    schema = comfy_source / "comfy_api" / "latest" / "_io.py"  # does this ComfyUI's io.Schema take search aliases?
    record["schemaTakesAliases"] = schema.is_file() and "search_aliases" in schema.read_text(encoding="utf-8")
    record.update(returncode=proc.returncode, server_start=server_start, server_log=log,
                  driver_stderr=proc.stderr[-4000:], shots={k: str(v) for k, v in shots.items()})
    return record


def failure(record: dict[str, Any]) -> str | None:
    """What went wrong in a session, or None."""
    if record["returncode"] == 0 and "error" not in record:
        return None
    return (f"browser session failed: {record.get('error') or record['driver_stderr']}\n"
            f"steps: {record.get('steps')}\nserver log tail:\n{record['server_log'][-3000:]}")
