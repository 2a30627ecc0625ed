"""The frontend extension in headless Chromium against a real ComfyUI server on loopback.

One browser session (``browser_session.py`` driving ``drive.mjs``) loads the page, queues the Wan
example's API twin on the tiny Wan model twice (a short run, then a long one reloaded mid-run and
interrupted), opens other workflow tabs (the same node ids in another workflow; every node's help
page; the node search) and a second page on which the state route answers 404; the tests below
check what it recorded. Every request to a host other than the loopback server is aborted. It
writes only under pytest's temporary folder (the README's screenshots come from ``make screenshots``).

Skipped (with the reason) without Chromium, node, playwright-core (``tests/web/setup.sh``
installs all three), the frontend package or a ComfyUI tree; failed instead when
``WEB_TESTS_REQUIRED`` is set (``.ci/run`` sets it).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pytest runs with --import-mode=importlib
from browser_session import (  # noqa: E402
    EXAMPLE,
    OLDER,
    SAVED_CHANGES,
    SHORT_STEPS,
    SNAPPED_WIDTH,
    SessionUnavailable,
    ex,  # noqa: E402
    failure,
    node_ids,
    run_session,
    workflow,
)

WEB = Path(__file__).resolve().parents[2] / "web"
PACK_URL = "/extensions/ComfyUI-DiffusersOffload/"
STAGE_TEXT = re.compile(r"^(decoding|denoise|text encode|image encode|video decode|audio decode)\b")
ALIASES = {  # the words the node search also matches, where the server takes search aliases
    "DiffusersOffloadLoadPipeline": {"offload", "block swap", "wan", "flux"},
    "DiffusersOffloadLoadModularPipeline": {"offload", "block swap", "h3"},
    "DiffusersOffloadLoadDiffusionModelFile": {"offload", "block swap", "wan", "fp8", "gguf", "single file"},
    "DiffusersOffloadGenerateImage": {"flux"},
    "DiffusersOffloadGenerateVideo": {"wan"},
    "DiffusersOffloadGenerateH3": {"h3"},
    "DiffusersOffloadSettings": {"offload", "block swap"},
    "DiffusersOffloadApplySettings": {"offload", "block swap"},
    "DiffusersOffloadReport": {"offload"},
}


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


def _assert_placement(view: dict[str, Any], route: dict[str, Any]) -> None:
    """The view's rows are the route's components, each bar split as the route's segments."""
    assert view["shows"] == "placement" and view["visible"], view
    rows = {r["name"]: r for r in view["rows"]}
    assert set(rows) == {c["name"] for c in route["components"]}
    for c in route["components"]:
        row = rows[c["name"]]
        assert row["nbytes"] == c["nbytes"]
        shown = {k: round(v, 3) for k, v in row["segments"].items()}
        expected = {k: round(100 * v / c["nbytes"], 3) for k, v in c["segments"].items() if v}
        assert shown == expected, c["name"]


def test_extension_loads_once_without_errors_and_no_request_leaves_loopback(session: dict[str, Any]) -> None:
    modules = [e for e in session["extensions"] if e.startswith(PACK_URL)]
    assert PACK_URL + "diffusers_offload.js" in modules
    assert {PACK_URL + f"dofl/{p.name}" for p in (WEB / "dofl").glob("*.js")} <= set(modules)
    assert session["registered"] == ["diffusers_offload.view"]  # the entry only, though every file loads
    assert {"DiffusersOffloadLoadPipeline", "DiffusersOffloadGenerateVideo"} <= set(session["nodeTypes"])
    assert session["tabButton"] == 1
    # a failed request is logged by the browser, not by a script: only the 404 page may have one
    ours = [m for m in session["console"] if m["ours"] and m["type"] == "error"
            and not (m["page"] == "no-route" and m["text"].startswith("Failed to load resource"))
            and not m["url"].endswith("/en.md")]  # the help's first, localized try
    ours += [e for e in session["pageErrors"] if e["ours"]]
    assert ours == []
    assert session["network"]["outside"] == []  # every other host was aborted by the route
    for url in session["network"]["blocked"]:
        assert not re.match(r"https?://(127\.0\.0\.1|localhost)[:/]", url), url


def test_product_scripts_stay_under_400_lines() -> None:
    for script in WEB.rglob("*.js"):
        assert len(script.read_text(encoding="utf-8").splitlines()) < 400, script


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


