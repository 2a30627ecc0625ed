"""The web view's Python side inside a real ComfyUI (no browser): the state route's JSON and the
websocket events a run of the Wan example sends, checked against the engine's own report."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from comfyhost import harness

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]

SETTINGS = {"resident_floor_mb": 0.1, "on_demand_threshold_gb": 0.0}  # one role of each kind
STEPS = 2
EXAMPLE = "wan_text_to_video"


@pytest.fixture(scope="module")
def web_api(comfy: harness.ComfyHost) -> Any:
    return comfy.pack_submodule("nodes.web_api")


@pytest.fixture(scope="module")
def run(comfy: harness.ComfyHost, tiny_wan_dir: Path) -> harness.RunResult:
    model = ex.link_model(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]), tiny_wan_dir)
    overrides = ex.example(EXAMPLE).tiny_overrides(steps=STEPS, seed=random.randrange(2**32))
    prompt = ex.api_prompt(EXAMPLE, model, {**overrides, ex.SETTINGS: SETTINGS})
    return comfy.run_prompt(prompt).raise_for_error()


def test_the_route_is_registered_on_the_servers_routes(comfy: harness.ComfyHost, web_api: Any) -> None:
    assert web_api.register_routes()
    assert any(getattr(r, "path", "") == web_api.ROUTE for r in comfy.server.routes)


def test_state_lists_the_pipeline_as_the_engine_reports_it(run: harness.RunResult, web_api: Any) -> None:
    state = web_api.REGISTRY.state()
    json.dumps(state)  # what the route serves
    (pipeline,) = [p for p in state["pipelines"] if p["pipeline"] == "WanPipeline" and "4" in p["nodes"]]
    roles = {c["name"]: c["role"] for c in pipeline["components"]}
    assert roles == {"text_encoder": "resident", "vae": "on-demand", "transformer": "per-step"}
    for c in pipeline["components"]:
        assert sum(c["segments"].values()) == c["nbytes"]
    assert pipeline["plan"].startswith("blocks kept ") and pipeline["plan_change"]["line"]
    assert pipeline["total_bytes"] == sum(c["nbytes"] for c in pipeline["components"])
    assert state["stages"] == {}  # nothing runs: quiet


def test_a_run_sends_each_step_then_ends_the_stage(run: harness.RunResult, web_api: Any) -> None:
    stages = [e for e in run.events_named(web_api.EVENT_STAGE) if e["node"] == "4"]
    texts = [e["stage"] and e["text"] for e in stages]
    units = ("text encode layer ", "video decode chunk ")  # a classic run's other stages, unit by unit
    assert [t for t in texts if not (t and t.startswith(units))] == [
        *(f"denoise {i}/{STEPS}" for i in range(1, STEPS + 1)), "decode", None]
    assert texts[0].startswith(units[0]) and texts[-2].startswith(units[1])
    placements = run.events_named(web_api.EVENT_PLACEMENT)
    assert placements and placements[-1]["components"]


def test_hooks_never_raise(web_api: Any) -> None:
    web_api.changed(object())  # not a patcher: logged at debug, never raised
    web_api.stage(None, "denoise", 1, 2)  # no node: ignored
