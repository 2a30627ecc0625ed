"""The example workflows as ComfyUI's template browser offers them: listed, with a thumbnail, a Note
naming the model and how to fetch it, only inputs the pack ships, the plain settings -> loader ->
generate -> save chain, and the first/last-frame twin run on the keyframes it ships.

How the browser reads custom-node templates (ComfyUI v0.3.75 and the 2026 tree, frontends 1.32
and 1.49): ``GET /workflow_templates`` maps each ``custom_nodes`` folder to the stems of its
``example_workflows/*.json`` (subfolders such as ``api/`` and ``input/`` are not listed); each
stem is the template's title, and its thumbnail is ``/api/workflow_templates/<folder>/<stem>.jpg``,
a static route over ``example_workflows/``. Graph validity against the node schemas is
``test_workflows.py``'s part.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from comfyhost import harness
from PIL import Image

sys.path.append(str(Path(__file__).resolve().parents[2] / "tools"))  # tools/ only, never the repo root
import offload_examples as ex  # noqa: E402

pytest_plugins = ["comfyhost.fixtures"]

NAMES = [e.name for e in ex.EXAMPLES]
UI_KEYS = {"id", "type", "pos", "size", "flags", "order", "mode", "inputs", "outputs", "properties",
           "widgets_values"}
CHAIN = {  # what a template holds: settings -> loader -> generate -> save, plus the two text outputs
    "settings": {ex.SETTINGS},
    "loader": {ex.LOADER, "DiffusersOffloadLoadModularPipeline", ex.sf.SINGLE_FILE_LOADER},
    "generate": set(ex.GENERATE),
    "save": {"SaveImage", "SaveVideo"},
    "text": {"PreviewAny", "DiffusersOffloadReport"},
    "input": {"LoadImage"},
}
SINGLE_FILE = [e.name for e in ex.EXAMPLES if e.files]
# the single-file templates run on the default settings for now: the settings node's widgets are being
# reworked (issue 23), and a template with the old widgets would fail to load once they change
WITHOUT_SETTINGS = set(SINGLE_FILE)


def ui(name: str) -> dict[str, Any]:
    return json.loads((ex.EXAMPLES_DIR / f"{name}.json").read_text(encoding="utf-8"))


def loaded_images(name: str) -> list[str]:
    return [n["widgets_values"][0] for n in ui(name)["nodes"] if n["type"] == "LoadImage"]


def template_routes(comfy: harness.ComfyHost) -> tuple[dict[str, list[str]], dict[str, Path]]:
    """ComfyUI's own template routes: the listing, and the folder each static prefix serves."""
    from aiohttp import web
    from app.custom_node_manager import CustomNodeManager

    routes, app = web.RouteTableDef(), web.Application()
    CustomNodeManager().add_routes(routes, app, comfy.nodes.LOADED_MODULE_DIRS.items())
    handler = next(r.handler for r in routes if r.path == "/workflow_templates")
    listing = json.loads(comfy.loop.run_until_complete(handler(None)).body)
    static = {
        info["prefix"].rstrip("/"): Path(info["directory"])
        for info in (resource.get_info() for resource in app.router.resources())
        if "directory" in info
    }
    return listing, static


# --------------------------------------------------------------------------- the browser's view


def test_comfyui_lists_every_template_with_its_thumbnail(comfy: harness.ComfyHost) -> None:
    listing, static = template_routes(comfy)
    folder = Path(comfy.pack_path).name
    assert sorted(listing[folder]) == sorted(NAMES)  # not the api/ twins, not input/
    served = static[f"/api/workflow_templates/{folder}"]
    for name in NAMES:
        assert (served / f"{name}.json").is_file()
        with Image.open(served / f"{name}.jpg") as thumb:  # the browser asks for <stem>.jpg, nothing else
            assert thumb.format == "JPEG" and thumb.size[0] >= 256 and thumb.size[1] >= 256, name


def test_nothing_but_templates_and_their_files_in_example_workflows() -> None:
    shipped = {p.name for p in ex.EXAMPLES_DIR.iterdir()}
    expected = {f"{n}{suffix}" for n in NAMES for suffix in (".json", ".jpg")} | {"api", "input"}
    assert shipped == expected


