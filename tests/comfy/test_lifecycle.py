"""Our nodes inside a real ComfyUI: socket types, model-management registration, give-back,
unload-all, re-placement and launch flags.

On CPU every device byte is host memory, so "what we hold on the device" is made meaningful by
placing in mode ``none``: every component is resident on the load device and counts, so
ComfyUI's sizes can be compared with the engine's report and ``free_memory`` has something to
take back. Roles that hold nothing on a CPU device (per-step, leaf, on-demand) are used where
hooks matter (unload-all must strip them). ``comfy.free()`` starts a test from an empty cache
and no loaded model.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import shutil
import weakref
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from comfyhost import harness

pytest_plugins = ["comfyhost.fixtures"]

MODEL = "tiny/wan"
PROBE = "DiffusersOffloadTest_Probe"
NODE_IDS = {
    "DiffusersOffloadLoadPipeline": ["DIFFUSERS_PIPE"],
    "DiffusersOffloadSettings": ["OFFLOAD_CONFIG"],
    "DiffusersOffloadApplySettings": ["DIFFUSERS_PIPE"],
    "DiffusersOffloadReport": ["STRING"],
}
SETTINGS = {
    "mode": "auto", "use_stream": True, "record_stream": False, "pin_memory": True, "pin_reserve_gb": 4.0,
    "on_demand_threshold_gb": 1.0, "resident_floor_mb": 64.0, "always": "", "never": "", "preload": "auto",
    "prefetch_window": 1, "device": "", "measures_path": "", "stream_parts": True, "prompt_cache_gb": 1.0,
    "host_ram_gb": "auto", "cuda_graphs": True, "compile_blocks": False,
}
RESIDENT = {"mode": "none"}
STREAMED = {"resident_floor_mb": 0.0, "on_demand_threshold_gb": 0.0}  # tiny parts get real roles


@pytest.fixture(scope="module")
def model(comfy: harness.ComfyHost, tiny_wan_dir: Path) -> str:
    """The tiny Wan pipeline copied under ComfyUI's models/diffusers; returns its listed name."""
    dest = Path(comfy.folder_paths.get_folder_paths("diffusers")[0]) / MODEL
    if not dest.is_dir():
        shutil.copytree(tiny_wan_dir, dest)
    return MODEL


@pytest.fixture(scope="module")
def pack(comfy: harness.ComfyHost) -> SimpleNamespace:
    """Our modules as ComfyUI imported them (their classes and globals are the live ones)."""
    sub = comfy.pack_submodule
    return SimpleNamespace(host=sub("nodes.host"), types=sub("nodes.types"), config=sub("offload_core.config"),
                           pinning=sub("offload_core.pinning"))


@pytest.fixture
def clean(comfy: harness.ComfyHost) -> harness.ComfyHost:
    comfy.free()
    return comfy