@pytest.mark.parametrize("last", OLDER)
def test_a_settings_node_saved_before_the_later_options_loads_with_its_values_and_the_defaults(
    session: dict[str, Any], last: str
) -> None:
    """Widget values are stored by position: a node saved when ``last`` was its last widget keeps
    every saved value in place, and the options added after it show their defaults."""
    older = session["olderSettings"][last]
    info = session["settingsSchema"]["DiffusersOffloadSettings"]
    twin = {**ex.api_prompt(EXAMPLE, ex.example(EXAMPLE).model)[older["id"]]["inputs"], **SAVED_CHANGES}
    options = [name for name, *_ in ex.schema_inputs(info)]
    defaults = {name: spec["default"] for name, _, spec, _ in ex.schema_inputs(info)}
    shown = {w["name"]: w["value"] for w in older["widgets"] if w["name"] in options}
    saved = options[:options.index(last) + 1]
    assert list(shown) == options
    assert {n: shown[n] for n in saved} == {n: twin[n] for n in saved}
    assert {n: shown[n] for n in options if n not in saved} == {n: defaults[n] for n in options if n not in saved}
    assert {"prompt_cache_gb", "host_ram_gb"} <= set(options) - set(saved)


def test_generate_node_shows_stage_and_step_only_then_nothing(session: dict[str, Any]) -> None:
    assert session["shortHistory"]["status_str"] == "success"
    seen = session["seen"]
    # every stage is sent, in order: the steps, then the decode, then the end (no stage), each
    # with the prompt and the workflow it belongs to
    sent = session["events"]["stages"]
    assert session["events"]["stage"] >= SHORT_STEPS + 1
    assert sent.count("denoise") >= SHORT_STEPS and "decode" in sent[sent.index("denoise"):], sent
    assert sent[-1] == "", sent
    payloads = session["events"]["stagePayloads"]
    assert payloads == [{"prompt": session["shortId"], "workflow": session["workflowId"]}] * len(payloads)
    # the view draws once per frame, so quick updates may show as one (a tiny model's decode can
    # come and go within a frame): what it shows is in order, with no component row ever
    denoise = [t for t in seen if t.startswith("denoise ")]
    steps = [int(t.split()[1].split("/")[0]) for t in denoise]
    assert denoise and all(t.endswith(f"/{SHORT_STEPS}") for t in denoise), seen
    assert steps == sorted(steps) and steps[0] >= 1, seen
    assert session["generateRows"] == 0
    after = session["after"]["views"]
    assert after["generate"]["shows"] == "nothing" and after["settings"]["shows"] == "nothing"


def test_no_preview_image_when_previews_are_off(session: dict[str, Any]) -> None:
    """The session's server runs with ComfyUI's default preview method (none): the generate node
    sends no preview image and the frontend draws none on it (``make screenshots`` turns them on)."""
    assert session["events"]["previews"] == 0 and session["events"]["previewNodes"] == []
    assert session["preview"]["held"] == 0 and session["preview"]["imgs"] == 0
    assert "preview" not in session["shots"]


def test_placement_is_drawn_on_the_loader_and_the_report_only(session: dict[str, Any]) -> None:
    route = _route_pipeline(session)
    after = session["after"]["views"]
    _assert_placement(after["loader"], route)
    _assert_placement(after["report"], route)
    assert after["loader"]["stage"] == "idle" and after["loader"]["text"].startswith("cpu: ")
    roles = {c["name"]: c["role"] for c in route["components"]}
    assert roles == {"text_encoder": "resident", "vae": "on-demand", "transformer": "per-step"}
    ids = node_ids()
    uses = {(u["workflow"], u["node"]): u["prompt"] for u in route["uses"]}
    assert uses[(session["workflowId"], ids["loader"])] == session["shortId"]


def test_stage_text_under_the_node_is_cleared_when_the_run_ends(session: dict[str, Any]) -> None:
    """ComfyUI shows the stage the pack sends as progress text ("decoding") under the node; once the
    run ends the node shows the run's notes again (the short run's width was snapped), or nothing."""
    sent = session["events"]["progressText"]
    stages = [t for t in sent if STAGE_TEXT.match(t)]
    notes = [t for t in sent if not STAGE_TEXT.match(t)]
    assert stages and stages[-1] == sent[-1], sent  # a stage was the last text shown during the run
    assert notes and str(SNAPPED_WIDTH) in notes[-1], sent
    assert session["after"]["views"]["generate"]["progressText"] == notes[-1]
    assert session["afterLong"]["progressText"] is None  # no notes in the long run: no text at all