@pytest.mark.parametrize("name", NAMES)
def test_template_is_a_saved_frontend_graph(name: str) -> None:
    workflow = ui(name)
    ids = [node["id"] for node in workflow["nodes"]]
    assert len(ids) == len(set(ids)) and workflow["last_node_id"] == max(ids)
    for node in workflow["nodes"]:
        assert set(node) >= UI_KEYS, (node["id"], UI_KEYS - set(node))


# -------------------------------------------------------------------------------- the Note


@pytest.mark.parametrize("name", NAMES)
def test_template_has_a_note_naming_its_model_and_where_it_goes(name: str) -> None:
    example = ex.example(name)
    notes = [node for node in ui(name)["nodes"] if node["type"] in ex.UI_ONLY]
    assert len(notes) == 1, f"{name}: {len(notes)} notes"
    (text,) = notes[0]["widgets_values"]
    assert example.repo in text
    loader = next(n for n in ui(name)["nodes"] if n["type"] in CHAIN["loader"])
    assert loader["widgets_values"][0] == example.model  # the Note's folder (or 'auto') is the one the loader picks
    if example.model == ex.sf.AUTO_CONFIG:  # the configs the pack carries: nothing to download but the files
        assert "config 'auto'" in text and "download" not in text.replace("Nothing else to download", "")
        return
    assert example.download_command() in text
    assert f"--local-dir {ex.MODELS_DIR}/{example.model}" in example.download_command()
    assert example.model in text and "huggingface-cli download" in text
    if example.gated:
        assert "gated" in text


@pytest.mark.parametrize("name", SINGLE_FILE)
def test_single_file_note_names_each_file_its_folder_and_address(name: str) -> None:
    """The loader picks the configs the pack carries ('auto') and the files the Note lists, each
    under the ComfyUI models folder the node lists it from, with its download address."""
    example = ex.example(name)
    (text,) = next(n for n in ui(name)["nodes"] if n["type"] in ex.UI_ONLY)["widgets_values"]
    loader = next(n for n in ex.api_prompt(name, "m").values() if n["class_type"] == ex.sf.SINGLE_FILE_LOADER)
    assert loader["inputs"]["config"] == "m" and example.model == ex.sf.AUTO_CONFIG  # the placeholder: 'auto'
    experts = ["denoiser", "denoiser_2"] if "a14b" in name else ["denoiser"]  # Wan 2.2 A14B: two experts' files
    encoders = ["text_encoder", "text_encoder_2"] if example.pipeline == "FluxPipeline" else ["text_encoder"]
    checkpoint = example.files[0].folder == "checkpoints"  # LTX-2's all-in-one file holds its VAEs
    assert [f.input for f in example.files] == [*experts, *encoders, *([] if checkpoint else ["vae"])]
    assert ("the loader reads them from it" in text) == checkpoint
    assert ("the low-noise one in denoiser_2" in text) == (len(experts) == 2)
    for file in example.files:
        assert loader["inputs"][file.input] == file.name
        assert f"{ex.sf.COMFY_MODELS}/{file.folder}/{file.name}\n  {file.url}" in text
        assert file.url.startswith(f"https://huggingface.co/{file.repo}/resolve/main/") and file.url.endswith(file.name)
    assert {f.folder for f in example.files} == ({"checkpoints", "text_encoders"} if checkpoint else
                                                 {"diffusion_models", "text_encoders", "vae"})
    assert ("ComfyUI-GGUF" in text) == example.files[0].name.endswith(".gguf")


# ---------------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("name", NAMES)
def test_template_loads_only_inputs_the_pack_ships(name: str) -> None:
    twin = [n["inputs"]["image"] for n in ex.api_prompt(name, "m").values() if n["class_type"] == "LoadImage"]
    assert loaded_images(name) == twin
    for image in twin:
        assert (ex.INPUT_DIR / image).is_file(), f"{name} loads {image}, which is not in {ex.INPUT_DIR}"


