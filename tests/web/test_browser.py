"""The frontend extension in headless Chromium against a real ComfyUI server on loopback.

One browser session (``browser_session.py`` driving ``drive.mjs``) loads the page, queues the Wan
example's API twin on the tiny Wan model twice (a short run, then a long one reloaded mid-run and
interrupted), and opens a second page on which the state route answers 404; the tests below check
what it recorded. It writes only under pytest's temporary folder (the README's screenshots come
from ``make screenshots``).

Skipped (with the reason) without Chromium, node, playwright-core (``tests/web/setup.sh``
installs all three), the frontend package or a ComfyUI tree; failed instead when
``WEB_TESTS_REQUIRED`` is set (``.ci/run`` sets it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pytest runs with --import-mode=importlib
from browser_session import (  # noqa: E402
    EXAMPLE,
    SHORT_STEPS,
    VIEW_NODE,
    SessionUnavailable,
    ex,  # noqa: E402
    failure,
    run_session,
    workflow,
)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the whole browser session once; the tests read its record."""
    work = tmp_path_factory.mktemp("web")
    try:
        record = run_session(work)
    except SessionUnavailable as exc:
        if os.environ.get("WEB_TESTS_REQUIRED"):  # CI: a skipped browser test is a failed one
            pytest.fail(f"WEB_TESTS_REQUIRED is set but the browser tests cannot run: {exc}")
        pytest.skip(str(exc))
    if os.environ.get("WEB_TEST_RECORD"):  # keep the session's record for a look afterwards
        Path(os.environ["WEB_TEST_RECORD"]).write_text(json.dumps(record, indent=1))
    problem = failure(record)
    assert problem is None, problem
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


def test_the_saved_settings_node_loads_with_its_values_and_advanced_options_folded(session: dict[str, Any]) -> None:
    """The example's UI workflow, as the frontend maps its widget values by position, gives every
    option the value its API twin names; the options the host marks advanced carry the flag where
    the frontend knows it (2026 frontends fold them behind the node's advanced toggle)."""
    settings = session["settings"]
    twin = ex.api_prompt(EXAMPLE, ex.example(EXAMPLE).model)[settings["id"]]["inputs"]
    info = session["settingsSchema"]["DiffusersOffloadSettings"]
    options = [name for name, *_ in ex.schema_inputs(info)]
    widgets = [w for w in settings["widgets"] if w["name"] in options]  # not our own view's widget
    assert [w["name"] for w in widgets] == options
    assert {w["name"]: w["value"] for w in widgets} == twin
    marked = {name for name, _, spec, _ in ex.schema_inputs(info) if spec.get("advanced")}
    folded = {w["name"] for w in widgets if w["advanced"]}
    assert folded == (marked if settings["knowsAdvanced"] else set())


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
    assert no_route["nodes"] == len(workflow()["nodes"])


def test_screenshots_are_taken_under_the_sessions_own_folder(session: dict[str, Any],
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    root = tmp_path_factory.getbasetemp()
    for shot in session["shots"].values():
        path = Path(shot)
        assert path.is_relative_to(root) and path.is_file() and path.stat().st_size > 2000
        assert path.stat().st_mtime > time.time() - 900


def _size(n: int) -> str:
    """The page's byte format (offload_core.report.gib)."""
    from diffusers_offload.offload_core.report import gib

    return gib(n)