def test_nodes_are_sized_to_what_they_show(session: dict[str, Any]) -> None:
    """The loader grows just enough for its rows (its view inside the node), the generate node is
    back at its own size once its stage is gone, and no node of ours overlaps another node."""
    before, after = session["idle"]["views"], session["after"]["views"]
    saved = {str(n["id"]): n["size"] for n in workflow()["nodes"]}
    ids = node_ids()
    loader = after["loader"]
    assert loader["size"][1] == max(saved[ids["loader"]][1], loader["least"])
    assert loader["box"]["bottom"] <= loader["nodeBox"]["bottom"] + 1, loader
    assert after["generate"]["size"] == before["generate"]["size"] == saved[ids["generate"]]
    for view in (after["report"], session["reload"]["loader"]):
        assert view["box"]["bottom"] <= view["nodeBox"]["bottom"] + 1, view
    boxes = session["after"]["layout"]
    for a in boxes:
        for b in boxes:
            if a["id"] < b["id"] and (a["ours"] or b["ours"]):
                apart = (a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"]
                         or a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"])
                assert apart, (a, b)


def test_another_workflow_tab_with_the_same_node_ids_shows_nothing_of_this_run(session: dict[str, Any]) -> None:
    other, back = session["otherTab"], session["backTab"]
    assert other["workflowId"] != session["workflowId"]
    for name, view in other["views"].items():
        assert view["shows"] == "nothing" and not view["rows"], (name, view)
    assert back["workflowId"] == session["workflowId"]
    _assert_placement(back["views"]["loader"], _route_pipeline(session))
    assert back["views"]["generate"]["shows"] == "nothing"


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


def test_reload_mid_run_buffers_early_events_and_restores_the_view_from_the_route(session: dict[str, Any]) -> None:
    reload = session["reload"]
    assert not reload["historyDoneAtReload"], "the long run ended before the reload: raise LONG_STEPS"
    assert reload["workflowRestoredByFrontend"]
    generate = node_ids()["generate"]
    stage = reload["routeStages"][generate]
    assert stage["stage"] in ("denoise", "decode")
    assert (stage["prompt"], stage["workflow"]) == (session["longId"], session["workflowId"])
    assert reload["view"]["stage"] in ("denoise", "decode") and not reload["view"]["rows"]
    assert reload["loader"]["rows"]
    assert reload["early"] >= 1, "no event came before the extension's setup: the buffer was not exercised"
    unknown = [m for m in session["console"] if "diffusers_offload." in m["text"]]
    assert unknown == []  # no "Unhandled message ... Unknown message type diffusers_offload.stage"
    assert session["longHistory"]["status_str"] in ("error", "success")  # interrupted, or done first
    assert session["afterLong"]["shows"] == "nothing"  # quiet again once nothing runs


def test_every_node_has_a_help_page_the_frontend_shows(session: dict[str, Any]) -> None:
    assert set(session["help"]) == set(session["nodeTypes"])
    for node_type, shown in session["help"].items():
        page = (WEB / "docs" / f"{node_type}.md").read_text(encoding="utf-8")
        title = session["nodeInfo"][node_type]["display_name"]
        assert page.startswith(f"# {title}\n"), node_type
        assert shown and shown["title"] == title, (node_type, shown)
    for node_type in ("DiffusersOffloadLoadPipeline", "DiffusersOffloadSettings"):
        page = (WEB / "docs" / f"{node_type}.md").read_text(encoding="utf-8").lower()
        for topic in ("preload", "pinned", "ram"):
            assert topic in page, (node_type, topic)


def test_search_aliases_where_the_server_takes_them(session: dict[str, Any]) -> None:
    """2026 trees: the words are in the node info and the frontend's node search finds the nodes by
    them. v0.3.75's schema has no such field: none is passed (the node would fail to register)."""
    info = session["nodeInfo"]
    if not session["schemaTakesAliases"]:
        assert all(n["search_aliases"] is None for n in info.values()) and "search" not in session
        assert set(ALIASES) <= set(info)  # every node registered all the same
        return
    for node_type, words in ALIASES.items():
        assert set(info[node_type]["search_aliases"]) == words, node_type
    assert any(o.startswith("Offload settings") for o in session["search"]["block swap"])
    assert any(o.startswith("Load diffusers pipeline") for o in session["search"]["wan"])
    assert any(o.startswith("Generate video + audio (MiniMax-H3)") for o in session["search"]["h3"])


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