def test_every_shipped_input_is_used_and_is_what_the_tool_draws() -> None:
    used = {image for name in NAMES for image in loaded_images(name)}
    assert {p.name for p in ex.INPUT_DIR.iterdir()} == used == set(ex.KEYFRAMES)
    for file, kind in ex.KEYFRAMES.items():
        with Image.open(ex.INPUT_DIR / file) as shipped:
            assert shipped.size == ex.KEYFRAME_SIZE and shipped.mode == "RGB"
            drawn = np.asarray(ex.keyframe(kind), dtype=np.int16)
            assert np.abs(np.asarray(shipped, dtype=np.int16) - drawn).max() <= 1, file


def test_shipping_inputs_copies_what_is_missing_and_never_overwrites(comfy: harness.ComfyHost, tmp_path: Path) -> None:
    """The pack copies the templates' inputs into ComfyUI's input folder at load; a file of the
    same name already there (the user's) stays as it is."""
    inputs = comfy.pack_submodule("nodes.inputs")
    target = Path(inputs.folder_paths.get_input_directory())
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "dofl_test_new.png").write_bytes(b"new")
    (shipped / "dofl_test_taken.png").write_bytes(b"ours")
    (target / "dofl_test_taken.png").write_bytes(b"the user's")
    try:
        assert inputs.ship_template_inputs(shipped) == ["dofl_test_new.png"]
        assert (target / "dofl_test_new.png").read_bytes() == b"new"
        assert (target / "dofl_test_taken.png").read_bytes() == b"the user's"
        assert inputs.ship_template_inputs(shipped) == []
    finally:
        for name in ("dofl_test_new.png", "dofl_test_taken.png"):
            (target / name).unlink(missing_ok=True)


def test_comfyui_offers_the_shipped_inputs_to_load_image(comfy: harness.ComfyHost) -> None:
    """What the frontend checks on load: each LoadImage value among the node's listed files.
    Runs before the twin below writes its own copies into the input folder."""
    options = ex.object_info(comfy, "LoadImage")["input"]["required"]["image"][0]
    assert set(ex.KEYFRAMES) <= set(options)


# ----------------------------------------------------------------------------- the chain


@pytest.mark.parametrize("name", NAMES)
def test_template_is_the_plain_chain(name: str) -> None:
    """Settings feed the loader (or none: the loader's defaults), whose pipe goes to one Generate
    node, saved by one Save node."""
    prompt = ex.api_prompt(name, "m")
    role = {node_id: next(r for r, kinds in CHAIN.items() if n["class_type"] in kinds) for node_id, n in prompt.items()}
    by_role = {r: [i for i, x in role.items() if x == r] for r in CHAIN}
    assert len(by_role["settings"]) == (0 if name in WITHOUT_SETTINGS else 1), by_role
    assert all(len(by_role[r]) == 1 for r in ("loader", "generate", "save")), by_role
    (loader,), (generate,), (save,) = (by_role[r] for r in ("loader", "generate", "save"))
    assert prompt[loader]["inputs"].get("offload") == next(([s, 0] for s in by_role["settings"]), None)
    assert prompt[generate]["inputs"]["pipe"] == [loader, 0]
    assert next(v for v in prompt[save]["inputs"].values() if isinstance(v, list))[0] == generate


def test_first_last_twin_runs_on_the_keyframes_it_ships(comfy: harness.ComfyHost, tiny_h3_dir: Path) -> None:
    example = ex.example("h3_first_last_to_video")
    model = ex.link_model(Path(comfy.folder_paths.get_folder_paths("diffusers")[0]), tiny_h3_dir)
    prompt = ex.api_prompt(example.name, model, example.tiny_overrides())
    input_dir = Path(comfy.folder_paths.get_input_directory())
    for image in loaded_images(example.name):
        shutil.copyfile(ex.INPUT_DIR / image, input_dir / image)  # as the pack's copy would place them

    result = comfy.run_prompt(prompt).raise_for_error()

    save = next(i for i, n in prompt.items() if n["class_type"] == "SaveVideo")
    assert len(comfy.output_files(result, save)) == 1