def prompt(model: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load -> (Offload settings -> Apply) -> Placement report."""
    nodes: dict[str, Any] = {
        "1": {"class_type": "DiffusersOffloadLoadPipeline", "inputs": {"model": model, "dtype": "fp32"}},
    }
    pipe = ["1", 0]
    if settings is not None:
        nodes["2"] = {"class_type": "DiffusersOffloadSettings", "inputs": {**SETTINGS, **settings}}
        nodes["3"] = {"class_type": "DiffusersOffloadApplySettings", "inputs": {"pipe": pipe, "offload": ["2", 0]}}
        pipe = ["3", 0]
    nodes["4"] = {"class_type": "DiffusersOffloadReport", "inputs": {"pipe": pipe}}
    return nodes


def ours(mm: ModuleType, pack: SimpleNamespace) -> list[Any]:
    """Our entries in ComfyUI's list of loaded models."""
    return [lm for lm in mm.current_loaded_models if isinstance(lm.model, pack.host.DiffusersPatcher)]


def only_patcher(comfy: harness.ComfyHost, pack: SimpleNamespace) -> Any:
    (entry,) = ours(comfy.model_management, pack)
    return entry.model


def hooks_left(pipe: Any) -> list[str]:
    """Every diffusers hook or accelerate-style ``_hf_hook`` still on a module of the pipeline."""
    left = []
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        for sub, module in component.named_modules():
            registry = module.__dict__.get("_diffusers_hook")
            if registry is not None and registry.hooks:
                left.append(f"{name}.{sub}: {list(registry.hooks)}")
            if "_hf_hook" in module.__dict__:
                left.append(f"{name}.{sub}: _hf_hook")
    return left


@pytest.fixture
def probe(comfy: harness.ComfyHost, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """A throwaway output node taking our three socket types; records what it received."""
    seen: list[dict[str, Any]] = []

    class Probe:
        @classmethod
        def INPUT_TYPES(cls) -> dict[str, Any]:
            return {"required": {"pipe": ("DIFFUSERS_PIPE",), "offload": ("OFFLOAD_CONFIG",),
                                 "text": ("STRING", {"forceInput": True})}}

        RETURN_TYPES = ()
        OUTPUT_NODE = True
        FUNCTION = "run"
        CATEGORY = "testing"

        def run(self, pipe: Any, offload: Any, text: str) -> dict[str, Any]:
            seen.append({"pipe": pipe, "offload": offload, "text": text})
            return {}

    monkeypatch.setitem(comfy.nodes.NODE_CLASS_MAPPINGS, PROBE, Probe)
    return seen


def test_nodes_are_registered_with_their_socket_types(comfy: harness.ComfyHost, pack: SimpleNamespace) -> None:
    assert set(NODE_IDS) <= set(comfy.pack_node_ids())
    assert all(node_id.startswith("DiffusersOffload") for node_id in comfy.pack_node_ids())
    for node_id, returns in NODE_IDS.items():
        assert list(comfy.nodes.NODE_CLASS_MAPPINGS[node_id].RETURN_TYPES) == returns
    inputs = comfy.nodes.NODE_CLASS_MAPPINGS["DiffusersOffloadSettings"].INPUT_TYPES()
    widgets = {**inputs["required"], **inputs.get("optional", {})}
    assert set(widgets) == set(SETTINGS) == {f.name for f in dataclasses.fields(pack.config.OffloadConfig)}
    # added later, after every earlier widget: saved workflows lack them
    assert set(inputs.get("optional", {})) == {"stream_parts", "prompt_cache_gb", "host_ram_gb", "cuda_graphs", "compile_blocks"}


def test_outputs_flow_as_comfyui_types(clean: harness.ComfyHost, pack: SimpleNamespace, model: str,
                                       probe: list[dict[str, Any]]) -> None:
    graph = prompt(model, {"preload": "off", "never": "vae"})
    graph["5"] = {"class_type": PROBE, "inputs": {"pipe": ["3", 0], "offload": ["2", 0], "text": ["4", 0]}}

    result = clean.run_prompt(graph).raise_for_error()

    (got,) = probe
    handle, config = got["pipe"], got["offload"]
    assert isinstance(handle, pack.types.PipeHandle) and isinstance(config, pack.config.OffloadConfig)
    assert (handle.family, handle.dtype, type(handle.pipe).__name__) == ("wan", torch.float32, "WanPipeline")
    assert Path(handle.path) == Path(clean.folder_paths.get_folder_paths("diffusers")[0]) / model
    assert handle.config is config and (str(config.preload), config.never) == ("off", ("vae",))
    assert handle.patcher is only_patcher(clean, pack)
    assert got["text"].startswith("WanPipeline on cpu") and "never list ('vae')" in got["text"]
    assert list(result.outputs["4"]["text"]) == [got["text"]]


def test_registered_sizes_are_the_engine_report(clean: harness.ComfyHost, pack: SimpleNamespace, model: str) -> None:
    mm = clean.model_management
    clean.run_prompt(prompt(model, RESIDENT)).raise_for_error()

    (entry,) = ours(mm, pack)
    patcher = entry.model
    report = patcher.report()
    total = sum(c.nbytes for c in report.components)
    assert {c.role for c in report.components if c.nbytes} == {"resident"}
    assert entry.model_memory() == patcher.model_size() == total > 0
    assert entry.model_loaded_memory() == report.device_bytes == total
    assert patcher.model.model_loaded_weight_memory == total
    assert mm.module_size(patcher.model) == 0  # ComfyUI's own walk sees none of the pipeline's weights
    assert patcher.current_loaded_device() == entry.device == mm.get_torch_device()
    assert patcher.model_dtype() == torch.float32
    assert not getattr(patcher, "is_dynamic", lambda: False)()


def test_free_memory_asks_for_a_part_then_detaches(clean: harness.ComfyHost, pack: SimpleNamespace, model: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    mm = clean.model_management
    clean.run_prompt(prompt(model, RESIDENT)).raise_for_error()
    patcher = only_patcher(clean, pack)
    held = patcher.loaded_size()
    calls = _spy(monkeypatch, pack.host.DiffusersPatcher, "partially_unload", "detach")
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (0, 0) if torch_free_too else 0)

    mm.free_memory(held // 2, mm.get_torch_device())

    assert [c[2] for c in calls["partially_unload"]] == [held // 2]  # resident weights cannot go in part...
    assert [c for c in calls["detach"] if c[0] is patcher] == [(patcher, True)]  # ...so the whole goes
    assert ours(mm, pack) == [] and patcher.loaded_size() == 0
    assert {c.role for c in patcher.report().components} == {"unplaced"}
    assert hooks_left(patcher.pipe) == []


def test_what_the_engine_gives_back_is_what_comfyui_is_told(clean: harness.ComfyHost, pack: SimpleNamespace,
                                                            model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mm = clean.model_management
    clean.run_prompt(prompt(model, RESIDENT)).raise_for_error()
    patcher = only_patcher(clean, pack)
    asked = []
    monkeypatch.setattr(pack.host.ENGINE, "give_back", lambda pipe, nbytes: asked.append(nbytes) or nbytes)
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (0, 0) if torch_free_too else 0)

    mm.free_memory(patcher.loaded_size() // 2, mm.get_torch_device())

    assert asked == [patcher.loaded_size() // 2]
    assert ours(mm, pack) and ours(mm, pack)[0].model is patcher  # enough was freed: it stays loaded


def test_unload_all_leaves_no_hook_and_the_next_prompt_replaces(clean: harness.ComfyHost, pack: SimpleNamespace,
                                                                 model: str) -> None:
    mm = clean.model_management
    graph = prompt(model, STREAMED)
    clean.run_prompt(graph).raise_for_error()
    (entry,) = ours(mm, pack)
    patcher, pipe = entry.model, entry.model.pipe
    assert hooks_left(pipe), "the streamed placement should have hooked the pipeline"
    assert entry.model_loaded_memory() == patcher.report().device_bytes

    mm.unload_all_models()

    assert hooks_left(pipe) == []
    assert pack.pinning.pinned_bytes() == 0
    assert ours(mm, pack) == [] and {c.role for c in patcher.report().components} == {"unplaced"}

    again = clean.run_prompt(graph).raise_for_error()

    assert "1" in again.events_named("execution_cached")[0]["nodes"]  # no reload...
    assert only_patcher(clean, pack).pipe is pipe  # ...the same pipeline, placed again
    assert hooks_left(pipe) and "per-step" in again.outputs["4"]["text"][0]


def test_an_evicted_pipeline_is_released_and_freed(clean: harness.ComfyHost, pack: SimpleNamespace, model: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    clean.run_prompt(prompt(model, STREAMED)).raise_for_error()
    patcher = only_patcher(clean, pack)
    released, release = [], pack.host.ENGINE.release
    monkeypatch.setattr(pack.host.ENGINE, "release", lambda pipe: released.append(hooks_left(pipe)) or release(pipe))
    pipe_ref = weakref.ref(patcher.pipe)
    del patcher

    clean.executor.reset()  # the cache drops the loader's output; ComfyUI only holds weak references
    gc.collect()
    clean.model_management.cleanup_models()

    assert len(released) == 1 and released[0], "the hooked pipeline should have been released"
    assert pipe_ref() is None and ours(clean.model_management, pack) == []
    assert pack.pinning.pinned_bytes() == 0


def test_new_settings_replace_the_loaded_pipeline_without_reload(clean: harness.ComfyHost, pack: SimpleNamespace,
                                                                 model: str) -> None:
    first = clean.run_prompt(prompt(model, RESIDENT)).raise_for_error()
    patcher = only_patcher(clean, pack)
    roles = {c.name: c.role for c in patcher.report().components}

    second = clean.run_prompt(prompt(model, STREAMED)).raise_for_error()

    assert "1" in second.events_named("execution_cached")[0]["nodes"]
    assert only_patcher(clean, pack) is patcher
    replaced = {c.name: c.role for c in patcher.report().components}
    assert roles["transformer"] == "resident" and replaced["transformer"] == "per-step"
    assert (replaced["text_encoder"], replaced["vae"]) == ("leaf", "on-demand")
    assert first.outputs["4"]["text"][0] != second.outputs["4"]["text"][0]


def test_an_option_set_that_cannot_work_is_refused_by_name(comfy: harness.ComfyHost, model: str) -> None:
    result = comfy.run_prompt(prompt(model, {"record_stream": True, "use_stream": False}))

    assert not result.success and result.error["node_id"] == "2"
    assert "record_stream=True needs use_stream=True" in result.error["exception_message"]


def test_patcher_stays_classic_and_clones_truthfully(clean: harness.ComfyHost, pack: SimpleNamespace, model: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    patcher_module = importlib.import_module("comfy.model_patcher")
    dynamic = getattr(patcher_module, "ModelPatcherDynamic", None)
    if dynamic is not None:  # what main.py does when DynamicVRAM is on (2026 trees)
        monkeypatch.setattr(patcher_module, "CoreModelPatcher", dynamic)

    clean.run_prompt(prompt(model, RESIDENT)).raise_for_error()
    patcher = only_patcher(clean, pack)
    clone = patcher.clone()

    assert type(clone) is type(patcher) is pack.host.DiffusersPatcher
    assert dynamic is None or not isinstance(patcher, dynamic)
    assert clone.is_clone(patcher) and clone.pipe is patcher.pipe
    assert (clone.model_size(), clone.loaded_size()) == (patcher.model_size(), patcher.loaded_size())


@pytest.mark.parametrize(
    ("flag", "user", "expected"),
    [
        ("cpu", {"device": "cuda:1"}, {"device": "cpu"}),
        ("highvram", {}, {"mode": "none"}),
        ("gpu_only", {"mode": "leaf"}, {"mode": "leaf"}),
        ("novram", {}, {"preload": "off", "resident_floor_mb": 0.0, "on_demand_threshold_gb": 0.0}),
        ("disable_pinned_memory", {}, {"pin_memory": False}),
    ],
)
def test_launch_flags_adjust_the_settings(comfy: harness.ComfyHost, pack: SimpleNamespace,
                                          monkeypatch: pytest.MonkeyPatch, flag: str, user: dict[str, Any],
                                          expected: dict[str, Any]) -> None:
    monkeypatch.setattr(pack.host.args, flag, True)

    config = pack.host.effective_config(pack.config.OffloadConfig(**user))

    assert {k: str(getattr(config, k)) for k in expected} == {k: str(v) for k, v in expected.items()}  # preload: a policy
    assert config.device == "cpu"  # this test host runs ComfyUI with --cpu


def test_the_allocator_note_names_the_launch_flag_under_comfyuis_default_allocator(pack: SimpleNamespace) -> None:
    note = pack.host.allocator_note("cudaMallocAsync")

    assert note is not None and "--disable-cuda-malloc" in note
    assert pack.host.allocator_note("native") is None


def test_reserved_vram_is_kept_out_of_the_preload_budget(pack: SimpleNamespace,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    monkeypatch.setattr(pack.host.mm, "EXTRA_RESERVED_VRAM", 2 * gib)  # --reserve-vram 2
    monkeypatch.setattr(pack.host.MemoryReader, "device_free", lambda self, device: (8 * gib, gib))

    assert pack.host.ComfyMemory().device_free(torch.device("cuda")) == (6 * gib, gib)


def _spy(monkeypatch: pytest.MonkeyPatch, cls: type, *names: str) -> dict[str, list[tuple]]:
    """Record the calls of ``cls``'s methods ``names`` (positional arguments, self first)."""
    calls: dict[str, list[tuple]] = {name: [] for name in names}
    for name in names:
        original = getattr(cls, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls[_name].append((self, *args, *kwargs.values()))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    return calls


def test_comfyui_unloading_beside_a_dying_model_keeps_its_list_whole(clean: harness.ComfyHost,
                                                                    pack: SimpleNamespace, model: str) -> None:
    """ComfyUI's free_memory unloads by index, then pops those indices; another model held only by a
    reference cycle dies at the next garbage collection, and its finalizer pops its own entry. A
    collection inside our unload (the engine's release used to run one) shrank the list under the
    loop: an IndexError in CI, a crash in the other model's unload here. Ours is released, the other
    unloaded."""
    mm = clean.model_management
    clean.run_prompt(prompt(model, STREAMED)).raise_for_error()
    (entry,) = ours(mm, pack)
    pipe = entry.model.pipe
    gc.disable()  # the cycle below must outlive this set-up: only a collection inside the unload frees it
    try:
        other = importlib.import_module("comfy.model_patcher").ModelPatcher(torch.nn.Linear(4, 4), torch.device("cpu"), torch.device("cpu"))
        other.cycle = other
        mm.load_models_gpu([other])
        assert len(mm.current_loaded_models) == 2
        del other
        mm.unload_all_models()
    finally:
        gc.enable()
    assert hooks_left(pipe) == [] and pack.pinning.pinned_bytes() == 0
    assert ours(mm, pack) == []
