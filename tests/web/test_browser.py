"""The frontend extension in headless Chromium against a real ComfyUI server on loopback.

One browser session (``drive.mjs``) loads the page, queues the Wan example's API twin on the tiny
Wan model twice (a short run, then a long one reloaded mid-run and interrupted), and opens a
second page on which the state route answers 404; the tests below check what it recorded. The
screenshots ``docs/node_view.png`` and ``docs/panel.png`` are written by the session.

Skipped (with the reason) without Chromium, node, playwright-core (``tests/web/setup.sh``
installs all three), the frontend package or a ComfyUI tree.
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

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOCS = ROOT / "docs"
SHOTS = {"node": DOCS / "node_view.png", "panel": DOCS / "panel.png"}
EXAMPLE = "wan_text_to_video"
VIEW_NODE, LOADER_NODE = "4", "1"
# A mixed placement on the tiny model: the text encoder resident (under the floor), the VAE on
# demand, the transformer streamed per step (the preload planner's plan line).
SETTINGS = {"resident_floor_mb": 0.1, "on_demand_threshold_gb": 0.0}
SHORT_STEPS, LONG_STEPS = 12, 1000  # short: the view draws once per frame, a loaded box may merge a
# few updates; long: it must outlast a page reload on a slow box (it is interrupted after it)
DRIVE_TIMEOUT_S = 420

sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(HERE))  # comfy_server (pytest runs with --import-mode=importlib)
import offload_examples as ex  # noqa: E402


def _missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not _chromium():
        return "no Chromium (set CHROMIUM or run tests/web/setup.sh)"
    if not shutil.which("node"):
        return "no node on PATH (run tests/web/setup.sh)"
    if not (HERE / "node_modules" / "playwright-core").is_dir():
        return "no playwright-core in tests/web/node_modules (run tests/web/setup.sh)"
    if importlib.util.find_spec("comfyui_frontend_package") is None:
        return "comfyui-frontend-package is not installed (run tests/web/setup.sh)"
    return None


def _chromium() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _prompt(steps: int) -> dict[str, Any]:
    """The example's API twin on the tiny model; a fresh seed so ComfyUI's cache never answers."""
    overrides = ex.example(EXAMPLE).tiny_overrides(steps=steps, seed=random.randrange(2**32))
    return ex.api_prompt(EXAMPLE, "tiny-wan", {**overrides, ex.SETTINGS: SETTINGS})


def _workflow() -> dict[str, Any]:
    """The UI workflow the page shows (same node ids as the twin), with the tiny model picked."""
    workflow = json.loads((ex.EXAMPLES_DIR / f"{EXAMPLE}.json").read_text(encoding="utf-8"))
    for node in workflow["nodes"]:
        if node["type"] == ex.LOADER:
            node["widgets_values"][0] = "tiny-wan"
    return workflow


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the whole browser session once; the tests read its record."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    from comfy_server import comfy_server, copy_comfyui, make_base
    from comfyhost.harness import ComfyUnavailable, find_comfyui
    from fixtures.tiny_models import build_tiny_wan

    try:
        comfy_source = find_comfyui()
    except ComfyUnavailable as exc:
        pytest.skip(str(exc))
    work = tmp_path_factory.mktemp("web")
    wan = build_tiny_wan(work / "models" / "tiny-wan")
    base = make_base(work / "base", {"tiny-wan": wan})
    comfy_dir = copy_comfyui(comfy_source, work / "comfyui")
    DOCS.mkdir(exist_ok=True)
    started = time.monotonic()
    with comfy_server(comfy_dir, base, work) as server:
        server_start = time.monotonic() - started
        config = {
            "url": server.url, "result": str(work / "result.json"), "chromium": _chromium(),
            "profile": str(work / "profile"), "workflow": _workflow(), "short": _prompt(SHORT_STEPS),
            "long": _prompt(LONG_STEPS), "viewNode": VIEW_NODE, "loaderNode": LOADER_NODE,
            "shots": {k: str(v) for k, v in SHOTS.items()},
        }
        (work / "config.json").write_text(json.dumps(config))
        proc = subprocess.run(["node", str(HERE / "drive.mjs"), str(work / "config.json")], cwd=HERE,
                              capture_output=True, text=True, timeout=DRIVE_TIMEOUT_S)
        log = server.log()
    record = json.loads((work / "result.json").read_text()) if (work / "result.json").is_file() else {}
    record.update(server_start=server_start, server_log=log, driver_stderr=proc.stderr[-4000:])
    if os.environ.get("WEB_TEST_RECORD"):  # keep the session's record for a look afterwards
        Path(os.environ["WEB_TEST_RECORD"]).write_text(json.dumps(record, indent=1))
    assert proc.returncode == 0 and "error" not in record, (
        f"browser session failed: {record.get('error') or proc.stderr[-4000:]}\nsteps: {record.get('steps')}\n"
        f"server log tail:\n{log[-3000:]}"
    )
    return record


def _route_pipeline(session: dict[str, Any]) -> dict[str, Any]:
    (pipeline,) = [p for p in session["route"]["pipelines"] if p["pipeline"] == "WanPipeline"]
    return pipeline


def test_extension_loads_without_errors_from_our_script(session: dict[str, Any]) -> None:
    assert "/extensions/ComfyUI-DiffusersOffload/diffusers_offload.js" in session["extensions"]
    assert {"DiffusersOffloadLoadPipeline", "DiffusersOffloadGenerateVideo"} <= set(session["nodeTypes"])
    assert session["tabButton"] == 1
    # a failed request is logged by the browser, not by a script: only the 404 page may have one
    ours = [m for m in session["console"] if m["ours"] and m["type"] == "error"
            and not (m["page"] == "no-route" and m["text"].startswith("Failed to load resource"))]
    ours += [e for e in session["pageErrors"] if e["ours"]]
    assert ours == []


def test_node_view_shows_each_stage_then_the_final_placement(session: dict[str, Any]) -> None:
    assert session["shortHistory"]["status_str"] == "success"
    seen = session["seen"]
    # every stage is sent, in order: the steps, then the decode, then the end (no stage)
    sent = session["events"]["stages"]
    assert session["events"]["stage"] >= SHORT_STEPS + 1
    assert sent.count("denoise") >= SHORT_STEPS and "decode" in sent[sent.index("denoise"):], sent
    assert sent[-1] == "", sent
    # the view draws once per frame, so quick updates may show as one (a tiny model's decode can
    # come and go within a frame): what it shows is in order and ends with the placement summary
    denoise = [t for t in seen if t.startswith("denoise ")]
    steps = [int(t.split()[1].split("/")[0]) for t in denoise]
    assert denoise and all(t.endswith(f"/{SHORT_STEPS}") for t in denoise), seen
    assert steps == sorted(steps) and steps[0] >= 1, seen
    assert seen[-1].startswith("cpu: "), seen  # then the placement summary: quiet again

    route = _route_pipeline(session)
    for view in (session["finalView"], session["loaderView"]):
        assert view["stage"] == "idle" and view["visible"]
        rows = {r["name"]: r for r in view["rows"]}
        assert set(rows) == {c["name"] for c in route["components"]}
        for c in route["components"]:
            row = rows[c["name"]]
            assert row["nbytes"] == c["nbytes"]
            shown = {k: round(v, 3) for k, v in row["segments"].items()}
            expected = {k: round(100 * v / c["nbytes"], 3) for k, v in c["segments"].items() if v}
            assert shown == expected, c["name"]
    roles = {c["name"]: c["role"] for c in route["components"]}
    assert roles == {"text_encoder": "resident", "vae": "on-demand", "transformer": "per-step"}


def test_panel_lists_the_components_with_the_routes_sizes(session: dict[str, Any]) -> None:
    route = _route_pipeline(session)
    (card,) = [c for c in session["panel"]["cards"] if c["id"] == route["id"]]
    assert card["title"] == "WanPipeline · tiny-wan"
    rows = {r["name"]: r for r in card["rows"]}
    assert set(rows) == {c["name"] for c in route["components"]}
    for c in route["components"]:
        row = rows[c["name"]]
        assert (row["nbytes"], row["deviceBytes"], row["pinnedBytes"]) == (
            c["nbytes"], c["device_bytes"], c["pinned_bytes"])
        assert row["cells"] == [c["name"], c["role"], _size(c["nbytes"])]
        assert row["figures"].startswith(f"device {_size(c['device_bytes'])} · pinned {_size(c['pinned_bytes'])}")
    assert route["plan"].startswith("blocks kept ") and card["plan"] == f"preload: {route['plan']}"
    assert card["planChange"] and card["planChange"].startswith("last plan change")


def test_reload_mid_run_restores_the_view_from_the_route(session: dict[str, Any]) -> None:
    reload = session["reload"]
    assert not reload["historyDoneAtReload"], "the long run ended before the reload: raise LONG_STEPS"
    assert reload["routeStages"][VIEW_NODE]["stage"] in ("denoise", "decode")
    assert reload["view"]["rows"] and reload["view"]["stage"] in ("denoise", "decode", "running")
    assert session["longHistory"]["status_str"] in ("error", "success")  # interrupted, or done first
    assert session["afterLong"]["stage"] == "idle"  # quiet again once nothing runs


def test_page_without_the_route_shows_nothing_and_still_works(session: dict[str, Any]) -> None:
    no_route = session["noRoute"]
    assert no_route == {**no_route, "available": False, "tabButton": 0, "visibleViews": 0}
    assert no_route["nodes"] == len(_workflow()["nodes"])


def test_screenshots_are_written(session: dict[str, Any]) -> None:
    for path in SHOTS.values():
        assert path.is_file() and path.stat().st_size > 2000 and path.stat().st_mtime > time.time() - 900


def _size(n: int) -> str:
    """The page's byte format (offload_core.report.gib)."""
    from diffusers_offload.offload_core.report import gib

    return gib(n)
