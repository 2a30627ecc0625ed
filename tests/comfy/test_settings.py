"""The Offload settings node in a real ComfyUI: the usual options in front, the rest advanced where
the host's inputs take ``advanced`` (2026 trees), plain widgets elsewhere (v0.3.75); every option
still settable; saved workflows still mapping their widget values by position."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from comfyhost import harness
from comfyhost.capture import capture_class

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]

CAPTURE = "DiffusersOffloadTest_SettingsCapture"
BASIC = ["mode", "preload", "pin_memory", "on_demand_threshold_gb", "always", "never"]
# The historic widget order: saved UI workflows store widget values by position.
ORDER = ["mode", "use_stream", "record_stream", "pin_memory", "pin_reserve_gb", "on_demand_threshold_gb",
         "resident_floor_mb", "always", "never", "preload", "prefetch_window", "device", "measures_path",
         "stream_parts", "prompt_cache_gb", "host_ram_gb", "cuda_graphs", "compile_blocks"]
OPTIONAL = ["stream_parts", "prompt_cache_gb", "host_ram_gb", "cuda_graphs", "compile_blocks"]  # added later: saved workflows lack them
Capture = capture_class()


@pytest.fixture(scope="module")
def info(comfy: harness.ComfyHost) -> dict[str, Any]:
    return ex.object_info(comfy, ex.SETTINGS)


@pytest.fixture(scope="module")
def host_takes_advanced(comfy: harness.ComfyHost) -> bool:
    """Read from the host's own V3 API, independently of the pack."""
    io = importlib.import_module("comfy_api.latest").io
    return "advanced" in inspect.signature(io.Boolean.Input.__init__).parameters


@pytest.fixture
def captured(comfy: harness.ComfyHost) -> Iterator[list[tuple[int, Any]]]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(comfy.nodes.NODE_CLASS_MAPPINGS, CAPTURE, Capture)
        Capture.seen.clear()
        yield Capture.seen


def test_the_usual_options_are_plain_and_the_rest_advanced_where_the_host_supports_it(
    info: dict[str, Any], host_takes_advanced: bool, comfy: harness.ComfyHost
) -> None:
    inputs = list(ex.schema_inputs(info))
    assert [name for name, *_ in inputs] == ORDER
    assert [name for name, _, _, optional in inputs if optional] == OPTIONAL
    advanced = [name for name, _, options, _ in inputs if options.get("advanced")]
    assert advanced == ([n for n in ORDER if n not in BASIC] if host_takes_advanced else [])
    assert tuple(BASIC) == comfy.pack_submodule("nodes.settings").BASIC


def test_every_option_is_still_settable(comfy: harness.ComfyHost, captured: list) -> None:
    """Advanced options included: each value reaches the OffloadConfig the node outputs."""
    values = {
        "mode": "leaf", "use_stream": False, "record_stream": False, "pin_memory": False, "pin_reserve_gb": 2.5,
        "on_demand_threshold_gb": 0.5, "resident_floor_mb": 8.0, "always": "vae", "never": "text_encoder",
        "preload": "3", "prefetch_window": 3, "device": "cpu", "measures_path": "/tmp/m.json",
        "stream_parts": False, "prompt_cache_gb": 0.25, "host_ram_gb": "24", "cuda_graphs": False, "compile_blocks": True,
    }
    prompt = {"1": {"class_type": ex.SETTINGS, "inputs": values},
              "2": {"class_type": CAPTURE, "inputs": {"value": ["1", 0], "slot": 0}}}

    comfy.run_prompt(prompt).raise_for_error()

    ((_, config),) = captured
    got = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    assert set(got) == set(ORDER)
    parsed = ("always", "never", "preload", "host_ram_gb")
    assert {k: v for k, v in got.items() if k not in parsed} == {k: v for k, v in values.items() if k not in parsed}
    assert (config.always, config.never, str(config.preload)) == (("vae",), ("text_encoder",), "3 GiB")
    assert config.host_ram_gb == 24.0 and config.host_ram_bytes == 24 * 2**30


WITH_SETTINGS = [e.name for e in ex.EXAMPLES if ex.SETTINGS in json.dumps(ex.api_prompt(e.name, "m"))]


@pytest.mark.parametrize("name", WITH_SETTINGS)
def test_saved_ui_workflows_map_their_settings_widgets_to_the_same_options(name: str, info: dict[str, Any]) -> None:
    workflow = json.loads((ex.EXAMPLES_DIR / f"{name}.json").read_text(encoding="utf-8"))
    twin = ex.api_prompt(name, ex.example(name).model)
    for node in workflow["nodes"]:
        if node["type"] == ex.SETTINGS:
            widgets = [n for n, kind, options, _ in ex.schema_inputs(info) if ex.is_widget(kind, options)]
            assert dict(zip(widgets, node["widgets_values"], strict=True)) == twin[str(node["id"])]["inputs"]


@pytest.mark.parametrize("saved_up_to", ["measures_path", "stream_parts"])
def test_a_workflow_saved_before_the_later_options_still_runs(comfy: harness.ComfyHost, captured: list,
                                                              saved_up_to: str) -> None:
    """The optional options came last: a prompt saved before them gets their defaults."""
    old = {"mode": "auto", "use_stream": True, "record_stream": False, "pin_memory": True, "pin_reserve_gb": 4.0,
           "on_demand_threshold_gb": 1.0, "resident_floor_mb": 64.0, "always": "", "never": "", "preload": "auto",
           "prefetch_window": 2, "device": "", "measures_path": "", "stream_parts": False}
    old = {k: v for k, v in old.items() if ORDER.index(k) <= ORDER.index(saved_up_to)}
    prompt = {"1": {"class_type": ex.SETTINGS, "inputs": old},
              "2": {"class_type": CAPTURE, "inputs": {"value": ["1", 0], "slot": 1}}}

    comfy.run_prompt(prompt).raise_for_error()

    ((_, config),) = captured
    default = comfy.pack_submodule("offload_core.config").OffloadConfig()
    assert config.prefetch_window == 2
    assert config.stream_parts is old.get("stream_parts", default.stream_parts)
    assert (config.prompt_cache_gb, config.host_ram_gb) == (default.prompt_cache_gb, default.host_ram_gb)
    assert (config.prompt_cache_gb, config.host_ram_gb) == (1.0, "auto")  # the documented defaults
    assert config.cuda_graphs is default.cuda_graphs is True
    assert config.compile_blocks is default.compile_blocks is False


@pytest.mark.parametrize("text", ["", "  ", "auto", "AUTO"])
def test_an_empty_host_ram_field_means_auto(comfy: harness.ComfyHost, captured: list, text: str) -> None:
    values = {"mode": "auto", "use_stream": True, "record_stream": False, "pin_memory": True, "pin_reserve_gb": 4.0,
              "on_demand_threshold_gb": 1.0, "resident_floor_mb": 64.0, "always": "", "never": "", "preload": "auto",
              "prefetch_window": 1, "device": "", "measures_path": "", "host_ram_gb": text}
    prompt = {"1": {"class_type": ex.SETTINGS, "inputs": values},
              "2": {"class_type": CAPTURE, "inputs": {"value": ["1", 0], "slot": 1}}}

    comfy.run_prompt(prompt).raise_for_error()

    ((_, config),) = captured
    assert config.host_ram_gb == "auto" and config.host_ram_bytes is None
